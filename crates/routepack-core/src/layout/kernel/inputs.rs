//! The kernel's inputs: the state layout (values per rank), the problem shape, the
//! coefficients, the demand vectors and the step deltas. A leaf module: the loop (`pass`), the
//! vector builds and the entry points all read these, and they read nothing of the kernel.

/// Values kept per (group, microbatch, layer, EP rank), at these offsets.
pub const VALUES: usize = 5;
/// Tokens the rank receives.
pub const TOK: usize = 0;
/// Tokens received from the other ranks of the rank's node.
pub const R_IN: usize = 1;
/// Tokens received from other nodes.
pub const X_IN: usize = 2;
/// Tokens sent to the other ranks of the rank's node.
pub const S_IN: usize = 3;
/// Tokens sent to other nodes.
pub const S_EX: usize = 4;
/// Layers per vector (and per layer block).
pub const LANES: usize = 8;

/// Cost coefficients per token (all passes included).
#[derive(Clone, Copy, Debug)]
pub struct Coeffs {
    /// Expert work per received token.
    pub ct: f32,
    /// All-to-all seconds per token over the intra-node link.
    pub ki: f32,
    /// All-to-all seconds per token over the inter-node link.
    pub ke: f32,
}

/// Sizes, and where each value lives in the blocked arrays (see the module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// MoE layers.
    pub layers: usize,
    /// Layer blocks: ⌈layers / 8⌉.
    pub blocks: usize,
    /// EP ranks per group.
    pub ep: usize,
    /// Nodes per group (ep is a multiple).
    pub nodes: usize,
}

impl Shape {
    /// The shape of `layers` layers on `ep` ranks over `nodes` nodes.
    pub fn new(layers: usize, ep: usize, nodes: usize) -> Self {
        Self { layers, blocks: layers.div_ceil(LANES), ep, nodes }
    }
    /// Length of a demand vector (a sample's or a cell's).
    #[inline]
    pub fn demand_len(&self) -> usize {
        self.blocks * LANES * (self.ep + 1 + self.nodes)
    }
    /// Length of one (group, microbatch)'s state.
    #[inline]
    pub fn state_len(&self) -> usize {
        self.blocks * self.ep * VALUES * LANES
    }
    /// Length of hexp.
    #[inline]
    pub fn hexp_len(&self) -> usize {
        self.blocks * self.ep * LANES
    }
    /// Demand vector: tokens for EP rank p in layer l (also hexp's index).
    #[inline]
    pub fn proj_at(&self, l: usize, p: usize) -> usize {
        (l / LANES * self.ep + p) * LANES + l % LANES
    }
    /// Length of a demand vector's proj part (the rest, otot and onode, is its "tail").
    #[inline]
    pub fn proj_len(&self) -> usize {
        self.blocks * self.ep * LANES
    }
    /// Demand vector: tokens sent in layer l.
    #[inline]
    pub fn otot_at(&self, l: usize) -> usize {
        self.blocks * self.ep * LANES + l
    }
    /// Demand vector: tokens for the ranks of node n in layer l.
    #[inline]
    pub fn onode_at(&self, l: usize, n: usize) -> usize {
        self.blocks * LANES * (self.ep + 1) + (l / LANES * self.nodes + n) * LANES + l % LANES
    }
    /// State: value `value` (`TOK`, …, `S_EX`) of rank p in layer l (the pass forms these
    /// offsets incrementally; the tests build states with this).
    #[cfg(test)]
    #[inline]
    pub fn state_at(&self, value: usize, l: usize, p: usize) -> usize {
        ((l / LANES * self.ep + p) * VALUES + value) * LANES + l % LANES
    }
}

/// A demand vector as the kernel reads it: one f32 vector (proj ++ tail, `Shape`), or a
/// compact one, proj in u16 (whole numbers of tokens that fit, half the bytes to stream) and
/// the tail (otot, onode: larger sums) in f32.
#[derive(Clone, Copy)]
pub enum Demand<'a> {
    /// proj ++ tail in f32.
    F32(&'a [f32]),
    /// proj in u16, the tail in f32.
    U16 {
        /// `[proj_len]`
        proj: &'a [u16],
        /// `[demand_len − proj_len]`
        tail: &'a [f32],
    },
}

