//! One Metropolis chain over layouts, with the moves that keep every invariant.
//!
//! Moves (a cell is a (DP rank, microbatch) pair; a layout puts every sample in one cell):
//! * move a sample to another cell (only if its cell keeps another sample and the target
//!   stays within the cap);
//! * swap two samples of different cells (only if both cells stay within the cap), either
//!   two random samples or a sample and one of its neighbours in length order (near-equal
//!   lengths keep attention and tokens almost unchanged and nearly always fit under the cap,
//!   which matters when rows are nearly full; what changes is the expert mix);
//! * swap the whole contents of two cells ("swap rows between cells"): always feasible.
//!
//! Coverage, the cap, non-empty cells and equal microbatch counts (the cell grid is fixed)
//! hold after every accepted move. Half of the moves take their first cell from the currently
//! slowest EP group, where an improvement lowers the step time.
//!
//! Reordering microbatches is not a move: the cost sums over them, so a group's microbatch order does not
//! change it.

use rand::Rng;
use rand_xoshiro::Xoshiro256PlusPlus;

use super::detmath;
use super::proxy::{Delta, Proxy, Shards, Src};

/// A near-length partner is at most this many places away in length order.
const NEAR: usize = 16;

/// Relative frequencies of the proposals (the defaults are in
/// `packing::routepack::Options::default`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoveMix {
    /// Move a sample to another cell.
    pub shift: f64,
    /// Swap two random samples of different cells.
    pub swap: f64,
    /// Swap a sample with a near-length partner.
    pub near: f64,
    /// Swap the contents of two cells.
    pub cells: f64,
}

impl MoveMix {
    /// Cumulative thresholds (shift, swap, near) in [0, 1]; None if the weights are not
    /// finite, negative, or all zero.
    pub fn thresholds(&self) -> Option<[f64; 3]> {
        let w = [self.shift, self.swap, self.near, self.cells];
        let total: f64 = w.iter().sum();
        if w.iter().any(|x| !x.is_finite() || *x < 0.0) || total <= 0.0 {
            return None;
        }
        Some([w[0] / total, (w[0] + w[1]) / total, (w[0] + w[1] + w[2]) / total])
    }
}

/// One Metropolis chain of the population annealer: a layout (every sample's cell), the
/// proxy's cached cost state of that layout and the chain's own random stream. Every
/// accepted move keeps the layout valid (see the module docs).
#[derive(Clone)]
pub struct Chain {
    /// The chain's random stream, seeded per chain index; it stays with the chain when
    /// resampling copies another chain's layout in ([`Chain::copy_state_from`]), so runs are
    /// deterministic for a seed.
    pub rng: Xoshiro256PlusPlus,
    /// Cumulative proposal thresholds (see `MoveMix`).
    mix: [f64; 3],
    /// `[S]` cell d·M + m of each sample.
    pub cell_of: Vec<u32>,
    /// `[S]` position of each sample in its cell's member list.
    pos: Vec<u32>,
    members: Vec<Vec<u32>>,
    /// The proxy's per-cell and per-(group, microbatch) cost state of the current layout, kept
    /// up to date by every accepted move.
    pub sh: Shards,
    /// The annealer's energy of the current layout, in proxy seconds:
    /// max_g C_g + λ · mean_g C_g (`Proxy::energy`).
    pub energy: f64,
    /// Proposals drawn, including those rejected before pricing (infeasible, or fewer than
    /// two cells).
    pub proposed: u64,
    /// Proposals that passed the feasibility checks and were priced by the proxy.
    pub evaluated: u64,
    /// Proposals accepted (applied to the layout).
    pub accepted: u64,
    // scratch, not state
    d_a: Delta,
    d_b: Delta,
    /// `[cells, demand_len]` demand of each cell's samples (cell swaps read it; see
    /// `Proxy::cell_table`).
    cagg: Vec<f32>,
}

/// A proposal, evaluated but not yet applied.
#[derive(Clone, Copy)]
enum Kind {
    Move { s: usize },
    Swap { s: usize, t: usize },
    Cells,
}

struct Proposal {
    kind: Kind,
    a: usize,
    b: usize,
    gm_a: usize,
    gm_b: usize,
    cost_a: f64,
    cost_b: f64,
    energy: f64,
}

