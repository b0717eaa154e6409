//! `ultraep`: UltraEP's quota-driven exact-load balancer (Dots-Infra/UltraEP, arXiv 2606.04101,
//! xtuner PR 2050), the baseline as its runtime and blog describe it (`update_placement` with
//! the default quota-aware placement, `csrc/solvers/placement_quota_gpu.cu`).
//!
//! Per exchange (EP group, microbatch, layer), from the post-gating load of each expert: every
//! rank keeps its own ("master") experts and has `redundant` spare slots per layer
//! (`num_local_redundant_experts`) for replicas of experts homed on other ranks of its NVLink
//! domain. The planner binary-searches the smallest load threshold T that an export plan meets:
//! every rank above T (`excess = load − T`) hands tokens to ranks below it (`slack = T −
//! load`), sources in descending load, each exporting from its experts hottest first (an
//! expert keeps at least one token on its master, `ULTRA_EP_QUOTA_ALLOW_ZERO_MASTER_QUOTA` = 0)
//! to the rank with the most slack that has a free spare slot and holds no instance of the
//! expert yet, a quota `q = min(need, slack, available)` of at least `min_tokens` tokens
//! (`ULTRA_EP_QUOTA_MIN_TOKENS_PER_REPLICA`, default 1024); the plan fails at T when a source
//! cannot export its excess. The quota of each replica is the tokens it computes; copies take
//! them from their own rank first (`flow`: UltraEP's locality-aware quota decomposition).
//!
//! Weights are synced over NVLink after the router runs and replica gradients reduced to the
//! masters in the backward pass (priced as `ReplicaTiming::AfterRouter`); masters keep their
//! optimizer state (the preset runs it on the `static` placement). UltraEP confines replication
//! to the scale-up domain: where an EP group spans several domains, each is balanced on its own.

use crate::plan::Replica;

use super::exchange::Exchange;
use super::live::{replica_rows, Segments};

/// UltraEP's default `ULTRA_EP_QUOTA_MIN_TOKENS_PER_REPLICA`.
pub const DEFAULT_MIN_TOKENS: i64 = 1024;

/// Scratch of one worker.
#[derive(Default)]
pub struct Worker {
    seg: Segments,
    copies: Vec<(usize, usize, usize, i64)>,
    plan: Vec<(usize, usize, usize, i64)>,
}

/// The replicas of one exchange: at most `redundant` replicas a rank, each of at least
/// `min_tokens` tokens.
pub fn plan_exchange(c: &Exchange, wk: &mut Worker, redundant: usize, min_tokens: i64) -> Vec<Replica> {
    wk.seg.reset(c);
    wk.copies.clear();
    for (first, n) in Segments::domains(c) {
        let load = &wk.seg.load[first..first + n];
        let total: i64 = load.iter().sum();
        let hi = load.iter().copied().max().unwrap_or(0);
        let mut lo = (total + n as i64 - 1) / n as i64;
        if redundant == 0 || hi <= lo {
            continue;
        }
        // the smallest feasible threshold in [lo, hi] (hi always is: nothing to export)
        let mut best = hi;
        let mut top = hi;
        while lo < top {
            let mid = lo + (top - lo) / 2;
            if export_plan(&wk.seg, first, n, mid, redundant, min_tokens, &mut wk.plan) {
                best = mid;
                top = mid;
            } else {
                lo = mid + 1;
            }
        }
        if best < hi && export_plan(&wk.seg, first, n, best, redundant, min_tokens, &mut wk.plan) {
            wk.copies.extend_from_slice(&wk.plan);
        }
    }
    replica_rows(c, &wk.seg, &mut wk.copies)
}

