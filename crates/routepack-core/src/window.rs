//! A window of samples as the planner sees it: each sample's length and its per-layer demand
//! for every logical expert (from routing replay). Borrowed, so numpy arrays cross the FFI
//! without a copy.

use rayon::prelude::*;

use crate::counts::Counts;
use crate::error::{invalid, Result};

/// Entries of `expert_tokens` per parallel task of the negativity check in
/// [`WindowView::new`]: large enough that a task outweighs its scheduling (256 KiB of i32).
const NEGATIVE_SCAN_CHUNK: usize = 1 << 16;

/// Borrowed view of a window.
///
/// * `seq_lens`      `[S]` tokens of each sample, every entry >= 1.
/// * `expert_tokens` `[S, L, E]` row-major: tokens of sample s routed to logical expert e in
///   MoE layer l (each token counts once per expert it was routed to, so a row sums to k·n_s),
///   borrowed in the type they are stored in (int32, uint16 or uint8: [`Counts`]); every
///   result is the same whichever type carries the same values.
#[derive(Clone, Copy, Debug)]
pub struct WindowView<'a> {
    /// `[S]` tokens of each sample, every entry >= 1.
    pub seq_lens: &'a [i64],
    /// `[S, L, E]` row-major routed tokens of sample s to logical expert e in layer l (see
    /// [`WindowView::tokens`]); every entry >= 0.
    pub expert_tokens: Counts<'a>,
    /// S, the samples of the window (`seq_lens.len()`, >= 1).
    pub num_samples: usize,
    /// L, the MoE layers (>= 1).
    pub num_layers: usize,
    /// E, the logical experts per layer (>= 1).
    pub num_experts: usize,
}

impl<'a> WindowView<'a> {
    /// Checks shapes and values; O(S·L·E) once, so later stages can index without checks
    /// (the negativity scan runs only for int32 counts: the unsigned types cannot hold one).
    pub fn new(seq_lens: &'a [i64], expert_tokens: impl Into<Counts<'a>>, num_layers: usize, num_experts: usize) -> Result<Self> {
        let expert_tokens = expert_tokens.into();
        let s = seq_lens.len();
        if s == 0 {
            return Err(invalid("seq_lens", "a window needs at least one sample (got 0)"));
        }
        if num_layers == 0 || num_experts == 0 {
            return Err(invalid("expert_tokens", format!("needs L >= 1 and E >= 1, got L={num_layers}, E={num_experts}")));
        }
        if s.checked_mul(num_layers).and_then(|x| x.checked_mul(num_experts)) != Some(expert_tokens.len()) {
            return Err(invalid(
                "expert_tokens",
                format!("has {} entries, expected S*L*E = {}*{}*{}", expert_tokens.len(), s, num_layers, num_experts),
            ));
        }
        if let Some((i, &n)) = seq_lens.iter().enumerate().find(|(_, &n)| n < 1) {
            return Err(invalid("seq_lens", format!("sample {i} has length {n}; every length must be >= 1")));
        }
        // every FFI call of a stage builds a view, so this pass runs several times per plan:
        // a vectorisable min per chunk, in parallel; the entry is located only on a violation
        // (the first one, as a serial scan would find it)
        let Counts::I32(signed) = expert_tokens else {
            return Ok(Self { seq_lens, expert_tokens, num_samples: s, num_layers, num_experts });
        };
        let first_negative = signed.par_chunks(NEGATIVE_SCAN_CHUNK).enumerate().find_map_first(|(c, chunk)| {
            let lo = chunk.iter().fold(i32::MAX, |m, &x| m.min(x));
            (lo < 0).then(|| c * NEGATIVE_SCAN_CHUNK + chunk.iter().position(|&x| x < 0).unwrap_or(0))
        });
        if let Some(i) = first_negative {
            let (si, rest) = (i / (num_layers * num_experts), i % (num_layers * num_experts));
            return Err(invalid(
                "expert_tokens",
                format!("negative count {} at sample {si}, layer {}, expert {}", signed[i], rest / num_experts, rest % num_experts),
            ));
        }
        Ok(Self { seq_lens, expert_tokens, num_samples: s, num_layers, num_experts })
    }

    /// Demand of sample `s` in layer `l`: `[E]` tokens per logical expert, in the stored type
    /// (read it with [`Counts::add_to`] and the other helpers, or [`crate::with_counts!`]).
    #[inline]
    pub fn tokens(&self, s: usize, l: usize) -> Counts<'a> {
        let off = (s * self.num_layers + l) * self.num_experts;
        self.expert_tokens.slice(off, self.num_experts)
    }

    /// Asks the CPU to bring row (s, l) (`[E]` counts, [`WindowView::tokens`]) into its cache
    /// ahead of a read: the passes that gather a cell's samples (`CellGrid::origin`) jump
    /// between rows far apart in the window, and on a window of gigabytes each row's first
    /// line otherwise waits on memory. A hint only: no result depends on it (a no-op off
    /// x86-64).
    #[inline(always)]
    pub fn prefetch_row(&self, s: usize, l: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let (ptr, bytes) = crate::with_counts!(self.tokens(s, l), x => (x.as_ptr() as *const i8, std::mem::size_of_val(x)));
            let mut off = 0;
            while off < bytes {
                // SAFETY: a prefetch never faults and reads nothing the program sees; the
                // address is inside the row (`off < bytes`), borrowed for 'a
                unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.add(off)) };
                off += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (s, l);
    }

    /// Total tokens of the window, Σ n_s.
    pub fn total_tokens(&self) -> i64 {
        self.seq_lens.iter().sum()
    }

    /// Aggregate demand `[L, E]` over all samples (what window-level placement balances).
    pub fn layer_expert_load(&self) -> Vec<f64> {
        let (l, e) = (self.num_layers, self.num_experts);
        let mut out = vec![0.0f64; l * e];
        for s in 0..self.num_samples {
            for li in 0..l {
                self.tokens(s, li).add_to_f64(&mut out[li * e..(li + 1) * e]);
            }
        }
        out
    }
}
