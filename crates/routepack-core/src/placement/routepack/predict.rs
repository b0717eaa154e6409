//! The predicted time of one layer's placement over the window, from the chunk demand: what
//! the migration choice weighs against the exposed migration time, and what the stage
//! reports as `predicted`.
//!
//! A proxy of the cost model (`simulate`'s expert and all-to-all terms), not the model
//! itself. Its approximations:
//! * **exchanges from chunks**: the window's exchanges of this layer are stood in for by
//!   `exchanges` consecutive runs of chunks (the packing that makes the real (group, step)
//!   exchanges is not known yet), and each group is taken to run 1/G of them (the mean over
//!   groups, not the slowest group);
//! * **per-exchange peak**: in each exchange, the heaviest rank's tokens set both the expert
//!   time (`c_tok` per token, as [`CostModel::expert_time`] with the `c_exp` term dropped) and
//!   the all-to-all time;
//! * **receivers only, origins uniform**: each copy's weight per token of its expert's load
//!   is what the packer balances (`copy_cost::copy_shares`: its compute plus its receiving
//!   all-to-all over each link under node-first feeding, tokens originating evenly over the
//!   group, copies on distinct nodes), and the heaviest rank's weighted tokens are priced at a
//!   lone copy's seconds per token (expert compute plus [`CostModel::uniform_seconds_per_byte`],
//!   which is what a lone copy receives from uniform origins); where the samples run (the
//!   packing, not known yet) and the senders' side (`simulate` takes max(sent, received) per
//!   rank) are ignored. Where the heaviest sender sets the all-to-all, the proxy can rank two
//!   nearly balanced placements unlike `simulate` (seen with routepack's and the static
//!   placement on the test windows below, whose peaks differ by a few percent), so it is
//!   trusted for clear differences only;
//! * **no replication**: an expert's demand is split evenly over its placement copies (then
//!   weighted as above), and intra-batch replicas (the `replication` stage) are not modelled.
//!
//! `tests::ranks_placements_as_simulate_does` ties it to `simulate`: on plans without
//! replicas, one group and `c_exp = 0`, it must rank a balanced and a skewed placement as
//! `simulate` does, and its value must lie within a factor of 1.5 of `simulate`'s expert +
//! all-to-all time.

use super::copy_cost::copy_shares;
use crate::cost::CostModel;
use crate::topology::Topology;

/// The predicted-time proxy of one layer's phy2log: Σ over exchanges of the largest rank load
/// in that exchange (tokens), times the seconds one token on the critical rank costs (expert
/// compute and its all-to-all share), over the number of EP groups (each runs 1/G of the
/// exchanges).
pub(crate) struct Predictor<'a> {
    /// `[E, X]` demand per exchange (chunks merged into X consecutive runs).
    demand: Vec<f64>,
    num_exchanges: usize,
    per_token: f64,
    /// `[slots + 1]` a copy's weight per token of its expert's load, by copy count
    /// (`copy_cost::copy_shares`).
    shares: Vec<f64>,
    groups: f64,
    topo: &'a Topology,
}

impl<'a> Predictor<'a> {
    /// The proxy of one layer with aggregate `loads` `[E]` and `chunks` `[E, num_chunks]`,
    /// merged into `exchanges` runs (0: one per chunk; without chunks: one exchange).
    pub(crate) fn new(loads: &[f64], chunks: &[f64], num_chunks: usize, exchanges: usize, cost: &CostModel, topo: &'a Topology) -> Self {
        let e_n = loads.len();
        let (demand, num_exchanges) = if num_chunks == 0 {
            (loads.to_vec(), 1)
        } else {
            let c = if exchanges == 0 { num_chunks } else { exchanges.min(num_chunks) };
            // exchange k holds the consecutive chunks b with b·c / num_chunks == k, from `start[k]`
            let mut start = vec![num_chunks; c + 1];
            for b in (0..num_chunks).rev() {
                start[b * c / num_chunks] = b;
            }
            let mut v = vec![0.0; e_n * c];
            for (row, src) in v.chunks_exact_mut(c).zip(chunks.chunks_exact(num_chunks)) {
                for (k, x) in row.iter_mut().enumerate() {
                    *x = src[start[k]..start[k + 1]].iter().fold(0.0, |s, &y| s + y);
                }
            }
            (v, c)
        };
        let a2a = cost.token_bytes * cost.uniform_seconds_per_byte(topo);
        let per_token = cost.compute_passes() * cost.c_tok + cost.all_to_all_of_link_time(a2a);
        // every count a layer can give an expert (more than ep when slots outnumber experts)
        let shares = copy_shares(topo.num_slots(), topo, cost);
        Self { demand, num_exchanges, per_token, shares, groups: topo.num_groups() as f64, topo }
    }