impl Demand<'_> {
    fn check(&self, s: Shape) -> bool {
        match self {
            Demand::F32(r) => r.len() >= s.demand_len(),
            Demand::U16 { proj, tail } => proj.len() >= s.proj_len() && tail.len() >= s.demand_len() - s.proj_len(),
        }
    }
    fn compact(&self) -> bool {
        matches!(self, Demand::U16 { .. })
    }
    /// Where the proj part and the tail start (tail offsets are `Shape::otot_at` and
    /// `onode_at` minus `proj_len`).
    pub(super) fn ptrs(&self, s: Shape) -> (*const u8, *const f32) {
        match self {
            Demand::F32(r) => (r.as_ptr() as *const u8, r[s.proj_len()..].as_ptr()),
            Demand::U16 { proj, tail } => (proj.as_ptr() as *const u8, tail.as_ptr()),
        }
    }
}

/// One (group, microbatch)'s view of a move: the demand vectors `add` and `sub` (None: zeros; both
/// of one kind), the change of its received tokens `ts` (±1 or 0), and the end ranks
/// `ends[..n_ends]` (distinct) with signs.
#[derive(Clone, Copy)]
pub struct StepDelta<'a> {
    /// Demand entering (None: zeros).
    pub add: Option<Demand<'a>>,
    /// Demand leaving (None: zeros).
    pub sub: Option<Demand<'a>>,
    /// Change of the step's received tokens: ±1 or 0.
    pub ts: f32,
    /// End ranks and their signs (±1).
    pub ends: [(usize, f32); 2],
    /// How many of `ends` are used (at most 2).
    pub n_ends: usize,
}

/// Hosted-expert cost: per (layer, rank) `[blocks, ep, 8]`, and, when it is the same for
/// every rank of each layer, that value per layer `[blocks · 8]`.
#[derive(Clone, Copy)]
pub struct Hosted<'a> {
    /// `[blocks, ep, 8]`
    pub per_rank: &'a [f32],
    /// `[blocks · 8]`, when uniform over the ranks of every layer.
    pub per_layer: Option<&'a [f32]>,
}

impl StepDelta<'_> {
    /// Panics unless a pass over a state of `state` values may read every input: the bounds
    /// the safe entry points rely on.
    pub(super) fn check(&self, state: usize, h: &Hosted, s: Shape) {
        assert!(state >= s.state_len() && h.per_rank.len() >= s.hexp_len());
        assert!(h.per_layer.is_none_or(|x| x.len() >= s.blocks * LANES));
        assert!(self.add.is_none_or(|r| r.check(s)) && self.sub.is_none_or(|r| r.check(s)));
        assert!(self.add.is_none() || self.sub.is_none() || self.add.is_some_and(|a| a.compact()) == self.sub.is_some_and(|b| b.compact()));
        assert!(s.nodes >= 1 && s.ep.is_multiple_of(s.nodes) && s.blocks * LANES >= s.layers);
        assert!(self.n_ends <= 2 && self.ends[..self.n_ends].iter().all(|e| e.0 < s.ep));
        assert!(self.n_ends < 2 || self.ends[0].0 != self.ends[1].0);
        assert!([self.ts].iter().chain(self.ends[..self.n_ends].iter().map(|e| &e.1)).all(|&x| x == 0.0 || x == 1.0 || x == -1.0));
    }
    /// Whether the demand vectors are compact (u16 proj).
    pub(super) fn compact(&self) -> bool {
        self.add.or(self.sub).is_some_and(|r| r.compact())
    }
    /// Which demand vectors the kernel reads: both (0), `add` only (1), `sub` only (2),
    /// none (3).
    pub(super) fn sources(&self) -> u8 {
        match (self.add.is_some(), self.sub.is_some()) {
            (true, true) => 0,
            (true, false) => 1,
            (false, true) => 2,
            (false, false) => 3,
        }
    }
}
