//! `moonep`: MoonEP's per-microbatch exact balancer (Moonshot; vLLM PR 52101, Megatron-LM PR
//! 7450), the baseline as its planner publishes it (its torch reference of the GPU planning
//! kernel, `tests/planning_reference.py`, and its README).
//!
//! Per exchange (EP group, microbatch, layer), from the router's output: every rank of an
//! NVLink domain receives exactly its share of the domain's routed tokens, `S·K` when every rank
//! sends `S` tokens (with per-rank `s`, ⌊total / R⌋ and one more for the first `total mod R`
//! ranks: MoonEP's `total_num_tokens` mode, which routepack's unequal rows need). Home rank h's
//! load is what its experts receive; `balance[h] = load[h] − cap[h]`. While some rank is over
//! its cap, the most overloaded home h (lowest index on ties) fills the roomiest rank u
//! completely: `z[h][u] = −balance[u]`, `balance[h] −= z[h][u]`, `balance[u] = 0`. Each home
//! then hands its quotas out, the largest quota first, from its expert with the most tokens
//! left (`take = min(left, quota)`), so an expert may be split over several ranks. A
//! destination receives copies from one home only, so MoonEP's `E / R` prefetch slots a rank
//! (one home's experts) always suffice; with fewer buffers (`buffers`) a destination keeps its
//! largest remote segments, as MoonEP's planner picks what it prefetches, and the rest stays on
//! the home rank. Copies take their share of the expert's tokens from their own rank first
//! (`flow`), where MoonEP writes tokens straight into their destination slots.
//!
//! Weights are prefetched over NVLink after the router runs and gradients reduced to the home
//! rank in the backward pass (priced as `ReplicaTiming::AfterRouter`); parameters and optimizer
//! state stay with their owner (the preset runs it on the `static` placement). MoonEP runs in
//! one NVLink domain; where an EP group spans several, each domain is balanced on its own.

use crate::plan::Replica;

use super::exchange::Exchange;
use super::live::{replica_rows, Segments};

/// Scratch of one worker.
#[derive(Default)]
pub struct Worker {
    seg: Segments,
    copies: Vec<(usize, usize, usize, i64)>,
}

/// The replicas of one exchange, at most `buffers` distinct experts copied onto a rank.
pub fn plan_exchange(c: &Exchange, wk: &mut Worker, buffers: usize) -> Vec<Replica> {
    wk.seg.reset(c);
    wk.copies.clear();
    for (first, n) in Segments::domains(c) {
        plan_domain(&wk.seg, first, n, buffers, &mut wk.copies);
    }
    replica_rows(c, &wk.seg, &mut wk.copies)
}

/// First index of the largest value (torch's `argmax`); of the smallest with `min`.
fn arg_best(v: &[i64], max: bool) -> usize {
    let mut b = 0;
    for (i, &x) in v.iter().enumerate() {
        if (max && x > v[b]) || (!max && x < v[b]) {
            b = i;
        }
    }
    b
}