impl Chain {
    /// A chain at layout `cell_of` (every cell non-empty and within the cap: the caller checks).
    pub fn new(px: &Proxy, cell_of: &[u32], rng: Xoshiro256PlusPlus, mix: MoveMix) -> Self {
        let mix = mix.thresholds().expect("move mix weights are checked by the caller");
        let mut members: Vec<Vec<u32>> = vec![Vec::new(); px.cells()];
        let mut pos = vec![0u32; cell_of.len()];
        for (s, &c) in cell_of.iter().enumerate() {
            pos[s] = members[c as usize].len() as u32;
            members[c as usize].push(s as u32);
        }
        let sh = px.build(cell_of);
        let energy = px.energy(&sh.group_cost);
        Self {
            rng,
            mix,
            cell_of: cell_of.to_vec(),
            pos,
            members,
            sh,
            energy,
            proposed: 0,
            evaluated: 0,
            accepted: 0,
            d_a: Delta::one(Src::Zero, Src::Zero, 0, 0.0, 0.0),
            d_b: Delta::one(Src::Zero, Src::Zero, 0, 0.0, 0.0),
            cagg: px.cell_table(cell_of),
        }
    }

    /// Bytes this chain holds on the heap (what each further chain of a population costs).
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of_val;
        let members: usize = self.members.iter().map(|m| size_of_val(m.as_slice())).sum();
        let sh = &self.sh;
        size_of_val(self.cell_of.as_slice())
            + size_of_val(self.pos.as_slice())
            + size_of_val(self.members.as_slice())
            + members
            + size_of_val(sh.gm.as_slice())
            + size_of_val(sh.lin.as_slice())
            + size_of_val(sh.quad.as_slice())
            + size_of_val(sh.att_top.as_slice())
            + size_of_val(sh.gm_cost.as_slice())
            + size_of_val(sh.group_cost.as_slice())
            + size_of_val(sh.group_prefix.as_slice())
            + size_of_val(self.cagg.as_slice())
    }

    /// Takes `other`'s layout and state, keeping this chain's random stream and counters
    /// (population resampling: the RNG belongs to the chain index, not to the layout).
    pub fn copy_state_from(&mut self, other: &Chain) {
        self.cell_of.clone_from(&other.cell_of);
        self.pos.clone_from(&other.pos);
        self.members.clone_from(&other.members);
        self.sh.clone_from(&other.sh);
        self.cagg.clone_from(&other.cagg);
        self.energy = other.energy;
    }

    #[inline]
    fn below(&mut self, n: usize) -> usize {
        ((self.rng.next_u64() as u128 * n as u128) >> 64) as usize
    }
    #[inline]
    fn unit(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Runs `moves` proposals at temperature `temp` (0: only non-worsening moves). Stops early
    /// at `deadline`; returns false if it did.
    pub fn run(&mut self, px: &Proxy, moves: u64, temp: f64, deadline: Option<std::time::Instant>) -> bool {
        for i in 0..moves {
            if i % 1024 == 1023 && deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return false;
            }
            if let Some(p) = self.propose(px) {
                let delta = p.energy - self.energy;
                let accept = delta <= 0.0 || (temp > 0.0 && metropolis(self.unit(), -delta / temp));
                if accept {
                    self.apply(px, p);
                }
            }
        }
        true
    }

    /// Energy change of one random proposal, without applying it (None when infeasible).
    pub fn trial_delta(&mut self, px: &Proxy) -> Option<f64> {
        self.propose(px).map(|p| p.energy - self.energy)
    }

    fn propose(&mut self, px: &Proxy) -> Option<Proposal> {
        self.proposed += 1;
        let cells = px.cells();
        if cells < 2 {
            return None;
        }
        let per_group = px.ep * px.micro;
        let a = if px.groups > 1 && self.rng.next_u64() >> 63 == 1 {
            let crit = (0..px.groups).fold(0, |b, g| if self.sh.group_cost[g] > self.sh.group_cost[b] { g } else { b });
            crit * per_group + self.below(per_group)
        } else {
            self.below(cells)
        };
        let r = self.unit();
        let mut b = self.below(cells - 1);
        if b >= a {
            b += 1;
        }
        // a near-length swap takes its second cell from the partner sample
        let mut near = None;
        if (self.mix[1]..self.mix[2]).contains(&r) {
            let i = self.below(self.members[a].len());
            let s = self.members[a][i] as usize;
            let off = 1 + self.below(NEAR);
            let pos = px.len_rank[s] as usize;
            let q = if self.rng.next_u64() >> 63 == 1 { pos + off } else { pos.wrapping_sub(off) };
            let t = *px.by_len.get(q)? as usize;
            let cb = self.cell_of[t] as usize;
            if cb == a {
                return None;
            }
            b = cb;
            near = Some((s, t));
        }
        let (pa, pb) = (px.rank_of(a), px.rank_of(b));
        let (gm_a, gm_b) = (px.gm_of(a), px.gm_of(b));
        let same = gm_a == gm_b;
        let cap = px.token_cap;
        // every move is "add − sub" entering cell a (and leaving cell b), see `cost::Delta`
        let (kind, add, sub) = if r < self.mix[0] {
            let i = self.below(self.members[a].len());
            let s = self.members[a][i] as usize;
            // i128: a cell's tokens plus a sample's overflow i64 under a cap near 2^63
            if self.members[a].len() < 2 || self.sh.lin[b] as i128 + px.lens[s] as i128 > cap as i128 {
                return None;
            }
            // s leaves a for b: "add − sub" = −s
            (Kind::Move { s }, Src::Zero, Src::Sample(s as u32))
        } else if r < self.mix[2] {
            let (s, t) = match near {
                Some(st) => st,
                None => {
                    let (i, j) = (self.below(self.members[a].len()), self.below(self.members[b].len()));
                    (self.members[a][i] as usize, self.members[b][j] as usize)
                }
            };
            let d = (px.lens[t] - px.lens[s]) as i128;
            if self.sh.lin[a] as i128 + d > cap as i128 || self.sh.lin[b] as i128 - d > cap as i128 {
                return None;
            }
            (Kind::Swap { s, t }, Src::Sample(t as u32), Src::Sample(s as u32))
        } else {
            // whole cells: each cell's samples as one source
            (Kind::Cells, Src::Cell(b), Src::Cell(a))
        };
        if same {
            self.d_a = Delta::shift(add, sub, pb, pa);
        } else {
            self.d_a = Delta::one(add, sub, pa, 1.0, 1.0);
            self.d_b = Delta::one(add, sub, pb, -1.0, -1.0);
        }
        self.evaluated += 1;
        let (cost_a, cost_b) = if same {
            let c = px.eval_gm(&self.sh, gm_a, &self.d_a, &self.cagg);
            (c, c)
        } else {
            px.eval_pair(&self.sh, gm_a, &self.d_a, gm_b, &self.d_b, &self.cagg)
        };
        // group totals with the new (group, microbatch) costs, summed in microbatch order (from the partial
        // sum before the first changed microbatch; once when both microbatches are in one group)
        let m_n = px.micro;
        let (g_a, g_b) = (gm_a / m_n, gm_b / m_n);
        let changed = [(gm_a, cost_a), (gm_b, cost_b)];
        let ta = px.group_total_with(&self.sh, g_a, changed);
        let tb = if g_b == g_a { ta } else { px.group_total_with(&self.sh, g_b, changed) };
        let mut max = 0.0f64;
        let mut sum = 0.0f64;
        for g in 0..px.groups {
            let c = if g == g_a {
                ta
            } else if g == g_b {
                tb
            } else {
                self.sh.group_cost[g]
            };
            max = max.max(c);
            sum += c;
        }
        let energy = max + px.lambda * sum / px.groups as f64;
        Some(Proposal { kind, a, b, gm_a, gm_b, cost_a, cost_b, energy })
    }

    fn apply(&mut self, px: &Proxy, p: Proposal) {
        self.accepted += 1;
        let (a, b) = (p.a, p.b);
        match p.kind {
            Kind::Move { s } => {
                let i = self.pos[s] as usize;
                self.members[a].swap_remove(i);
                if let Some(&moved) = self.members[a].get(i) {
                    self.pos[moved as usize] = i as u32;
                }
                self.pos[s] = self.members[b].len() as u32;
                self.members[b].push(s as u32);
                self.cell_of[s] = b as u32;
                self.sh.lin[a] -= px.lens[s];
                self.sh.quad[a] -= px.sq[s];
                self.sh.lin[b] += px.lens[s];
                self.sh.quad[b] += px.sq[s];
            }
            Kind::Swap { s, t } => {
                let (i, j) = (self.pos[s] as usize, self.pos[t] as usize);
                self.members[a][i] = t as u32;
                self.members[b][j] = s as u32;
                self.pos[s] = j as u32;
                self.pos[t] = i as u32;
                self.cell_of[s] = b as u32;
                self.cell_of[t] = a as u32;
                let (dl, dq) = (px.lens[t] - px.lens[s], px.sq[t] - px.sq[s]);
                self.sh.lin[a] += dl;
                self.sh.quad[a] += dq;
                self.sh.lin[b] -= dl;
                self.sh.quad[b] -= dq;
            }
            Kind::Cells => {
                self.members.swap(a, b);
                for &s in &self.members[a] {
                    self.cell_of[s as usize] = a as u32;
                }
                for &s in &self.members[b] {
                    self.cell_of[s as usize] = b as u32;
                }
                self.sh.lin.swap(a, b);
                self.sh.quad.swap(a, b);
            }
        }
        // the (group, microbatch) state first: a cell swap reads the cells' demand as it was before
        // the move
        if p.gm_b == p.gm_a {
            px.apply_gm(&mut self.sh, p.gm_a, &self.d_a, &self.cagg, p.cost_a);
        } else {
            px.apply_pair(&mut self.sh, p.gm_a, &self.d_a, p.gm_b, &self.d_b, &self.cagg, (p.cost_a, p.cost_b));
        }
        let len = px.demand_len();
        let (lo, hi) = (a.min(b), a.max(b));
        let (head, tail) = self.cagg.split_at_mut(hi * len);
        let (dem_lo, dem_hi) = (&mut head[lo * len..(lo + 1) * len], &mut tail[..len]);
        let (dem_a, dem_b) = if a < b { (dem_lo, dem_hi) } else { (dem_hi, dem_lo) };
        match p.kind {
            Kind::Move { s } => {
                px.add_sample(dem_a, s, -1.0);
                px.add_sample(dem_b, s, 1.0);
            }
            Kind::Swap { s, t } => px.swap_samples(dem_a, dem_b, s, t),
            Kind::Cells => dem_a.swap_with_slice(dem_b),
        }
        self.energy = p.energy;
    }

    /// Whether the incremental state equals a rebuild from `cell_of` (for tests).
    pub fn consistent(&self, px: &Proxy) -> bool {
        let fresh = px.build(&self.cell_of);
        px.cell_table(&self.cell_of) == self.cagg
            && fresh.gm == self.sh.gm
            && fresh.lin == self.sh.lin
            && fresh.quad == self.sh.quad
            && fresh.att_top == self.sh.att_top
            && fresh.gm_cost.iter().zip(&self.sh.gm_cost).all(|(x, y)| (x - y).abs() <= 1e-9 * x.abs().max(1e-30))
    }
}

/// Below this exponent e^x < 2^-53, the smallest positive `unit()`.
const EXP_BELOW_UNIT: f64 = -37.5;

/// Metropolis acceptance of a worsening move: u < e^x, with u from `Chain::unit`. Most
/// worsening moves late in a schedule have e^x below every positive u, so they are rejected
/// without the exp: the same decision.
#[inline]
fn metropolis(u: f64, x: f64) -> bool {
    if x < EXP_BELOW_UNIT && u != 0.0 {
        false
    } else {
        u < detmath::exp(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipping_exp_keeps_every_decision() {
        let smallest = 1.0 / (1u64 << 53) as f64;
        assert!(detmath::exp(EXP_BELOW_UNIT) < smallest);
        for i in 0..2000 {
            let x = EXP_BELOW_UNIT - i as f64 * 0.37;
            assert!(detmath::exp(x) < smallest, "exp({x})");
            for u in [0.0, smallest, 0.5] {
                assert_eq!(metropolis(u, x), u < detmath::exp(x));
            }
        }
    }
}
