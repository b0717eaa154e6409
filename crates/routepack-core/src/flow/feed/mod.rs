//! Step 2 of `flow`'s rule: the tokens no replica took, onto an expert's placement slots,
//! node first (the rule and why it shares in proportion are in `flow`'s module docs).
//!
//! Every share is ⌊need · w / total⌋ plus one unit for the first items whose share had a
//! fraction; here each item's quotient is computed once and reused by both passes, items of
//! weight 0 (most ranks of a receiving node) skip the division, and a draw of the whole pool
//! (the last receiving slot) takes every weight as it is. `reference.rs` keeps the plain form
//! these must equal flow for flow (`tests`).

use crate::topology::Topology;

#[cfg(test)]
pub(crate) mod reference;
#[cfg(test)]
mod tests;

/// Step 2 of the rule (module docs) for an expert with c ≥ 2 slots. `buf` (`[ep]`, the tokens
/// no replica took) is the caller's scratch; it holds `4·ep + 3·c` entries on return (quotas,
/// outflows, inflows, the slots' nodes and the shares' quotients are kept behind the ranks'
/// tokens, so one buffer serves every call without an allocation), its first ep all zero.
/// Calls `emit(origin, dst_rank, slot, count)`.
pub(super) fn feed_slots(buf: &mut Vec<i64>, slots: &[usize], topo: &Topology, mut emit: impl FnMut(usize, usize, usize, i64)) {
    let (ep, c) = (buf.len(), slots.len());
    buf.resize(4 * ep + 3 * c, 0);
    let (rem, rest) = buf.split_at_mut(ep);
    let (quota, rest) = rest.split_at_mut(c);
    let (out, rest) = rest.split_at_mut(ep);
    let (inflow, rest) = rest.split_at_mut(c);
    let (slot_node, rest) = rest.split_at_mut(c);
    let (floor, frac) = rest.split_at_mut(ep);
    // q_j = Σ_r rem_r / c, plus one for each origin whose remainder covers j: origin r's
    // remainder covers the cyclic run r mod c, r mod c + 1, … of length rem_r mod c
    let cc = c as i64;
    let (mut base, mut start) = (0i64, 0usize);
    for &x in rem.iter() {
        let q = x / cc;
        base += q;
        let mut j = start;
        for _ in 0..x - q * cc {
            quota[j] += 1;
            j = if j + 1 == c { 0 } else { j + 1 };
        }
        start = if start + 1 == c { 0 } else { start + 1 };
    }
    quota.iter_mut().for_each(|q| *q += base);
    for (n, &p) in slot_node.iter_mut().zip(slots) {
        *n = topo.local_node_of(topo.rank_of_slot(p)) as i64;
    }
    let rpn = topo.ranks_per_group_node();
    // (1) per node: what must leave it (its tokens beyond its slots' quotas), spread over its
    // ranks in proportion to their tokens, or what must come in, spread over its slots in
    // proportion to their quotas
    for n in 0..ep.div_ceil(rpn) {
        let ranks = n * rpn..((n + 1) * rpn).min(ep);
        let supply: i64 = rem[ranks.clone()].iter().sum();
        let demand: i64 = (0..c).filter(|&j| slot_node[j] == n as i64).map(|j| quota[j]).sum();
        if supply > demand {
            let (lo, hi) = (ranks.start, ranks.end);
            apportion(supply - demand, supply, &rem[lo..hi], &mut floor[..hi - lo], &mut frac[..hi - lo], |i, k| out[lo + i] = k);
        } else if demand > supply {
            // the node's slots (a few: c is small), apportioned in place by index
            let need = demand - supply;
            let mut over = need;
            for j in 0..c {
                if slot_node[j] == n as i64 {
                    over -= share(need, quota[j], demand).0;
                }
            }
            for j in 0..c {
                if slot_node[j] == n as i64 {
                    let (mut k, had) = share(need, quota[j], demand);
                    if had && over > 0 {
                        k += 1;
                        over -= 1;
                    }
                    inflow[j] = k;
                }
            }
            debug_assert_eq!(over, 0);
        }
    }
    // (2) across nodes: each slot's inflow drawn from every rank's outflow in proportion
    // (a node either sends or receives, so only other nodes' ranks have an outflow)
    let mut pool: i64 = out.iter().sum();
    for j in 0..c {
        let (p, dst) = (slots[j], topo.rank_of_slot(slots[j]));
        let k = draw(inflow[j], pool, out, floor, frac, |r, k| {
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
        let lo = slot_node[j] as usize * rpn;
        let hi = (lo + rpn).min(ep);
        let left: i64 = rem[lo..hi].iter().sum();
        quota[j] -= draw(quota[j], left, &mut rem[lo..hi], &mut floor[..hi - lo], &mut frac[..hi - lo], |i, k| emit(lo + i, dst, p, k));
    }
    debug_assert!(rem.iter().all(|&x| x == 0) && quota.iter().all(|&x| x == 0));
}

/// Each weight's ⌊need · w / total⌋ into `floor` and whether it had a fraction into `frac`
/// (0 / 1); returns `need` less the floors' sum: the units left over. Weights of 0 skip the
/// division, and `need == total` (every weight taken whole) skips them all.
#[inline]
fn quotients(need: i64, total: i64, weights: &[i64], floor: &mut [i64], frac: &mut [i64]) -> i64 {
    let mut over = need;
    if need == total {
        floor.copy_from_slice(weights);
        frac.iter_mut().for_each(|f| *f = 0);
        return 0;
    }
    for ((&w, fl), fr) in weights.iter().zip(floor.iter_mut()).zip(frac.iter_mut()) {
        let (k, had) = if w == 0 { (0, false) } else { share(need, w, total) };
        *fl = k;
        *fr = i64::from(had);
        over -= k;
    }
    over
}

/// `need` (≤ `total`) apportioned over the `weights` (summing to `total`): item i gets
/// ⌊need · w_i / total⌋, and the units this leaves over go one each to the first items
/// whose share had a fraction (there are enough: the fractions sum to what is left over).
/// Calls `f(index, share)` for every item, shares of 0 included. `floor`, `frac`: scratch
/// of the weights' length.
fn apportion(need: i64, total: i64, weights: &[i64], floor: &mut [i64], frac: &mut [i64], mut f: impl FnMut(usize, i64)) {
    debug_assert!(0 <= need && need <= total);
    let mut over = quotients(need, total, weights, floor, frac);
    for i in 0..weights.len() {
        let mut k = floor[i];
        if frac[i] != 0 && over > 0 {
            k += 1;
            over -= 1;
        }
        f(i, k);
    }
    debug_assert_eq!(over, 0);
}

/// Draws `min(need, total)` out of `pool` (`total` = Σ pool) by [`apportion`]'s rule, each
/// entry giving its share, and reports the non-empty shares to `f(index, share)`; returns
/// what it drew. `floor`, `frac`: scratch of the pool's length.
fn draw(need: i64, total: i64, pool: &mut [i64], floor: &mut [i64], frac: &mut [i64], mut f: impl FnMut(usize, i64)) -> i64 {
    let need = need.min(total);
    if need == 0 {
        return 0;
    }
    let mut over = quotients(need, total, pool, floor, frac);
    for (i, w) in pool.iter_mut().enumerate() {
        let mut k = floor[i];
        if frac[i] != 0 && over > 0 {
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
