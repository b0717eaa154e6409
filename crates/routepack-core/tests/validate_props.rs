//! Property tests of `validate_plan`: random valid plans (redundant copies, replicas,
//! migration) are accepted, and each kind of corruption is rejected as a plan error.

mod common;

use common::{cell_tokens, is_plan_error, random_plan, topologies, window, Mix};
use proptest::prelude::*;
use routepack_core::cost::CostModel;
use routepack_core::simulate::simulate;
use routepack_core::validate::validate_plan;

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_plans_validate_and_corruptions_are_rejected(
        topo in topologies(),
        seed in any::<u64>(),
        micro in 1usize..3,
        extra in 0usize..10,
        kind in 0usize..14,
    ) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(3);
        let experts = 1 + mix.below(topo.num_slots());
        let w = window(&mut mix, topo.dp * micro + extra, layers, experts, 60);
        let view = w.view();
        let plan = random_plan(&mut mix, &w, &topo, micro);
        let cap = *cell_tokens(&plan, &w.seq_lens, topo.dp).iter().max().unwrap();
        let ok = validate_plan(&plan, &view, &topo, cap);
        prop_assert!(ok.is_ok(), "{:?}", ok);
        prop_assert!(simulate(&plan, &view, &topo, &CostModel::for_tests(layers), None).is_ok());

        let mut bad = plan.clone();
        let mut bad_cap = cap;
        let s = mix.below(w.seq_lens.len());
        match kind {
            0 => bad.sample_rank[s] = topo.dp as i32,
            1 => bad.sample_rank[s] = -1,
            2 => bad.sample_micro[s] = micro as i32,
            3 => bad.sample_micro[s] = -1,
            4 => bad.num_micro += 1,                     // a step with empty cells
            5 => { bad.sample_rank.pop(); }              // a sample missing
            6 => bad_cap = cap - 1,                       // the fullest cell is over the cap
            7..=11 => {
                if bad.replicas.is_empty() {
                    return Ok(());
                }
                let i = mix.below(bad.replicas.len());
                let spr = topo.slots_per_rank;
                let r = bad.replicas[i];
                match kind {
                    7 => bad.replicas[i].share = [-0.5f32, 1.5, f32::NAN, f32::INFINITY][mix.below(4)],
                    8 => bad.replicas[i].dst_rank = r.src_rank,
                    9 => {
                        let hosts: Vec<usize> = bad.placement.layer(r.layer as usize).iter().enumerate()
                            .filter(|(_, &x)| x == r.expert).map(|(p, _)| p / spr).collect();
                        match (0..topo.ep).find(|q| !hosts.contains(q) && *q != r.dst_rank as usize) {
                            Some(q) => bad.replicas[i].src_rank = q as i32,
                            None => return Ok(()),
                        }
                    }
                    10 => {
                        let mut twin = r;
                        twin.share = 1.0;
                        bad.replicas[i].share = 0.5;
                        bad.replicas.push(twin);
                    }
                    _ => bad.replicas[i].group = topo.num_groups() as i32,
                }
            }
            12 => {
                if bad.migration.is_empty() || experts < 2 {
                    return Ok(());
                }
                let i = mix.below(bad.migration.len());
                bad.migration[i].expert = (bad.migration[i].expert + 1) % experts as i32;
            }
            _ => {
                if bad.migration.is_empty() {
                    return Ok(());
                }
                let i = mix.below(bad.migration.len());
                bad.migration[i].bytes = [-1.0, f64::NAN][mix.below(2)];
            }
        }
        let r = validate_plan(&bad, &view, &topo, bad_cap);
        prop_assert!(is_plan_error(&r), "kind {} accepted: {:?}", kind, r);
        if kind != 6 {
            prop_assert!(simulate(&bad, &view, &topo, &CostModel::for_tests(layers), None).is_err());
        }
    }
}
