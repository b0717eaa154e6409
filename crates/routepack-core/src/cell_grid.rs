//! The cells (DP rank, microbatch) of a packed window: which samples every rank runs at each
//! microbatch and their attention work, and from them what the simulator and the
//! per-exchange planners (replication) read for one exchange (EP group, microbatch, layer): the
//! slowest rank's attention and the tokens each EP rank sends to each logical expert.

use crate::bound::{row_sums, BoundTops};
use crate::cost::CostModel;
use crate::cpu::Avx2;
use crate::plan::cell_members;
use crate::topology::Topology;
use crate::window::WindowView;

/// Rows the origin passes prefetch ahead of the one they sum: enough to cover a read from
/// memory on a loaded machine while the rows between are summed.
const READ_AHEAD: usize = 4;

/// Samples per (DP rank, microbatch) and their Σ n, Σ n² (what attention costs).
/// Built from a packing that `validate_plan` accepted (ranks and microbatches in range).
#[derive(Clone, Debug)]
pub struct CellGrid {
    /// EP ranks per group (`Topology::ep`): DP rank d is EP-local rank d mod ep of group d / ep.
    pub ep: usize,
    /// EP groups G (`Topology::num_groups`).
    pub num_groups: usize,
    /// Microbatches M per DP rank.
    pub num_micro: usize,
    off: Vec<usize>,
    members: Vec<usize>,
    /// `[dp * M]` Σ n_s of each cell.
    lin: Vec<f64>,
    /// `[dp * M]` Σ n_s² of each cell.
    quad: Vec<f64>,
    /// `[dp * M]` one-pass seconds of each cell's ring KV exchange ([`CellGrid::set_ring`]);
    /// empty where no cell runs a piece of a split sample.
    ring: Vec<f64>,
}

impl CellGrid {
    /// `sample_rank`, `sample_micro` `[S]` (in range), `num_micro` M, `seq_lens` `[S]`.
    pub fn new(sample_rank: &[i32], sample_micro: &[i32], num_micro: usize, seq_lens: &[i64], topo: &Topology) -> Self {
        let (off, members) = cell_members(sample_rank, sample_micro, topo.dp, num_micro);
        let cells = topo.dp * num_micro;
        let mut lin = vec![0.0; cells];
        let mut quad = vec![0.0; cells];
        for c in 0..cells {
            // same summation order as the members (ascending sample index)
            let (a, b) = members[off[c]..off[c + 1]].iter().fold((0.0, 0.0), |(a, b), &s| {
                let n = seq_lens[s] as f64;
                (a + n, b + n * n)
            });
            lin[c] = a;
            quad[c] = b;
        }
        Self { ep: topo.ep, num_groups: topo.num_groups(), num_micro, off, members, lin, quad, ring: Vec::new() }
    }

    /// Samples of global DP rank `d` at microbatch `m`, ascending.
    #[inline]
    pub fn members(&self, d: usize, m: usize) -> &[usize] {
        let c = d * self.num_micro + m;
        &self.members[self.off[c]..self.off[c + 1]]
    }

    /// Tokens (Σ n_s) of global DP rank `d`'s microbatch `m`.
    #[inline]
    pub fn tokens(&self, d: usize, m: usize) -> f64 {
        self.lin[d * self.num_micro + m]
    }

    /// The slowest rank's one-pass attention time in exchange (group g, microbatch m, layer l).
    pub fn attention_max(&self, cost: &CostModel, g: usize, m: usize, l: usize) -> f64 {
        (0..self.ep).map(|r| self.attention_of(cost, g, m, l, r)).fold(0.0, f64::max)
    }

    /// EP-local rank `r`'s one-pass attention time in exchange (group g, microbatch m, layer l):
    /// its cell's [`CostModel::attention_of_sums`] (ring attention for a piece of a split sample).
    #[inline]
    pub fn attention_of(&self, cost: &CostModel, g: usize, m: usize, l: usize, r: usize) -> f64 {
        let c = (g * self.ep + r) * self.num_micro + m;
        match self.ring.get(c) {
            Some(&kv) => cost.ring_attention(l, self.lin[c], self.quad[c], kv),
            None => cost.attention_of_sums(l, self.lin[c], self.quad[c]),
        }
    }

    /// Prices cell (global DP rank `d`, microbatch `m`), which runs one piece of a sample split
    /// over a ring, as ring attention does: its quadratic term `quad` (`CostModel::ring_quad`)
    /// and `kv` one-pass seconds of KV blocks (`CostModel::ring_kv_time`).
    pub fn set_ring(&mut self, d: usize, m: usize, quad: f64, kv: f64) {
        let c = d * self.num_micro + m;
        if self.ring.is_empty() {
            self.ring = vec![0.0; self.lin.len()];
        }
        self.quad[c] = quad;
        self.ring[c] = kv;
    }

