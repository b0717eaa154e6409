//! The predicted time of one layer's placement over the window, from the chunk demand: what
//! the migration choice weighs against the exposed migration time.

use crate::cost::{CostModel, COMM_PASSES, COMPUTE_PASSES};
use crate::topology::Topology;

use super::routepack::Options;

/// The predicted-time proxy of one layer's phy2log: Σ over cells of the largest rank load in
/// that cell (tokens), times the seconds one token on the critical rank costs (expert compute
/// and its all-to-all share), over the number of EP groups (each runs 1/G of the cells).
pub(crate) struct Predictor<'a> {
    /// `[E, C]` demand per cell (chunks merged into `cells` consecutive runs).
    cells: Vec<f64>,
    num_cells: usize,
    per_token: f64,
    groups: f64,
    topo: &'a Topology,
}

impl<'a> Predictor<'a> {
    pub(crate) fn new(loads: &[f64], chunks: &[f64], num_chunks: usize, opts: &Options, cost: &CostModel, topo: &'a Topology) -> Self {
        let e_n = loads.len();
        let (cells, num_cells) = if num_chunks == 0 {
            (loads.to_vec(), 1)
        } else {
            let c = if opts.cells == 0 { num_chunks } else { opts.cells.min(num_chunks) };
            // cell k holds the consecutive chunks b with b·c / num_chunks == k, from `start[k]`
            let mut start = vec![num_chunks; c + 1];
            for b in (0..num_chunks).rev() {
                start[b * c / num_chunks] = b;
            }
            let mut v = vec![0.0; e_n * c];
            for (row, src) in v.chunks_exact_mut(c).zip(chunks.chunks_exact(num_chunks)) {
                for (k, x) in row.iter_mut().enumerate() {
                    *x = src[start[k]..start[k + 1]].iter().fold(0.0, |s, &y| s + y);
                }
            }
            (v, c)
        };
        let a2a = cost.token_bytes * cost.uniform_seconds_per_byte(topo);
        let per_token = COMPUTE_PASSES * cost.c_tok + 2.0 * COMM_PASSES * a2a;
        Self { cells, num_cells, per_token, groups: topo.num_groups() as f64, topo }
    }

    pub(crate) fn time(&self, layer: &[i32]) -> f64 {
        let (c_n, spr) = (self.num_cells, self.topo.slots_per_rank);
        let e_n = self.cells.len() / c_n;
        let mut cnt = vec![0u32; e_n];
        for &e in layer.iter().filter(|&&e| e >= 0) {
            cnt[e as usize] += 1;
        }
        let mut peak = vec![0.0f64; c_n];
        let mut rank = vec![0.0f64; c_n];
        for r in 0..self.topo.ep {
            rank.iter_mut().for_each(|x| *x = 0.0);
            for &e in layer[r * spr..(r + 1) * spr].iter().filter(|&&e| e >= 0) {
                let share = 1.0 / cnt[e as usize] as f64;
                for (x, &y) in rank.iter_mut().zip(&self.cells[e as usize * c_n..(e as usize + 1) * c_n]) {
                    *x += y * share;
                }
            }
            for (p, &x) in peak.iter_mut().zip(&rank) {
                *p = p.max(x);
            }
        }
        peak.iter().sum::<f64>() * self.per_token / self.groups
    }
}
