//! The replicas of one layer as the packer sees them: aggregate weight, expert and per-chunk
//! demand of each copy (an expert's load split evenly over its copies, as `flow` routes it).

use super::pack::{order_and_norm, Problem};

/// Replicas of one layer: weight, expert and chunk vector of each, with the packer's
/// heaviest-first order and chunk-vector norms (see [`order_and_norm`]).
pub(crate) struct Items {
    pub(crate) weight: Vec<f64>,
    pub(crate) expert: Vec<u32>,
    pub(crate) vecs: Vec<f32>,
    pub(crate) dim: usize,
    order: Vec<u32>,
    norm: Vec<f64>,
}

impl Items {
    pub(crate) fn new(loads: &[f64], chunks: &[f64], dim: usize, counts: &[u32]) -> Self {
        let n: usize = counts.iter().map(|&c| c as usize).sum();
        let (mut weight, mut expert, mut vecs) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n * dim));
        for (e, &c) in counts.iter().enumerate() {
            let share = 1.0 / c as f64;
            for _ in 0..c {
                weight.push(loads[e] * share);
                expert.push(e as u32);
                vecs.extend(chunks[e * dim..(e + 1) * dim].iter().map(|x| (x * share) as f32));
            }
        }
        let (order, norm) = order_and_norm(&weight, &vecs, dim);
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

/// Expert lists of rank bins given as item lists.
pub(crate) fn as_experts(items: &Items, bins: &[Vec<usize>]) -> Vec<Vec<i32>> {
    bins.iter().map(|b| b.iter().map(|&i| items.expert[i] as i32).collect()).collect()
}