/// UltraEP's export oracle at threshold `t` on the domain `first..first + n`: whether every
/// rank's excess can be exported; the exports (expert, home, dst, quota) in `out`.
fn export_plan(
    seg: &Segments,
    first: usize,
    n: usize,
    t: i64,
    redundant: usize,
    min_tokens: i64,
    out: &mut Vec<(usize, usize, usize, i64)>,
) -> bool {
    out.clear();
    let load = &seg.load[first..first + n];
    let mut excess: Vec<i64> = load.iter().map(|&l| (l - t).max(0)).collect();
    let mut slack: Vec<i64> = load.iter().map(|&l| (t - l).max(0)).collect();
    if excess.iter().sum::<i64>() > slack.iter().sum::<i64>() {
        return false;
    }
    let mut used = vec![0usize; n];
    let mut sources: Vec<usize> = (0..n).collect();
    sources.sort_by_key(|&r| (std::cmp::Reverse(load[r]), r));
    for src in sources {
        if excess[src] == 0 {
            continue;
        }
        let mut experts: Vec<(usize, i64)> = seg.seg[first + src].clone();
        experts.sort_by_key(|&(e, x)| (std::cmp::Reverse(x), e));
        for (e, x) in experts {
            // an expert keeps at least one token on its master
            let mut available = x - 1;
            // ranks holding an instance of e: its master (here) and the copies made so far
            let mut holders: Vec<usize> = vec![src];
            while excess[src] > 0 && available > 0 {
                let need = excess[src];
                let mut pick: Option<usize> = None;
                for d in 0..n {
                    if slack[d] <= 0 || used[d] >= redundant || holders.contains(&d) || d == src {
                        continue;
                    }
                    if need.min(slack[d]).min(available) < min_tokens {
                        continue;
                    }
                    if pick.is_none_or(|b| slack[d] > slack[b]) {
                        pick = Some(d);
                    }
                }
                let Some(d) = pick else { break };
                let q = need.min(slack[d]).min(available);
                out.push((e, first + src, first + d, q));
                excess[src] -= q;
                slack[d] -= q;
                used[d] += 1;
                holders.push(d);
                available -= q;
            }
            if excess[src] == 0 {
                break;
            }
        }
        if excess[src] > 0 {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostModel;
    use crate::topology::Topology;

    fn run(origin: &[i64], topo: &Topology, e_n: usize, redundant: usize, min_tokens: i64) -> (Vec<Replica>, Vec<i64>) {
        let cost = CostModel::for_tests(1);
        let per = e_n / topo.ep;
        let slot_off: Vec<usize> = (0..=e_n).collect();
        let slots: Vec<usize> = (0..e_n).map(|e| (e / per) * topo.slots_per_rank + e % per).collect();
        let c = Exchange { group: 0, micro: 0, layer: 0, topo, cost: &cost, origin, attn_max: 0.0, slot_off: &slot_off, slots: &slots };
        let mut wk = Worker::default();
        let reps = plan_exchange(&c, &mut wk, redundant, min_tokens);
        let mut load = wk.seg.load.clone();
        for r in &reps {
            let n = (r.share as f64 * wk.seg.total[r.expert as usize] as f64).round() as i64;
            load[r.src_rank as usize] -= n;
            load[r.dst_rank as usize] += n;
        }
        (reps, load)
    }

    #[test]
    fn balances_to_the_mean_with_enough_slots() {
        // UltraEP's skewed test case: 4 ranks, 4 masters each, loads [512, 320, 256, 192] + 32s
        let topo = Topology::new(4, 4, 4, 4).unwrap();
        let loads: Vec<i64> = [512, 320, 256, 192].into_iter().chain(std::iter::repeat_n(32, 12)).collect();
        let mut origin = vec![0i64; 4 * 16];
        origin[..16].copy_from_slice(&loads); // all sent from rank 0
        let total: i64 = loads.iter().sum();
        // 3 spare slots a rank: exact (within a token of the mean)
        let (reps, load) = run(&origin, &topo, 16, 3, 1);
        assert!(!reps.is_empty());
        assert!(*load.iter().max().unwrap() <= (total + 3) / 4 + 1, "{load:?}");
        // 2: the greedy exports run out of slots below T = 447 (7% over the mean), as UltraEP's
        for (redundant, want) in [(2usize, 447i64)] {
            let (reps, load) = run(&origin, &topo, 16, redundant, 1);
            assert_eq!(*load.iter().max().unwrap(), want, "{load:?}");
            for d in 0..4 {
                assert!(reps.iter().filter(|r| r.dst_rank == d).count() <= redundant);
            }
        }
    }

    #[test]
    fn min_tokens_stops_small_replicas() {
        let topo = Topology::new(2, 2, 2, 2).unwrap();
        let mut origin = vec![0i64; 2 * 4];
        origin[0] = 600; // expert 0 on rank 0
        let (reps, _) = run(&origin, &topo, 4, 2, 1024);
        assert!(reps.is_empty());
        let (reps, load) = run(&origin, &topo, 4, 2, 1);
        assert_eq!(reps.len(), 1);
        assert_eq!(load, vec![300, 300]);
    }
}
