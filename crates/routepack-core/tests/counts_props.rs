//! Property tests of the stored count types: one random window's counts held as int32, uint16
//! and uint8 give bit-identical results at every stage that reads the demand (loads and chunk
//! demand for placement, the routepack packing and layout, routepack replication, the
//! simulator with its lower bound, the flow's per-rank tokens, the ingestion check), and a
//! negative int32 count is refused by the view.

mod common;

use common::{random_phy2log, Mix};
use proptest::prelude::*;
use routepack_core::bound::lower_bound_time;
use routepack_core::flow::rank_tokens;
use routepack_core::ingest::check_expert_tokens;
use routepack_core::packing::routepack::{routepack_packing, Options};
use routepack_core::placement::demand::{chunk_demand, window_loads};
use routepack_core::replication::{self, Packed};
use routepack_core::simulate::{simulate_in, Scoring};
use routepack_core::{CostModel, Counts, Placement, Plan, Topology, WindowView};

/// (dp, ep, gpus_per_node, slots_per_rank).
const TOPOS: [(usize, usize, usize, usize); 3] = [(2, 2, 2, 4), (4, 2, 2, 3), (4, 4, 2, 2)];

/// Everything each stage computes from one view, as text: `{:?}` of an f64 is its shortest
/// round-tripping form, so equal text is equal bits.
fn stages(w: &WindowView, topo: &Topology, pl: &Placement, cap: i64, seed: u64) -> String {
    let cost = CostModel::for_tests(w.num_layers);
    let mut opts = Options::default();
    (opts.anneal.moves, opts.anneal.chains, opts.anneal.steps, opts.anneal.seed) = (2_000, 2, 3, seed);
    let mut out = format!("{:?}\n{:?}\n", window_loads(w), chunk_demand(w, 2));
    out += &format!(
        "{:?}\n{:?}\n",
        check_expert_tokens(w.seq_lens, w.expert_tokens, w.num_layers, w.num_experts, None),
        w.layer_expert_load()
    );
    // S >= 2·dp samples of at most cap / 2 tokens: always feasible
    let (packing, _) = routepack_packing(w, topo, &cost, pl, cap, &opts).unwrap();
    let packed = Packed { sample_rank: &packing.sample_rank, sample_micro: &packing.sample_micro, num_micro: packing.num_micro };
    let replicas = replication::routepack(w, topo, &cost, pl, packed, &Default::default()).unwrap();
    let plan = Plan {
        placement: pl.clone(),
        sample_rank: packing.sample_rank.clone(),
        sample_micro: packing.sample_micro.clone(),
        num_micro: packing.num_micro,
        replicas,
        migration: vec![],
    };
    out += &format!("{packing:?}\n{:?}\n", plan.replicas);
    out += &format!("{:?}\n", simulate_in(&plan, w, topo, &cost, &Scoring { token_cap: Some(cap), ..Scoring::default() }));
    out += &format!("{:?}\n{:?}\n", lower_bound_time(w, topo, &cost, Some(cap)), rank_tokens(&plan, w, topo));
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_stage_is_the_same_whatever_the_count_type(seed in any::<u64>(), t in 0..TOPOS.len(), per_rank in 2usize..5, layers in 1usize..4, experts in 4usize..12) {
        let (dp, ep, gpn, spr) = TOPOS[t];
        let topo = Topology::new(dp, ep, gpn, spr).unwrap();
        prop_assume!(experts <= topo.num_slots());
        let mut mix = Mix(seed);
        let s_n = dp * per_rank;
        // lengths up to 600 (so a sample may be longer than uint8 holds); counts up to 255
        let lens: Vec<i64> = (0..s_n).map(|_| 1 + mix.below(600) as i64).collect();
        let mut wide = vec![0i32; s_n * layers * experts];
        for (s, &n) in lens.iter().enumerate() {
            for x in &mut wide[s * layers * experts..(s + 1) * layers * experts] {
                if mix.unit() < 0.7 {
                    *x = mix.below(n.min(255) as usize + 1) as i32;
                }
            }
        }
        let mid: Vec<u16> = wide.iter().map(|&x| x as u16).collect();
        let narrow: Vec<u8> = wide.iter().map(|&x| x as u8).collect();
        let pl = Placement::new(random_phy2log(&mut mix, layers, experts, &topo), layers, experts, spr).unwrap();
        let cap = 2 * lens.iter().max().unwrap();
        let of = |c: Counts| stages(&WindowView::new(&lens, c, layers, experts).unwrap(), &topo, &pl, cap, seed);
        let want = of(Counts::I32(&wide));
        prop_assert_eq!(&of(Counts::U16(&mid)), &want);
        prop_assert_eq!(&of(Counts::U8(&narrow)), &want);
    }

    #[test]
    fn only_int32_can_be_negative(s_n in 1usize..5, e in 1usize..6, at in any::<prop::sample::Index>()) {
        let lens = vec![5i64; s_n];
        let mut c = vec![1i32; s_n * e];
        let i = at.index(c.len());
        c[i] = -1;
        let err = WindowView::new(&lens, &c, 1, e).unwrap_err().to_string();
        prop_assert!(err.contains(&format!("negative count -1 at sample {}, layer 0, expert {}", i / e, i % e)), "{}", err);
        let u: Vec<u16> = vec![1; s_n * e];
        prop_assert!(WindowView::new(&lens, &u, 1, e).is_ok());
    }
}
