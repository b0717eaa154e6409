//! The replicas of one layer as the packer sees them: aggregate weight, expert and per-chunk
//! demand of each copy (an expert's load split evenly over its copies, as `flow` routes it).

use super::pack::Problem;

/// Replicas of one layer: weight, expert and chunk vector of each.
pub(crate) struct Items {
    pub(crate) weight: Vec<f64>,
    pub(crate) expert: Vec<u32>,
    pub(crate) vecs: Vec<f32>,
    pub(crate) dim: usize,
}

impl Items {
    pub(crate) fn new(loads: &[f64], chunks: &[f64], dim: usize, counts: &[u32]) -> Self {
        let n: usize = counts.iter().map(|&c| c as usize).sum();
        let mut it = Items { weight: Vec::with_capacity(n), expert: Vec::with_capacity(n), vecs: Vec::with_capacity(n * dim), dim };
        for (e, &c) in counts.iter().enumerate() {
            let share = 1.0 / c as f64;
            for _ in 0..c {
                it.weight.push(loads[e] * share);
                it.expert.push(e as u32);
                it.vecs.extend(chunks[e * dim..(e + 1) * dim].iter().map(|x| (x * share) as f32));
            }
        }
        it
    }

    pub(crate) fn subset(&self, idx: &[usize]) -> Items {
        let d = self.dim;
        Items {
            weight: idx.iter().map(|&i| self.weight[i]).collect(),
            expert: idx.iter().map(|&i| self.expert[i]).collect(),
            vecs: {
                let mut v = Vec::with_capacity(idx.len() * d);
                for &i in idx {
                    v.extend_from_slice(&self.vecs[i * d..(i + 1) * d]);
                }
                v
            },
            dim: d,
        }
    }

    pub(crate) fn problem(&self, num_experts: usize, bins: usize, cap: usize) -> Problem<'_> {
        Problem { weight: &self.weight, expert: &self.expert, num_experts, vecs: &self.vecs, dim: self.dim, bins, cap }
    }
}

/// Expert lists of rank bins given as item lists.
pub(crate) fn as_experts(items: &Items, bins: &[Vec<usize>]) -> Vec<Vec<i32>> {
    bins.iter().map(|b| b.iter().map(|&i| items.expert[i] as i32).collect()).collect()
}
