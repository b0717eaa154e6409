//! The bound as it was first written: every rank's value without the expert's part computed
//! in a full scan, then the move's bound from them. Kept as the reference the lazy form
//! (`bound`'s `prepare_bound` and `bound`) must equal bit for bit (`state::tests`).

use super::{a2a, a2a_receiving, a2a_sending};
use crate::replication::exchange::Exchange;
use crate::replication::state::ExchangeState;

/// [`ExchangeState::prepare_bound`] of expert e, then [`ExchangeState::bound`] of the move,
/// by full scans over the ranks.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bound(
    st: &ExchangeState,
    c: &Exchange,
    e: usize,
    hosted: &[bool],
    dst: usize,
    src: usize,
    n: i64,
    new_copy: bool,
    local: Option<usize>,
    rpn: usize,
) -> f64 {
    let (ep, base, kt) = (st.ep, e * st.ep, st.k_tok);
    let exact = st.total[e] < 1 << 23;
    let mut flag: Vec<bool> = hosted[..ep].to_vec();
    let mut own = vec![0i64; ep];
    for r in &st.replicas[e] {
        own[r.dst] = r.n;
        flag[r.dst] |= !exact;
    }
    let mut hosts: Vec<(usize, i64)> = Vec::new();
    for &slot in c.expert_slots(e) {
        let h = c.topo.rank_of_slot(slot);
        match hosts.last_mut() {
            Some((r, k)) if *r == h => *k += 1,
            _ => hosts.push((h, 1)),
        }
    }
    let taken: i64 = st.replicas[e].iter().map(|r| r.n).sum();
    let (mut wo_x, mut wo_a) = (Vec::with_capacity(ep), Vec::with_capacity(ep));
    let (mut x_flag, mut a_host) = (0.0f64, 0.0f64);
    let mut top = [(f64::NEG_INFINITY, usize::MAX); 2];
    for p in 0..ep {
        let t = st.etok[base + p];
        let x = c.cost.expert_time((st.tok[p] - t) as f64, (st.active[p] - i64::from(t > 0)) as f64);
        let (l, el) = (st.links[p], st.elinks[base + p]);
        let l = [l[0] - el[0], l[1] - el[1], l[2] - el[2], l[3] - el[3]];
        let a = if hosted[p] { a2a(kt, &l) } else { a2a_sending(kt, &l, st.origin_t[base + p] - own[p]) };
        if flag[p] && !hosted[p] {
            x_flag = x_flag.max(x);
        }
        if hosted[p] {
            a_host = a_host.max(a);
        }
        if a > top[0].0 {
            top = [(a, p), top[0]];
        } else if a > top[1].0 {
            top[1] = (a, p);
        }
        wo_x.push(x);
        wo_a.push(a);
    }
    let first = |order: &[usize], v: &[f64], skip: &dyn Fn(usize) -> bool| order.iter().find(|&&p| !skip(p)).map_or(0.0, |&p| v[p]);
    let t = st.etok[base + dst];
    let x_dst = if st.total[e] < 1 << 23 {
        c.cost.expert_time((st.tok[dst] - t + n) as f64, (st.active[dst] - i64::from(t > 0) + i64::from(n > 0)) as f64)
    } else {
        wo_x[dst]
    };
    let c_n = c.expert_slots(e).len() as i64;
    let left = st.total[e] - (taken - own[dst]) - n;
    let quota = ((left - ep as i64 * (c_n - 1)) / c_n).max(0);
    let x_host = hosts.iter().fold(0.0f64, |m, &(h, k)| {
        let (t, new) = (st.etok[base + h], k * quota);
        m.max(c.cost.expert_time((st.tok[h] - t + new) as f64, (st.active[h] - i64::from(t > 0) + i64::from(new > 0)) as f64))
    });
    let x = x_flag.max(x_host).max(x_dst).max(first(&st.xo, &st.xv, &|p| flag[p] || p == dst));
    let (l, el) = (st.links[dst], st.elinks[base + dst]);
    let a_dst = a2a_sending(kt, &[l[0] - el[0], l[1] - el[1], l[2] - el[2], l[3] - el[3]], st.origin_t[base + dst] - n);
    let a_recv = hosts.iter().fold(0.0f64, |m, &(h, k)| {
        let (l, el) = (st.links[h], st.elinks[base + h]);
        let l = [l[0] - el[0], l[1] - el[1], l[2] - el[2], l[3] - el[3]];
        m.max(a2a_receiving(kt, &l, k.saturating_mul(quota) - st.origin_t[base + h]))
    });
    let a = match local {
        Some(node) => {
            let (lo, hi) = (node * rpn, ((node + 1) * rpn).min(ep));
            let mates = (lo..hi).filter(|&p| p != dst).fold(0.0f64, |m, p| m.max(wo_a[p]));
            a_host.max(mates).max(a_dst).max(a_recv).max(first(&st.ao, &st.av, &|p| hosted[p] || (lo..hi).contains(&p)))
        }
        None => {
            let [(a0, p0), (a1, _)] = top;
            (if p0 == dst { a1 } else { a0 }).max(a_dst).max(a_recv).max(0.0)
        }
    };
    let h = if new_copy {
        let reps = &st.replicas[e];
        first(&st.ho, &st.hv, &|p| p == src || p == dst || reps.iter().any(|r| r.src == src && r.dst == p))
    } else {
        st.ho.first().map_or(0.0, |&p| st.hv[p])
    };
    ExchangeState::total_time(c, x, a, h) * (1.0 - 1e-12)
}
