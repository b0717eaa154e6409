//! The samples' demand vectors: routing projected through the placement (`project`), stored
//! compactly (`SampleDemand`), and summed per cell (`Proxy::cell_table` and its updates).

use rayon::prelude::*;

use super::{Proxy, Src};
use crate::layout::kernel::{Demand, Shape, LANES};
use crate::plan::Placement;
use crate::topology::Topology;
use crate::window::WindowView;

/// Per layer: the single-replica experts grouped by their rank, as CSR (rank p's are
/// `experts[off[p]..off[p + 1]]`, ascending), the (expert, rank, share) triples of
/// replicated experts, shares on one rank merged, and the ranks those land on.
struct Routes {
    off: Vec<usize>,
    experts: Vec<u32>,
    multi: Vec<(usize, usize, f64)>,
    /// `[ep]` whether some replicated expert has a share on rank p (its value is rounded).
    shared: Vec<bool>,
}

fn routes(w: &WindowView, topo: &Topology, placement: &Placement) -> Vec<Routes> {
    (0..w.num_layers)
        .map(|l| {
            let (off, slots) = placement.replicas_of_layer(l);
            let mut single: Vec<(usize, u32)> = Vec::with_capacity(w.num_experts);
            let mut multi: Vec<(usize, usize, f64)> = Vec::new();
            for e in 0..w.num_experts {
                let sl = &slots[off[e]..off[e + 1]];
                if sl.len() == 1 {
                    single.push((topo.rank_of_slot(sl[0]), e as u32));
                    continue;
                }
                let start = multi.len();
                for &slot in sl {
                    let p = topo.rank_of_slot(slot);
                    match multi[start..].iter_mut().find(|x| x.1 == p) {
                        Some(x) => x.2 += 1.0 / sl.len() as f64,
                        None => multi.push((e, p, 1.0 / sl.len() as f64)),
                    }
                }
            }
            single.sort_unstable();
            let mut by_rank = vec![0usize; topo.ep + 1];
            for &(p, _) in &single {
                by_rank[p + 1] += 1;
            }
            for p in 0..topo.ep {
                by_rank[p + 1] += by_rank[p];
            }
            let mut shared = vec![false; topo.ep];
            multi.iter().for_each(|&(_, p, _)| shared[p] = true);
            Routes { off: by_rank, experts: single.into_iter().map(|(_, e)| e).collect(), multi, shared }
        })
        .collect()
}

/// Scratch of one worker of the projection, for `ep` EP ranks, `rpn` of them per node.
struct Scratch {
    ep: usize,
    rpn: usize,
    whole: Vec<i64>,
    part: Vec<f64>,
    /// Running sums of the single-replica experts' tokens in `Routes::experts` order.
    run: Vec<i64>,
}

impl Scratch {
    fn new(topo: &Topology) -> Self {
        let ep = topo.ep;
        Self { ep, rpn: topo.ranks_per_group_node(), whole: vec![0; ep + 1], part: vec![0.0; ep], run: Vec::new() }
    }
}

/// Rows (sample, layer) the projection prefetches ahead of the one it reads.
const ROWS_AHEAD: usize = 2;

/// Where a projection writes a sample's proj values (`Shape::proj_at` order, whole numbers).
trait ProjOut {
    /// Stores `v` at `i`; false where the store cannot hold it.
    fn put(&mut self, i: usize, v: f32) -> bool;
}

impl ProjOut for [f32] {
    #[inline(always)]
    fn put(&mut self, i: usize, v: f32) -> bool {
        self[i] = v;
        true
    }
}

impl ProjOut for [u16] {
    /// The value as u16 when it fits (a whole number ≤ 65,535 is exact in f32, and one
    /// above it is above 65,535 in f32 too).
    #[inline(always)]
    fn put(&mut self, i: usize, v: f32) -> bool {
        let fits = v <= u16::MAX as f32;
        self[i] = v as u16;
        fits
    }
}

