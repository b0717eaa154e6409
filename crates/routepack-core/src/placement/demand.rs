//! What placement balances: per-layer aggregate loads and, for microbatch awareness, the
//! same loads split over chunks of the window.
//!
//! A chunk is a run of consecutive samples holding about `1 / num_chunks` of the window's
//! tokens. The per-chunk demand of an expert is the time series whose co-movement with other
//! experts decides the per-microbatch peaks: two experts hot in the same chunks add up on one
//! rank, two anti-correlated experts cancel.

use rayon::prelude::*;

use crate::cpu::Avx2;
use crate::error::{invalid, Result};
use crate::sizes;
use crate::window::WindowView;

/// Default number of chunks the window is split into for placement's microbatch awareness
/// (`placement_chunks`; 0 disables it).
pub const DEFAULT_CHUNKS: usize = 32;

/// Borrowed demand of one window.
///
/// * `loads`  `[L, E]` tokens per logical expert.
/// * `chunks` `[L, E, B]` tokens per logical expert in each of `num_chunks` chunks (B may be
///   0: no microbatch awareness); `Σ_b chunks[l, e, b] = loads[l, e]` when built from a window.
#[derive(Clone, Copy, Debug)]
pub struct Demand<'a> {
    /// MoE layers L.
    pub num_layers: usize,
    /// Logical experts E per layer.
    pub num_experts: usize,
    /// `[L, E]` tokens per logical expert.
    pub loads: &'a [f64],
    /// `[L, E, B]` tokens per logical expert in each chunk.
    pub chunks: &'a [f64],
    /// Chunks B (0: none).
    pub num_chunks: usize,
}

impl<'a> Demand<'a> {
    /// Checks the shapes (and that every entry is finite and >= 0) and wraps the tables.
    pub fn new(loads: &'a [f64], chunks: &'a [f64], num_layers: usize, num_experts: usize, num_chunks: usize) -> Result<Self> {
        if num_layers == 0 || num_experts == 0 || loads.len() != num_layers * num_experts {
            return Err(invalid("loads", format!("has {} entries; expected L*E = {num_layers}*{num_experts} with L, E >= 1", loads.len())));
        }
        if chunks.len() != num_layers * num_experts * num_chunks {
            return Err(invalid(
                "chunks",
                format!("has {} entries; expected L*E*B = {num_layers}*{num_experts}*{num_chunks}", chunks.len()),
            ));
        }
        super::replica_counts::check_loads(loads, "loads")?;
        super::replica_counts::check_loads(chunks, "chunks")?;
        Ok(Self { num_layers, num_experts, loads, chunks, num_chunks })
    }

    /// Layer l's `[E]` loads.
    #[inline]
    pub fn layer_loads(&self, l: usize) -> &'a [f64] {
        &self.loads[l * self.num_experts..(l + 1) * self.num_experts]
    }

    /// `[E, B]` chunk demand of layer l.
    #[inline]
    pub fn layer_chunks(&self, l: usize) -> &'a [f64] {
        let n = self.num_experts * self.num_chunks;
        &self.chunks[l * n..(l + 1) * n]
    }
}

/// `[S]` chunk of each sample: sample s goes to chunk ⌊B · (tokens before s + n_s / 2) / total⌋,
/// so chunks are consecutive runs of about total / B tokens.
pub fn chunk_of_samples(seq_lens: &[i64], num_chunks: usize) -> Vec<usize> {
    let total: f64 = seq_lens.iter().map(|&n| n as f64).sum();
    let mut before = 0.0;
    seq_lens
        .iter()
        .map(|&n| {
            let mid = before + n as f64 / 2.0;
            before += n as f64;
            ((mid / total * num_chunks as f64) as usize).min(num_chunks.saturating_sub(1))
        })
        .collect()
}

