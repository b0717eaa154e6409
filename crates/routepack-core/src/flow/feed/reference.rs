//! The plain form of `feed_slots` (each share divided twice, every weight divided), kept as
//! the reference the fast one must equal flow for flow (`feed::tests`).

use crate::topology::Topology;

/// Step 2 of the rule (module docs) for an expert with c ≥ 2 slots. `rem` (`[ep]`, the tokens
/// no replica took) is the caller's scratch; it holds `2·(ep + c)` entries on return (quotas,
/// outflows and inflows are kept behind the ranks' tokens, so one buffer serves every call
/// without an allocation), its first ep all zero. Calls `emit(origin, dst_rank, slot, count)`.
pub(crate) fn feed_slots(rem: &mut Vec<i64>, slots: &[usize], topo: &Topology, mut emit: impl FnMut(usize, usize, usize, i64)) {
    let (ep, c) = (rem.len(), slots.len());
    // q_j = Σ_r rem_r / c, plus one for each origin whose remainder covers j: origin r's
    // remainder covers the cyclic run r mod c, r mod c + 1, … of length rem_r mod c
    let base: i64 = rem.iter().map(|&x| x / c as i64).sum();
    rem.resize(ep + c, base);
    rem.resize(2 * (ep + c), 0);
    let (rem, rest) = rem.split_at_mut(ep);
    let (quota, rest) = rest.split_at_mut(c);
    let (out, inflow) = rest.split_at_mut(ep);
    for (r, &x) in rem.iter().enumerate() {
        let extra = (x % c as i64) as usize;
        let mut j = r % c;
        for _ in 0..extra {
            quota[j] += 1;
            j = if j + 1 == c { 0 } else { j + 1 };
        }
    }
    let rpn = topo.ranks_per_group_node();
    let node_of_slot = |j: usize| topo.local_node_of(topo.rank_of_slot(slots[j]));
    // (1) per node: what must leave it (its tokens beyond its slots' quotas), spread over its
    // ranks in proportion to their tokens, or what must come in, spread over its slots in
    // proportion to their quotas
    for n in 0..ep.div_ceil(rpn) {
        let ranks = n * rpn..((n + 1) * rpn).min(ep);
        let supply: i64 = rem[ranks.clone()].iter().sum();
        let demand: i64 = (0..c).filter(|&j| node_of_slot(j) == n).map(|j| quota[j]).sum();
        if supply > demand {
            apportion(supply - demand, supply, ranks.map(|r| (r, rem[r])), |r, k| out[r] = k);
        } else if demand > supply {
            apportion(demand - supply, demand, (0..c).filter(|&j| node_of_slot(j) == n).map(|j| (j, quota[j])), |j, k| inflow[j] = k);
        }
    }
    // (2) across nodes: each slot's inflow drawn from every rank's outflow in proportion
    // (a node either sends or receives, so only other nodes' ranks have an outflow)
    let mut pool: i64 = out.iter().sum();
    for j in 0..c {
        let (p, dst) = (slots[j], topo.rank_of_slot(slots[j]));
        let k = draw(inflow[j], pool, out, |r, k| {
            rem[r] -= k;
            emit(r, dst, p, k);
        });
        quota[j] -= k;
        pool -= k;
    }
    // (3) inside each node: a slot's own rank first (those tokens cross no link), then the
    // other ranks of its node in proportion to what each has left
    for (j, &p) in slots.iter().enumerate() {
        let r = topo.rank_of_slot(p);
        let k = rem[r].min(quota[j]);
        if k > 0 {
            rem[r] -= k;
            quota[j] -= k;
            emit(r, r, p, k);
        }
    }
    for (j, &p) in slots.iter().enumerate() {
        if quota[j] == 0 {
            continue;
        }
        let dst = topo.rank_of_slot(p);
        let lo = topo.local_node_of(dst) * rpn;
        let hi = (lo + rpn).min(ep);
        let left: i64 = rem[lo..hi].iter().sum();
        quota[j] -= draw(quota[j], left, &mut rem[lo..hi], |i, k| emit(lo + i, dst, p, k));
    }
    debug_assert!(rem.iter().all(|&x| x == 0) && quota.iter().all(|&x| x == 0));
}

/// `need` (≤ `total`) apportioned over `items` `(index, weight)` whose weights sum to
/// `total`: item i gets ⌊need · w_i / total⌋, and the units this leaves over go one each to
/// the first items whose share had a fraction (there are enough: the fractions sum to what
/// is left over). Calls `f(index, share)` for every item, shares of 0 included.
fn apportion(need: i64, total: i64, items: impl Iterator<Item = (usize, i64)> + Clone, mut f: impl FnMut(usize, i64)) {
    debug_assert!(0 <= need && need <= total);
    let over = need - items.clone().map(|(_, w)| share(need, w, total).0).sum::<i64>();
    let mut over = over;
    for (i, w) in items {
        let (mut k, frac) = share(need, w, total);
        if frac && over > 0 {
            k += 1;
            over -= 1;
        }
        f(i, k);
    }
    debug_assert_eq!(over, 0);
}

/// Draws `min(need, total)` out of `pool` (`total` = Σ pool) by [`apportion`]'s rule, each
/// entry giving its share, and reports the non-empty shares to `f(index, share)`; returns
/// what it drew.
fn draw(need: i64, total: i64, pool: &mut [i64], mut f: impl FnMut(usize, i64)) -> i64 {
    let need = need.min(total);
    if need == 0 {
        return 0;
    }
    let over = need - pool.iter().map(|&w| share(need, w, total).0).sum::<i64>();
    let mut over = over;
    for (i, w) in pool.iter_mut().enumerate() {
        let (mut k, frac) = share(need, *w, total);
        if frac && over > 0 {
            k += 1;
            over -= 1;
        }
        if k > 0 {
            *w -= k;
            f(i, k);
        }
    }
    debug_assert_eq!(over, 0);
    need
}

/// ⌊need · w / total⌋ and whether it had a fraction; the product fits i64 unless an exchange
/// sends billions of tokens to one expert, then i128.
#[inline]
fn share(need: i64, w: i64, total: i64) -> (i64, bool) {
    match need.checked_mul(w) {
        Some(t) => (t / total, t % total != 0),
        None => {
            let t = i128::from(need) * i128::from(w);
            ((t / i128::from(total)) as i64, t % i128::from(total) != 0)
        }
    }
}
