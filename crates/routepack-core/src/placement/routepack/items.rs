//! The replicas of one layer as the packer sees them: aggregate weight, expert and per-chunk
//! demand of each copy (an expert's load times its copy's share, `copy_cost::copy_shares`:
//! the even split over its copies, as `flow` routes it, weighed by what the copy's tokens
//! cost its rank to receive).

use super::binpack::{total_key, Problem};

/// Replicas of one layer: weight, expert and chunk vector of each, with the packer's
/// heaviest-first order and chunk-vector norms (those of [`super::binpack::order_and_norm`]).
pub(crate) struct Items {
    pub(crate) weight: Vec<f64>,
    pub(crate) expert: Vec<u32>,
    pub(crate) vecs: Vec<f32>,
    pub(crate) dim: usize,
    order: Vec<u32>,
    norm: Vec<f64>,
}

impl Items {
    /// Each copy weighs an even split of its expert's load and chunk demand (tests: the
    /// packer's properties hold for any weights).
    #[cfg(test)]
    pub(crate) fn new(loads: &[f64], chunks: &[f64], dim: usize, counts: &[u32]) -> Self {
        let max = counts.iter().copied().max().unwrap_or(0) as usize;
        let even: Vec<f64> = (0..=max).map(|c| if c == 0 { 0.0 } else { 1.0 / c as f64 }).collect();
        Self::weighted(loads, chunks, dim, counts, &even)
    }

    /// Each copy of an expert with c copies weighs `shares[c]` of its expert's load and chunk
    /// demand (`copy_cost::copy_shares`: what a copy costs its rank, not only its tokens).
    pub(crate) fn weighted(loads: &[f64], chunks: &[f64], dim: usize, counts: &[u32], shares: &[f64]) -> Self {
        let n: usize = counts.iter().map(|&c| c as usize).sum();
        let (mut weight, mut expert, mut vecs) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n * dim));
        // per expert: the first of its (consecutive) copies, their weight and |v|²
        let mut first = Vec::with_capacity(counts.len());
        let mut starts = Vec::with_capacity(counts.len());
        for (e, &c) in counts.iter().enumerate() {
            let share = shares[c as usize];
            first.push(weight.len());
            let start = vecs.len();
            starts.push(start);
            vecs.extend(chunks[e * dim..(e + 1) * dim].iter().map(|x| (x * share) as f32));
            for k in 0..c as usize {
                if k > 0 {
                    vecs.extend_from_within(start..start + dim);
                }
                weight.push(loads[e] * share);
                expert.push(e as u32);
            }
        }
        let norm_e = norms(&vecs, &starts, dim);
        // heaviest first, ties lower index (the order `order_and_norm` gives): copies of one
        // expert have equal weights and consecutive indices, so sorting the experts by
        // (weight descending, expert) and expanding each into its copies is that order
        let mut by_expert: Vec<(i64, u32)> =
            counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(e, _)| (!total_key(weight[first[e]]), e as u32)).collect();
        by_expert.sort_unstable();
        let mut order = Vec::with_capacity(n);
        for &(_, e) in &by_expert {
            let f = first[e as usize];
            order.extend(f as u32..(f + counts[e as usize] as usize) as u32);
        }
        let norm = expert.iter().map(|&e| norm_e[e as usize]).collect();
        Items { weight, expert, vecs, dim, order, norm }
    }

    /// `(members, items)` of each of `bins` parts, part k holding the items i with
    /// `part_of[i] == k` in ascending index order (local index = position in `members[k]`).
    /// The parts inherit the order and norms: the local order is the global one restricted
    /// to the part, which keeps its tie rule because local indices ascend with global ones.
    pub(crate) fn split(&self, part_of: &[usize], bins: usize) -> (Vec<Vec<usize>>, Vec<Items>) {
        let d = self.dim;
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); bins];
        let mut local = vec![0u32; part_of.len()];
        for (i, &k) in part_of.iter().enumerate() {
            local[i] = members[k].len() as u32;
            members[k].push(i);
        }
        let mut parts: Vec<Items> = members
            .iter()
            .map(|idx| {
                let mut vecs = Vec::with_capacity(idx.len() * d);
                for &i in idx {
                    vecs.extend_from_slice(&self.vecs[i * d..(i + 1) * d]);
                }
                Items {
                    weight: idx.iter().map(|&i| self.weight[i]).collect(),
                    expert: idx.iter().map(|&i| self.expert[i]).collect(),
                    vecs,
                    dim: d,
                    order: Vec::with_capacity(idx.len()),
                    norm: idx.iter().map(|&i| self.norm[i]).collect(),
                }
            })
            .collect();
        for &i in &self.order {
            parts[part_of[i as usize]].order.push(local[i as usize]);
        }
        (members, parts)
    }

    pub(crate) fn problem(&self, num_experts: usize, bins: usize, cap: usize) -> Problem<'_> {
        Problem {
            weight: &self.weight,
            expert: &self.expert,
            num_experts,
            vecs: &self.vecs,
            dim: self.dim,
            bins,
            cap,
            order: &self.order,
            norm: &self.norm,
        }
    }
}

/// |v|² of the vectors `vecs[s..s + dim]` for each `s` in `starts`, each a float64 sum in
/// index order (as [`super::binpack::order_and_norm`] sums); sixteen vectors side by side, so
/// that their dependent chains of adds overlap (one sum at a time waits on each add; sixteen
/// measured faster than four).
fn norms(vecs: &[f32], starts: &[usize], dim: usize) -> Vec<f64> {
    const K: usize = 16;
    let mut out = Vec::with_capacity(starts.len());
    for group in starts.chunks(K) {
        let mut acc = [-0.0f64; K]; // where `Sum` starts (the empty sum is -0.0)
        for k in 0..dim {
            for (a, &s) in acc.iter_mut().zip(group) {
                let x = vecs[s + k] as f64;
                *a += x * x;
            }
        }
        out.extend_from_slice(&acc[..group.len()]);
    }
    out
}

/// Expert lists of rank bins given as item lists.
pub(crate) fn as_experts(items: &Items, bins: &[Vec<usize>]) -> Vec<Vec<i32>> {
    bins.iter().map(|b| b.iter().map(|&i| items.expert[i] as i32).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::routepack::binpack::order_and_norm;
    use proptest::prelude::*;

    proptest! {
        /// The order and norms built expert by expert are those of `order_and_norm` over the
        /// replicas (ties of equal weight included: loads drawn from few values).
        #[test]
        fn expert_order_is_the_replica_order(raw in prop::collection::vec((0u8..4, 1u32..4), 1..40), dim in 0usize..5) {
            let loads: Vec<f64> = raw.iter().map(|x| x.0 as f64 * 1.5).collect();
            let counts: Vec<u32> = raw.iter().map(|x| x.1).collect();
            let chunks: Vec<f64> = (0..loads.len() * dim).map(|k| (k % 7) as f64 * 0.3).collect();
            let it = Items::new(&loads, &chunks, dim, &counts);
            let (order, norm) = order_and_norm(&it.weight, &it.vecs, dim);
            prop_assert_eq!(&it.order, &order);
            prop_assert_eq!(it.norm.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), norm.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
    }
}