    /// Predicted seconds of the layer placed as `layer` (its phy2log row).
    pub(crate) fn time(&self, layer: &[i32]) -> f64 {
        let (c_n, spr) = (self.num_exchanges, self.topo.slots_per_rank);
        let e_n = self.demand.len() / c_n;
        let mut cnt = vec![0u32; e_n];
        for &e in layer.iter().filter(|&&e| e >= 0) {
            cnt[e as usize] += 1;
        }
        let mut peak = vec![0.0f64; c_n];
        let mut rank = vec![0.0f64; c_n];
        for r in 0..self.topo.ep {
            rank.iter_mut().for_each(|x| *x = 0.0);
            for &e in layer[r * spr..(r + 1) * spr].iter().filter(|&&e| e >= 0) {
                let share = self.shares[cnt[e as usize] as usize];
                for (x, &y) in rank.iter_mut().zip(&self.demand[e as usize * c_n..(e as usize + 1) * c_n]) {
                    *x += y * share;
                }
            }
            for (p, &x) in peak.iter_mut().zip(&rank) {
                *p = p.max(x);
            }
        }
        peak.iter().sum::<f64>() * self.per_token / self.groups
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packing::sequential::sequential;
    use crate::placement::demand::{window_loads, Demand};
    use crate::placement::routepack::test_windows::window_data;
    use crate::placement::routepack::{routepack_placement, Options};
    use crate::placement::Placement;
    use crate::plan::Plan;
    use crate::simulate::simulate;
    use crate::window::WindowView;

    /// The approximations of the module docs, checked against `simulate` where they are the
    /// only difference: one EP group, one step (so one exchange per layer, the predictor's
    /// single run of the aggregate loads), one slot per expert (no placement copies), no
    /// replicas, `c_exp = 0`. Then the predictor's expert term is exact and only its
    /// all-to-all differs: it must rank routepack's balanced placement and a skewed one (the
    /// hottest experts together) as `simulate` does, and stay within a factor of 1.5 of
    /// `simulate`'s expert + all-to-all seconds for each.
    #[test]
    fn ranks_placements_as_simulate_does() {
        for seed in 0..4 {
            let (l_n, e_n) = (3, 32);
            let topo = Topology::new(8, 8, 4, 4).unwrap(); // 2 nodes, 32 slots: no copies
            let (lens, x) = window_data(64, l_n, e_n, seed);
            let w = WindowView::new(&lens, &x, l_n, e_n).unwrap();
            let loads = window_loads(&w);
            let mut cost = CostModel::for_tests(l_n);
            cost.c_exp = 0.0;
            let d = Demand::new(&loads, &[], l_n, e_n, 0).unwrap();
            let balanced = routepack_placement(&d, &topo, &cost, None, &Options::default()).unwrap().placement;
            // the hottest experts of each layer together, four to a rank, heaviest rank first
            let mut phy2log = Vec::with_capacity(l_n * e_n);
            for l in 0..l_n {
                let mut by_load: Vec<i32> = (0..e_n as i32).collect();
                by_load.sort_by(|&a, &b| loads[l * e_n + b as usize].total_cmp(&loads[l * e_n + a as usize]));
                phy2log.extend(by_load);
            }
            let skewed = Placement::new(phy2log, l_n, e_n, topo.slots_per_rank).unwrap();
            let cap = w.total_tokens();
            let packed = sequential(w.seq_lens, cap, topo.dp).unwrap();
            assert_eq!(packed.num_micro, 1, "one step: one exchange per layer");
            let (predicted, simulated): (Vec<f64>, Vec<f64>) = [balanced, skewed]
                .into_iter()
                .map(|p: Placement| {
                    let pred: f64 =
                        (0..l_n).map(|l| Predictor::new(&loads[l * e_n..(l + 1) * e_n], &[], 0, 0, &cost, &topo).time(p.layer(l))).sum();
                    let plan = Plan {
                        placement: p,
                        sample_rank: packed.sample_rank.clone(),
                        sample_micro: packed.sample_micro.clone(),
                        num_micro: packed.num_micro,
                        replicas: vec![],
                        migration: vec![],
                    };
                    let r = simulate(&plan, &w, &topo, &cost, None).unwrap();
                    (pred, r.expert + r.all_to_all)
                })
                .unzip();
            assert_eq!(
                predicted[0] < predicted[1],
                simulated[0] < simulated[1],
                "seed {seed}: the proxy ranks the placements as simulate does"
            );
            for (p, s) in predicted.iter().zip(&simulated) {
                assert!(*p <= 1.5 * s && *s <= 1.5 * p, "seed {seed}: predicted {p} and simulated {s} differ by more than 1.5x");
            }
        }
    }
}
