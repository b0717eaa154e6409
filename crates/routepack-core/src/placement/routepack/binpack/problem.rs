//! One bin-packing problem: the replicas of one layer (or of one node's share of them) with
//! their aggregate weights, experts and per-chunk demand vectors, the bins and their slot
//! count, and the heaviest-first order every phase visits items in. Read-only input of
//! [`super::Pack`].

/// One packing problem. Items are replicas; `n = bins · cap`.
pub struct Problem<'a> {
    /// `[n]` aggregate load of each replica.
    pub weight: &'a [f64],
    /// `[n]` logical expert of each replica, `< num_experts`.
    pub expert: &'a [u32],
    /// Logical experts of the layer (bounds of `expert`).
    pub num_experts: usize,
    /// `[n · dim]` per-chunk load of each replica (dim may be 0: no fluctuation phase).
    /// float32: only compared, never accumulated, and half the memory traffic.
    pub vecs: &'a [f32],
    /// Chunks per demand vector.
    pub dim: usize,
    /// Bins to fill (nodes or ranks).
    pub bins: usize,
    /// Items each bin takes: exactly `cap` (its slots).
    pub cap: usize,
    /// `[n]` items heaviest first (ties: lower index), from [`order_and_norm`]: every phase
    /// visits items in this order, so it is sorted once per layer, not once per phase.
    pub order: &'a [u32],
    /// `[n]` |v_i|² of each item (float64 sum of the float32 entries, in order).
    pub norm: &'a [f64],
}

/// `([n] items heaviest first, ties lower index; [n] |v_i|²)` of items with weights `weight`
/// and chunk vectors `vecs` (`[n · dim]`): what [`Problem::order`] and [`Problem::norm`] hold.
pub fn order_and_norm(weight: &[f64], vecs: &[f32], dim: usize) -> (Vec<u32>, Vec<f64>) {
    let mut order: Vec<u32> = (0..weight.len() as u32).collect();
    order.sort_unstable_by(|&x, &y| weight[y as usize].total_cmp(&weight[x as usize]).then(x.cmp(&y)));
    let norm = (0..weight.len()).map(|i| vecs[i * dim..(i + 1) * dim].iter().map(|&x| x as f64 * x as f64).sum()).collect();
    (order, norm)
}

impl Problem<'_> {
    /// Item i's per-chunk demand vector (`dim` entries).
    #[inline]
    pub(super) fn v(&self, i: usize) -> &[f32] {
        &self.vecs[i * self.dim..(i + 1) * self.dim]
    }
    /// Number of items (replicas).
    pub fn len(&self) -> usize {
        self.weight.len()
    }
    /// No items at all.
    pub fn is_empty(&self) -> bool {
        self.weight.is_empty()
    }
}