/// Sample s's demand vector: its proj values into `proj` (`[proj_len]`) and its tail (otot,
/// onode: `[demand_len − proj_len]`, offsets less `proj_len`) into `tail`, every entry of a
/// layer written. Returns whether `proj` held every value.
///
/// Each rank's single-replica experts are summed as differences of one running sum over the
/// experts in rank order (one loop of fixed length, where a loop per rank ended at a
/// different count each time); a rank without a replicated expert's share holds a whole
/// number, which rounding leaves as it is, and the others round without a call
/// (`crate::rounding`): the values of `(whole + part).round()` on every rank, bit for bit.
#[allow(clippy::too_many_arguments)]
fn project_sample<P: ProjOut + ?Sized>(
    w: &WindowView,
    routes: &[Routes],
    shape: Shape,
    s: usize,
    sc: &mut Scratch,
    proj: &mut P,
    tail: &mut [f32],
) -> bool {
    let (ep, rpn, pl) = (sc.ep, sc.rpn, shape.proj_len());
    let (whole, part, run) = (&mut sc.whole, &mut sc.part, &mut sc.run);
    let mut fits = true;
    for (l, rt) in routes.iter().enumerate() {
        // the running sum reads the row out of order, which the CPU does not prefetch: ask
        // for the rows ahead (the next sample's first ones at the end of this one)
        // (rows in (sample, layer) order: any number of layers, the window's last row the last)
        let ahead = s * w.num_layers + l + ROWS_AHEAD;
        if ahead < w.num_samples * w.num_layers {
            w.prefetch_row(ahead / w.num_layers, ahead % w.num_layers);
        }
        part.iter_mut().for_each(|x| *x = 0.0);
        let x = w.tokens(s, l);
        // integer sums: any order is exact
        run.resize(rt.experts.len() + 1, 0);
        crate::with_counts!(x, x => {
            let mut acc = 0i64;
            for (r, &e) in run[1..].iter_mut().zip(&rt.experts) {
                acc += i64::from(x[e as usize]);
                *r = acc;
            }
            for &(e, p, sh) in &rt.multi {
                part[p] += f64::from(x[e]) * sh;
            }
        });
        for (t, o) in whole[..ep].iter_mut().zip(rt.off.windows(2)) {
            *t = run[o[1]] - run[o[0]];
        }
        let at = shape.proj_at(l, 0);
        let mut sent = 0f32;
        for n in 0..ep.div_ceil(rpn) {
            let ranks = n * rpn..((n + 1) * rpn).min(ep);
            let mut node_sent = 0f32;
            for p in ranks.clone() {
                let v = if rt.shared[p] { crate::rounding::round(whole[p] as f64 + part[p]) as f32 } else { whole[p] as f64 as f32 };
                fits &= proj.put(at + p * LANES, v);
                sent += v;
                node_sent += v;
            }
            if ranks.len() == rpn {
                tail[shape.onode_at(l, n) - pl] = node_sent;
            }
        }
        tail[shape.otot_at(l) - pl] = sent;
    }
    fits
}

/// Every sample's demand vector, `[S, demand_len]` (see the module docs of `proxy`): tokens
/// for expert e are split evenly over e's replicas and rounded to whole tokens per
/// (sample, layer, rank), so every sum is exact in f32 whatever the placement.
pub(super) fn project(w: &WindowView, topo: &Topology, placement: &Placement, shape: Shape) -> Vec<f32> {
    let routes = routes(w, topo, placement);
    let (demand_len, pl) = (shape.demand_len(), shape.proj_len());
    let mut demand = vec![0f32; w.num_samples * demand_len];
    demand.par_chunks_mut(demand_len).enumerate().for_each_init(
        || Scratch::new(topo),
        |sc, (s, out)| {
            let (proj, tail) = out.split_at_mut(pl);
            project_sample(w, &routes, shape, s, sc, proj, tail);
        },
    );
    demand
}

/// [`project`] stored as [`SampleDemand::new`] stores it, without holding the `[S, demand_len]`
/// f32 table on the way when the compact form fits (each sample is projected straight into
/// its u16 proj and f32 tail): the same values, at about 45% of the peak memory (the proxy
/// of a Kimi-K2-like window, 32K samples over ep 64, held 0.58 GB of f32 next to its 0.26 GB
/// compact copy). Where some proj value needs more than 16 bits, the f32 table is built.
pub(super) fn project_compact(w: &WindowView, topo: &Topology, placement: &Placement, shape: Shape) -> SampleDemand {
    let routes = routes(w, topo, placement);
    let (len, pl) = (shape.demand_len(), shape.proj_len());
    let mut proj = vec![0u16; w.num_samples * pl];
    let mut tail = vec![0f32; w.num_samples * (len - pl)];
    let fits = proj
        .par_chunks_mut(pl)
        .zip(tail.par_chunks_mut(len - pl))
        .enumerate()
        .map_init(|| Scratch::new(topo), |sc, (s, (p, t))| project_sample(w, &routes, shape, s, sc, p, t))
        .all(|ok| ok);
    if fits {
        SampleDemand::U16 { proj, tail }
    } else {
        drop((proj, tail));
        SampleDemand::new(project(w, topo, placement, shape), shape)
    }
}

/// The samples' demand vectors: `[S, demand_len]` f32, or, when every proj value fits in 16
/// bits (tokens one sample sends one rank in one layer: almost always), proj `[S, proj_len]`
/// in u16 and the tails (otot, onode) `[S, demand_len − proj_len]` in f32. The annealer
/// streams random samples' demand from a table of tens of MiB; half the bytes is a faster
/// move.
pub enum SampleDemand {
    /// `[S, demand_len]`
    F32(Vec<f32>),
    /// Compact: proj in u16, the tails in f32.
    U16 {
        /// `[S, proj_len]`
        proj: Vec<u16>,
        /// `[S, demand_len − proj_len]`
        tail: Vec<f32>,
    },
}