/// MoonEP's planner on the domain of ranks `first..first + n`; its copies (expert, home, dst,
/// tokens) are appended to `copies`.
fn plan_domain(seg: &Segments, first: usize, n: usize, buffers: usize, copies: &mut Vec<(usize, usize, usize, i64)>) {
    let load = &seg.load[first..first + n];
    let total: i64 = load.iter().sum();
    let (base, extra) = (total / n as i64, (total % n as i64) as usize);
    let mut balance: Vec<i64> = (0..n).map(|i| load[i] - base - i64::from(i < extra)).collect();
    // z[h * n + u]: tokens home h hands to rank u; every step zeroes one receiver
    let mut z = vec![0i64; n * n];
    for _ in 0..n * n {
        let (h, u) = (arg_best(&balance, true), arg_best(&balance, false));
        if balance[h] <= 0 {
            break;
        }
        let mv = -balance[u];
        z[h * n + u] += mv;
        balance[h] -= mv;
        balance[u] = 0;
    }
    let mut remote: Vec<Vec<(usize, usize, i64)>> = vec![Vec::new(); n]; // per dst: (expert, home, tokens)
    for h in 0..n {
        let mut quotas: Vec<i64> = z[h * n..(h + 1) * n].to_vec();
        let mut left: Vec<i64> = seg.seg[first + h].iter().map(|&(_, t)| t).collect();
        if left.is_empty() {
            continue;
        }
        loop {
            let d = arg_best(&quotas, true);
            if quotas[d] <= 0 {
                break;
            }
            let k = arg_best(&left, true);
            let take = left[k].min(quotas[d]);
            if take <= 0 {
                break;
            }
            left[k] -= take;
            quotas[d] -= take;
            if d != h {
                remote[d].push((seg.seg[first + h][k].0, first + h, take));
            }
        }
    }
    for (d, mut segs) in remote.into_iter().enumerate() {
        // the destination's prefetch slots: its largest remote segments (expert id breaks ties)
        segs.sort_by_key(|&(e, _, t)| (std::cmp::Reverse(t), e));
        segs.truncate(buffers);
        copies.extend(segs.into_iter().map(|(e, home, t)| (e, home, first + d, t)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostModel;
    use crate::topology::Topology;

    fn exchange_loads(origin: &[i64], topo: &Topology, e_n: usize, buffers: usize) -> (Vec<Replica>, Vec<i64>) {
        let cost = CostModel::for_tests(1);
        let per = e_n / topo.ep;
        let slot_off: Vec<usize> = (0..=e_n).collect();
        let slots: Vec<usize> = (0..e_n).map(|e| (e / per) * topo.slots_per_rank + e % per).collect();
        let c = Exchange { group: 0, micro: 0, layer: 0, topo, cost: &cost, origin, attn_max: 0.0, slot_off: &slot_off, slots: &slots };
        let mut wk = Worker::default();
        let reps = plan_exchange(&c, &mut wk, buffers);
        // each rank's computed tokens: its segments less what its copies take, plus its copies
        let mut load = wk.seg.load.clone();
        for r in &reps {
            let n = (r.share as f64 * wk.seg.total[r.expert as usize] as f64).round() as i64;
            load[r.src_rank as usize] -= n;
            load[r.dst_rank as usize] += n;
        }
        (reps, load)
    }

    #[test]
    fn every_rank_gets_its_exact_share() {
        // 4 ranks, 8 experts (2 a rank), rank 0's experts hot
        let topo = Topology::new(4, 4, 4, 2).unwrap();
        let mut origin = vec![0i64; 4 * 8];
        for r in 0..4 {
            for e in 0..8 {
                origin[r * 8 + e] = if e < 2 { 100 } else { 10 + r as i64 };
            }
        }
        let (reps, load) = exchange_loads(&origin, &topo, 8, 2);
        let total: i64 = origin.iter().sum();
        assert!(!reps.is_empty());
        for &l in &load {
            assert!((l - total / 4).abs() <= 1, "{load:?}");
        }
        // every copy comes from the hot home and no rank holds more than 2 distinct copies
        assert!(reps.iter().all(|r| r.src_rank == 0));
    }

    #[test]
    fn domains_are_balanced_apart() {
        // 4 ranks in 2 domains of 2: copies never cross a domain
        let topo = Topology::new(4, 4, 2, 2).unwrap();
        let mut origin = vec![5i64; 4 * 8];
        origin[0] = 400; // rank 0 sends 400 tokens to expert 0 (homed on rank 0)
        let (reps, _) = exchange_loads(&origin, &topo, 8, 2);
        assert!(!reps.is_empty());
        assert!(reps.iter().all(|r| topo.local_node_of(r.src_rank as usize) == topo.local_node_of(r.dst_rank as usize)));
    }

    #[test]
    fn fewer_buffers_keep_the_largest_segments() {
        let topo = Topology::new(2, 2, 2, 4).unwrap();
        // rank 0 hosts experts 0..4 with 40, 30, 20, 10 tokens; rank 1 hosts 4..8 with none
        let mut origin = vec![0i64; 2 * 8];
        origin[..4].copy_from_slice(&[40, 30, 20, 10]);
        let (reps, _) = exchange_loads(&origin, &topo, 8, 1);
        assert_eq!(reps.len(), 1);
        assert_eq!(reps[0].expert, 0);
    }
}
