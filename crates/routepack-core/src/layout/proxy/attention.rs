//! The attention part of a (group, microbatch)'s cost: Σ over attention kinds of the layer count
//! times the largest rank value a_lin·Σn + a_quad·Σn², kept as the three largest rank values
//! per (group, microbatch) and kind so that a move (which changes at most two ranks) prices it in
//! O(kinds).

use super::state::TOP;
use super::{Delta, Proxy, Shards};

impl Proxy {
    /// Cell of EP rank p in (group, microbatch) gm.
    #[inline]
    fn cell_at(&self, gm: usize, p: usize) -> usize {
        let (g, m) = (gm / self.micro, gm % self.micro);
        (g * self.ep + p) * self.micro + m
    }

    /// Recomputes the three largest attention values per kind of (group, microbatch) gm.
    pub(super) fn rank_attention(&self, sh: &mut Shards, gm: usize) {
        for k in 0..self.kinds.len() {
            self.rank_kind(sh, gm, k);
        }
    }

    /// The attention value of EP rank p of (group, microbatch) gm for kind k.
    #[inline]
    fn att_value(&self, sh: &Shards, gm: usize, k: usize, p: usize) -> f64 {
        let c = self.cell_at(gm, p);
        self.att_lin * sh.lin[c] as f64 + self.kinds[k].0 * sh.quad[c] as f64
    }

    /// `rank_attention` for one kind: the three best ranks by (value descending, rank
    /// ascending); missing entries are (0, u32::MAX).
    fn rank_kind(&self, sh: &mut Shards, gm: usize, k: usize) {
        let mut top = [(f64::NEG_INFINITY, u32::MAX); TOP];
        for p in 0..self.ep {
            let v = self.att_value(sh, gm, k, p);
            if v > top[TOP - 1].0 {
                let mut i = TOP - 1;
                while i > 0 && v > top[i - 1].0 {
                    top[i] = top[i - 1];
                    i -= 1;
                }
                top[i] = (v, p as u32);
            }
        }
        for t in top.iter_mut().filter(|t| t.1 == u32::MAX) {
            t.0 = 0.0;
        }
        sh.att_top[gm * self.kinds.len() + k] = top;
    }

    /// `rank_attention` after only the ranks of `ends` changed: a kind whose three best hold
    /// none of them only takes the changed ranks in where they now rank (the same order a
    /// full ranking gives); otherwise it is ranked again.
    pub(super) fn update_attention(&self, sh: &mut Shards, gm: usize, ends: &[(usize, f32)]) {
        let k_n = self.kinds.len();
        for k in 0..k_n {
            let idx = gm * k_n + k;
            if sh.att_top[idx].iter().any(|t| ends.iter().any(|e| e.0 as u32 == t.1)) || sh.att_top[idx][TOP - 1].1 == u32::MAX {
                self.rank_kind(sh, gm, k);
                continue;
            }
            for &(p, _) in ends {
                let v = (self.att_value(sh, gm, k, p), p as u32);
                let top = &mut sh.att_top[idx];
                let better = |a: (f64, u32), b: (f64, u32)| a.0 > b.0 || (a.0 == b.0 && a.1 < b.1);
                if better(v, top[TOP - 1]) {
                    let mut i = TOP - 1;
                    while i > 0 && better(v, top[i - 1]) {
                        top[i] = top[i - 1];
                        i -= 1;
                    }
                    top[i] = v;
                }
            }
        }
    }

    /// Attention part of a (group, microbatch)'s cost after `d`: Σ_kinds count · max_p. Only the
    /// end ranks change, so the peak is the largest value of a rank that is not an end
    /// (from the ranking) or an end's new value.
    pub(super) fn attention(&self, sh: &Shards, gm: usize, d: &Delta) -> f64 {
        let (la, qa) = self.lin_quad(d.add, sh);
        let (ls, qs) = self.lin_quad(d.sub, sh);
        let ends = &d.ends[..d.n_ends];
        let k_n = self.kinds.len();
        let mut cost = 0.0f64;
        for (k, &(q3, count)) in self.kinds.iter().enumerate() {
            let top = &sh.att_top[gm * k_n + k];
            let mut peak = top.iter().find(|t| !ends.iter().any(|e| e.0 as u32 == t.1)).map_or(0.0, |t| t.0);
            for &(p, sign) in ends {
                let c = self.cell_at(gm, p);
                let s = sign as i64;
                let (lin, quad) = (sh.lin[c] + s * (la - ls), sh.quad[c] + s as i128 * (qa - qs));
                peak = peak.max(self.att_lin * lin as f64 + q3 * quad as f64);
            }
            cost += count * peak;
        }
        cost
    }
}