    /// Fills `origin` `[ep * E]` (rank-major): tokens for logical expert e that EP-local rank
    /// r's samples send in exchange (group g, microbatch m, layer l).
    /// Compiled for AVX2 where the CPU has it (integer sums: the same values either way).
    pub fn origin(&self, w: &WindowView, g: usize, m: usize, l: usize, origin: &mut [i64]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = Avx2::detect() {
            // SAFETY: `cpu` proves the running CPU has AVX2
            return unsafe { self.origin_avx2(cpu, w, g, m, l, origin) };
        }
        self.origin_body(w, g, m, l, origin)
    }

    /// [`CellGrid::origin`] compiled for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2 (`_cpu` is the token that says so).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn origin_avx2(&self, _cpu: Avx2, w: &WindowView, g: usize, m: usize, l: usize, origin: &mut [i64]) {
        self.origin_body(w, g, m, l, origin)
    }

    #[inline(always)]
    fn origin_body(&self, w: &WindowView, g: usize, m: usize, l: usize, origin: &mut [i64]) {
        let e_n = w.num_experts;
        debug_assert_eq!(origin.len(), self.ep * e_n);
        origin.iter_mut().for_each(|x| *x = 0);
        let mut ahead = self.read_ahead(g, m);
        for r in 0..self.ep {
            let row = &mut origin[r * e_n..(r + 1) * e_n];
            for &s in self.members(g * self.ep + r, m) {
                if let Some(t) = ahead.next() {
                    w.prefetch_row(t, l);
                }
                crate::with_counts!(w.tokens(s, l), x => for (o, &c) in row.iter_mut().zip(x) {
                    *o += i64::from(c);
                });
            }
        }
    }

    /// The samples of group g's cells at microbatch m in the order the origin passes read
    /// them (ranks ascending, each cell's members ascending), from the `READ_AHEAD`-th on:
    /// what to prefetch while the earlier ones are summed.
    fn read_ahead(&self, g: usize, m: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.ep).flat_map(move |r| self.members(g * self.ep + r, m).iter().copied()).skip(READ_AHEAD)
    }

    /// [`CellGrid::origin`], gathering on the way what the lower bound reads of each row
    /// ([`crate::bound::DemandSums`], through [`row_sums`]): `share` `[E]` is raised to every
    /// member's largest share of its length, and `row(s, tokens, experts, tops)` is called for
    /// each member s (its Σ_e tokens and distinct experts in layer l, and its top-k sums
    /// `BoundTops::row` where `tops` is given, else zeros). Compiled for AVX2 where the CPU has
    /// it, the top-k sums too (computed here, not in `row`, so they are compiled so: integer
    /// sums and maxima, the same bits either way).
    #[allow(clippy::too_many_arguments)]
    pub fn origin_and_sums(
        &self,
        w: &WindowView,
        g: usize,
        m: usize,
        l: usize,
        origin: &mut [i64],
        share: &mut [f64],
        tops: Option<&BoundTops>,
        row: impl FnMut(usize, i64, usize, [f64; 4]),
    ) {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = Avx2::detect() {
            // SAFETY: `cpu` proves the running CPU has AVX2
            return unsafe { self.origin_and_sums_avx2(cpu, w, g, m, l, origin, share, tops, row) };
        }
        self.origin_and_sums_body(w, g, m, l, origin, share, tops, row)
    }

    /// [`CellGrid::origin_and_sums`] compiled for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2 (`_cpu` is the token that says so).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn origin_and_sums_avx2(
        &self,
        _cpu: Avx2,
        w: &WindowView,
        g: usize,
        m: usize,
        l: usize,
        origin: &mut [i64],
        share: &mut [f64],
        tops: Option<&BoundTops>,
        row: impl FnMut(usize, i64, usize, [f64; 4]),
    ) {
        self.origin_and_sums_body(w, g, m, l, origin, share, tops, row)
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn origin_and_sums_body(
        &self,
        w: &WindowView,
        g: usize,
        m: usize,
        l: usize,
        origin: &mut [i64],
        share: &mut [f64],
        tops: Option<&BoundTops>,
        mut row: impl FnMut(usize, i64, usize, [f64; 4]),
    ) {
        let e_n = w.num_experts;
        debug_assert_eq!(origin.len(), self.ep * e_n);
        origin.iter_mut().for_each(|x| *x = 0);
        let mut ahead = self.read_ahead(g, m);
        for r in 0..self.ep {
            let o = &mut origin[r * e_n..(r + 1) * e_n];
            for &s in self.members(g * self.ep + r, m) {
                if let Some(t) = ahead.next() {
                    w.prefetch_row(t, l);
                }
                let (tokens, experts) = crate::with_counts!(w.tokens(s, l), t => row_sums(t, w.seq_lens[s], o, share));
                // the row was just read: its top-k sums while it is in cache
                let top = tops.map_or([0.0; 4], |b| b.row(l, w.tokens(s, l), w.seq_lens[s], tokens as f64, experts));
                row(s, tokens, experts, top);
            }
        }
    }
}