/// `[L, E, B]` demand of each expert in each chunk of `w` (see [`chunk_of_samples`]).
pub fn chunk_demand(w: &WindowView, num_chunks: usize) -> Result<Vec<f64>> {
    if num_chunks == 0 {
        return Ok(Vec::new());
    }
    if num_chunks > w.num_samples {
        return Err(invalid(
            "placement_chunks",
            format!("{num_chunks} chunks for {} samples; use at most one chunk per sample", w.num_samples),
        ));
    }
    let (e_n, b_n) = (w.num_experts, num_chunks);
    // the call holds the result [L, E, B] and, per worker, one layer's integer sums [B, E];
    // every byte of it is sized by `placement_chunks`
    let what = format!("chunk demand [L, E, B] = [{}, {e_n}, {b_n}] of float64 (and per worker [B, E] of int64)", w.num_layers);
    let scratch = sizes::bytes_of::<i64>(b_n.saturating_mul(e_n)).saturating_mul(rayon::current_num_threads() as u128);
    let out_n = w.num_layers.saturating_mul(e_n).saturating_mul(b_n);
    sizes::check_call("placement_chunks", &what, sizes::bytes_of::<f64>(out_n).saturating_add(scratch))?;
    let chunk = chunk_of_samples(w.seq_lens, num_chunks);
    let mut out = sizes::filled("placement_chunks", &what, out_n, 0.0f64)?;
    out.par_chunks_mut(e_n * b_n).enumerate().try_for_each(|(l, out)| {
        // chunk-major integer sums first (contiguous rows: the loop vectorises), then the
        // [E, B] transpose; integer counts below 2^53 make these f64 values exact, the
        // same as summing in f64 in any order
        let mut acc = sizes::filled("placement_chunks", &what, b_n * e_n, 0i64)?;
        chunk_sums(w, l, &chunk, &mut acc);
        for (b, row) in acc.chunks_exact(e_n).enumerate() {
            for (e, &x) in row.iter().enumerate() {
                out[e * b_n + b] = x as f64;
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// Adds every sample's demand in layer `l` to its chunk's row of `acc` `[B, E]`; compiled for
/// AVX2 where the CPU has it (integer sums: the same values either way).
fn chunk_sums(w: &WindowView, l: usize, chunk: &[usize], acc: &mut [i64]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = Avx2::detect() {
        // SAFETY: `cpu` proves the running CPU has AVX2
        return unsafe { chunk_sums_avx2(cpu, w, l, chunk, acc) };
    }
    chunk_sums_body(w, l, chunk, acc)
}

/// [`chunk_sums`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2 (`_cpu` is the token that says so).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn chunk_sums_avx2(_cpu: Avx2, w: &WindowView, l: usize, chunk: &[usize], acc: &mut [i64]) {
    chunk_sums_body(w, l, chunk, acc)
}

#[inline(always)]
fn chunk_sums_body(w: &WindowView, l: usize, chunk: &[usize], acc: &mut [i64]) {
    let e_n = w.num_experts;
    for (s, &b) in chunk.iter().enumerate() {
        crate::with_counts!(w.tokens(s, l), x => for (a, &c) in acc[b * e_n..(b + 1) * e_n].iter_mut().zip(x) {
            *a += i64::from(c);
        });
    }
}

/// `[L, E]` aggregate loads of `w` (Σ over samples), as `WindowView::layer_expert_load`.
pub fn window_loads(w: &WindowView) -> Vec<f64> {
    w.layer_expert_load()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_split_tokens_and_sum_to_loads() {
        let lens = [4i64, 4, 4, 4];
        let x: Vec<i32> = (0..4 * 2).collect(); // S=4, L=1, E=2
        let w = WindowView::new(&lens, &x, 1, 2).unwrap();
        assert_eq!(chunk_of_samples(&lens, 2), vec![0, 0, 1, 1]);
        let c = chunk_demand(&w, 2).unwrap();
        assert_eq!(c, vec![0.0 + 2.0, 4.0 + 6.0, 1.0 + 3.0, 5.0 + 7.0]);
        let loads = window_loads(&w);
        assert_eq!(loads, vec![12.0, 16.0]);
        assert!(chunk_demand(&w, 5).unwrap_err().to_string().contains("placement_chunks"));
    }
}
