//! A random test case of the replication planners: a window with skewed, topic-like expert
//! demand, a topology, a static or shuffled placement and a token cap (shared by
//! `replication::tests` and `replication::state::tests`).

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::packing::sequential::sequential;
use crate::placement::static_placement;
use crate::plan::Placement;
use crate::plan::{Plan, Replica};
use crate::topology::Topology;
use crate::window::WindowView;

/// A random window with skewed, topic-like expert demand, owned.
pub(super) struct Case {
    pub(super) seq_lens: Vec<i64>,
    pub(super) expert_tokens: Vec<i32>,
    pub(super) layers: usize,
    pub(super) experts: usize,
    pub(super) topo: Topology,
    pub(super) placement: Placement,
    pub(super) cap: i64,
}

impl Case {
    pub(super) fn new(seed: u64, shape: usize) -> Self {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        // (dp, ep, gpus_per_node, slots_per_rank, E)
        let shapes = [(8, 4, 2, 5, 16), (16, 8, 4, 3, 20), (8, 8, 8, 3, 16), (12, 4, 4, 4, 13)];
        let (dp, ep, gpn, spr, e_n) = shapes[shape % shapes.len()];
        let topo = Topology::new(dp, ep, gpn, spr).unwrap();
        let (layers, k) = (3usize, 2usize);
        let s_n = dp * rng.random_range(2..5usize);
        let cap = 400i64;
        let seq_lens: Vec<i64> = (0..s_n).map(|_| rng.random_range(1..=cap)).collect();
        let mut expert_tokens = vec![0i32; s_n * layers * e_n];
        for s in 0..s_n {
            let hot = rng.random_range(0..e_n);
            for l in 0..layers {
                let row = &mut expert_tokens[(s * layers + l) * e_n..(s * layers + l + 1) * e_n];
                for _ in 0..seq_lens[s] as usize * k {
                    // a third of the demand goes to the sample's hot expert
                    let e = if rng.random_range(0..3) == 0 { (hot + l) % e_n } else { rng.random_range(0..e_n) };
                    row[e] += 1;
                }
            }
        }
        // static, or a shuffled placement with a few redundant copies
        let placement = if rng.random_range(0..2) == 0 {
            static_placement(layers, e_n, &topo).unwrap()
        } else {
            let ns = topo.num_slots();
            let mut phy = Vec::with_capacity(layers * ns);
            for _ in 0..layers {
                let mut layer: Vec<i32> = (0..e_n as i32).collect();
                while layer.len() < ns {
                    layer.push(if rng.random_range(0..2) == 0 { rng.random_range(0..e_n as i32) } else { -1 });
                }
                for i in (1..ns).rev() {
                    layer.swap(i, rng.random_range(0..=i));
                }
                phy.extend(layer);
            }
            Placement::new(phy, layers, e_n, spr).unwrap()
        };
        Self { seq_lens, expert_tokens, layers, experts: e_n, topo, placement, cap }
    }

    pub(super) fn window(&self) -> WindowView<'_> {
        WindowView::new(&self.seq_lens, &self.expert_tokens, self.layers, self.experts).unwrap()
    }

    pub(super) fn plan(&self, replicas: Vec<Replica>) -> Plan {
        let p = sequential(&self.seq_lens, self.cap, self.topo.dp).unwrap();
        Plan {
            placement: self.placement.clone(),
            sample_rank: p.sample_rank,
            sample_micro: p.sample_micro,
            num_micro: p.num_micro,
            replicas,
            migration: Vec::new(),
        }
    }
}
