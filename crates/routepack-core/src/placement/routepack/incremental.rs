//! Incremental candidates against the placement in force: the old layer adjusted to the new
//! replica counts, then improved by the same local search, snapshotted as it goes so that the
//! choice can weigh each step's saving against its moves.

use super::binpack::{with_capacities, Pack, SETTLING_SPREADS};
use super::items::Items;
use super::options::Options;
use crate::topology::Topology;

/// Starting assignment from the old layer: replicas stay on ranks that hold their expert;
/// where the new count is lower, copies leave the ranks that are heaviest under the new
/// weights; added copies go heaviest first to the lightest rank with a free slot.
pub(crate) fn inherit(items: &Items, num_experts: usize, old: &[i32], topo: &Topology) -> Vec<usize> {
    let (ep, spr) = (topo.ep, topo.slots_per_rank);
    let n = items.weight.len();
    let mut first = vec![0usize; num_experts + 1];
    for &e in &items.expert {
        first[e as usize + 1] += 1;
    }
    let counts: Vec<usize> = first[1..].to_vec();
    for e in 0..num_experts {
        first[e + 1] += first[e];
    }
    let w = |e: usize| items.weight[first[e]];
    let mut holders: Vec<Vec<usize>> = vec![Vec::new(); num_experts];
    let mut est = vec![0.0f64; ep];
    for (q, &e) in old.iter().enumerate() {
        if e >= 0 && (e as usize) < num_experts {
            holders[e as usize].push(q / spr);
            est[q / spr] += w(e as usize);
        }
    }
    for e in 0..num_experts {
        while holders[e].len() > counts[e] {
            let k = (0..holders[e].len()).fold(0, |b, k| if est[holders[e][k]] >= est[holders[e][b]] { k } else { b });
            est[holders[e][k]] -= w(e);
            holders[e].remove(k);
        }
    }
    let mut bin_of = vec![usize::MAX; n];
    let mut fill = vec![0usize; ep];
    let mut load = vec![0.0f64; ep];
    let mut mult = vec![0u16; ep * num_experts];
    for e in 0..num_experts {
        for (k, &r) in holders[e].iter().enumerate() {
            let i = first[e] + k;
            bin_of[i] = r;
            fill[r] += 1;
            load[r] += items.weight[i];
            mult[r * num_experts + e] += 1;
        }
    }
    let mut rest: Vec<usize> = (0..n).filter(|&i| bin_of[i] == usize::MAX).collect();
    rest.sort_unstable_by(|&a, &b| items.weight[b].total_cmp(&items.weight[a]).then(a.cmp(&b)));
    for i in rest {
        let e = items.expert[i] as usize;
        let limit = counts[e].div_ceil(ep).max(1) as u16;
        let pick = |strict: bool| {
            (0..ep).filter(|&r| fill[r] < spr && (!strict || mult[r * num_experts + e] < limit)).fold(None, |b: Option<usize>, r| match b {
                Some(x) if load[x] <= load[r] => Some(x),
                _ => Some(r),
            })
        };
        let r = pick(true).or_else(|| pick(false)).expect("as many slots as replicas");
        bin_of[i] = r;
        fill[r] += 1;
        load[r] += items.weight[i];
        mult[r * num_experts + e] += 1;
    }
    bin_of
}

/// Incremental candidates: `(swaps, [ep] item lists)` after 0, 1, 2, 4, ... local-search swaps
/// from the inherited assignment, aiming at the fresh placement's largest rank load `target`:
/// min-max search down to `target`, the fluctuation pass with `explore` room, tightening
/// back to `target` (the phases of a fresh packing, over all ranks at once).
pub(crate) fn incremental_bins(
    items: &Items,
    num_experts: usize,
    old: &[i32],
    topo: &Topology,
    target: f64,
    opts: &Options,
) -> Vec<(usize, Vec<Vec<usize>>)> {
    let start = inherit(items, num_experts, old, topo);
    let p = items.problem(num_experts, topo.ep, topo.slots_per_rank);
    let mut s = Pack::from_assignment(&p, &start);
    let bins_of = |s: &Pack| {
        let mut b = with_capacities(topo.ep, topo.slots_per_rank);
        for (i, &r) in s.bin_of.iter().enumerate() {
            b[r].push(i);
        }
        b
    };
    let base = s.swaps;
    let mut out = vec![(0, bins_of(&s))];
    let (mut phase, mut evals) = (0usize, 0usize);
    let budget = opts.fluct_evals;
    let mut limit = 1usize;
    while phase < 3 {
        let left = |s: &Pack| limit - (s.swaps - base);
        let finished = match phase {
            0 => s.improve_max(target, left(&s), SETTLING_SPREADS),
            1 => s.improve_fluct(target * (1.0 + opts.explore()), left(&s), &mut evals, budget / 2) || evals >= budget / 2,
            _ => s.tighten(target, left(&s), &mut evals, budget - budget / 4),
        };
        if finished {
            phase += 1;
        } else {
            limit *= 2;
        }
        let used = s.swaps - base;
        if used > out.last().expect("seeded").0 {
            out.push((used, bins_of(&s)));
        }
    }
    out
}