impl SampleDemand {
    /// Compact vectors of `full` (`[S, demand_len]`) when they fit, else `full` itself.
    pub(super) fn new(full: Vec<f32>, shape: Shape) -> Self {
        let (len, pl) = (shape.demand_len(), shape.proj_len());
        if full.chunks_exact(len).any(|r| r[..pl].iter().any(|&x| x > u16::MAX as f32)) {
            return SampleDemand::F32(full);
        }
        let proj = full.chunks_exact(len).flat_map(|r| r[..pl].iter().map(|&x| x as u16)).collect();
        let tail = full.chunks_exact(len).flat_map(|r| r[pl..].iter().copied()).collect();
        SampleDemand::U16 { proj, tail }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            SampleDemand::F32(x) => x.len() * 4,
            SampleDemand::U16 { proj, tail } => proj.len() * 2 + tail.len() * 4,
        }
    }

    /// Sample s's demand vector.
    #[inline]
    pub(super) fn of(&self, s: usize, shape: Shape) -> Demand<'_> {
        let (len, pl) = (shape.demand_len(), shape.proj_len());
        match self {
            SampleDemand::F32(x) => Demand::F32(&x[s * len..(s + 1) * len]),
            SampleDemand::U16 { proj, tail } => {
                Demand::U16 { proj: &proj[s * pl..(s + 1) * pl], tail: &tail[s * (len - pl)..(s + 1) * (len - pl)] }
            }
        }
    }
}

impl Proxy {
    /// Length of a demand vector (a sample's or a cell's).
    #[inline]
    pub fn demand_len(&self) -> usize {
        self.shape.demand_len()
    }
    /// Tokens sample s sends in layer l.
    #[inline]
    pub fn sent(&self, s: usize, l: usize) -> f32 {
        match self.demand.of(s, self.shape) {
            Demand::F32(r) => r[self.shape.otot_at(l)],
            Demand::U16 { tail, .. } => tail[self.shape.otot_at(l) - self.shape.proj_len()],
        }
    }

    /// Adds (`sign` = 1) or removes (−1) sample s's demand vector to/from a cell's `demand`.
    /// Values are whole numbers, so a cell's vector always equals the sum over its samples.
    pub fn add_sample(&self, demand: &mut [f32], s: usize, sign: f32) {
        match self.demand.of(s, self.shape) {
            Demand::F32(r) => {
                for (x, &y) in demand.iter_mut().zip(r) {
                    *x += sign * y;
                }
            }
            Demand::U16 { proj, tail } => {
                let (rp, rt) = demand.split_at_mut(proj.len());
                for (x, &y) in rp.iter_mut().zip(proj) {
                    *x += sign * y as f32;
                }
                for (x, &y) in rt.iter_mut().zip(tail) {
                    *x += sign * y;
                }
            }
        }
    }

    /// Cell demand `dem_a` loses sample s and gains t, `dem_b` the other way round: one pass
    /// over each (the values are whole numbers, so this is exactly four `add_sample`s).
    pub fn swap_samples(&self, dem_a: &mut [f32], dem_b: &mut [f32], s: usize, t: usize) {
        let swap = |x: &mut f32, y: &mut f32, vs: f32, vt: f32| {
            let d = vt - vs;
            *x += d;
            *y -= d;
        };
        match (self.demand.of(s, self.shape), self.demand.of(t, self.shape)) {
            (Demand::F32(rs), Demand::F32(rt)) => {
                for (((x, y), &vs), &vt) in dem_a.iter_mut().zip(dem_b.iter_mut()).zip(rs).zip(rt) {
                    swap(x, y, vs, vt);
                }
            }
            (Demand::U16 { proj: ps, tail: ts }, Demand::U16 { proj: pt, tail: tt }) => {
                let pl = ps.len();
                let (pa, ta) = dem_a.split_at_mut(pl);
                let (pb, tb) = dem_b.split_at_mut(pl);
                for (((x, y), &vs), &vt) in pa.iter_mut().zip(pb.iter_mut()).zip(ps).zip(pt) {
                    swap(x, y, vs as f32, vt as f32);
                }
                for (((x, y), &vs), &vt) in ta.iter_mut().zip(tb.iter_mut()).zip(ts).zip(tt) {
                    swap(x, y, vs, vt);
                }
            }
            _ => unreachable!("all samples' demand vectors are of one kind"),
        }
    }

    /// The per-cell table `[cells, demand_len]` of a layout.
    pub fn cell_table(&self, cell_of: &[u32]) -> Vec<f32> {
        let len = self.demand_len();
        let mut t = vec![0f32; self.cells() * len];
        for (s, &c) in cell_of.iter().enumerate() {
            let c = c as usize;
            self.add_sample(&mut t[c * len..(c + 1) * len], s, 1.0);
        }
        t
    }

    /// A source's demand vector (None: zeros); `cells` is the per-cell table.
    #[inline]
    pub(super) fn source<'a>(&'a self, src: Src, cells: &'a [f32]) -> Option<Demand<'a>> {
        let len = self.demand_len();
        match src {
            Src::Zero => None,
            Src::Sample(s) => Some(self.demand.of(s as usize, self.shape)),
            Src::Cell(c) => Some(Demand::F32(&cells[c * len..(c + 1) * len])),
        }
    }
}
