//! Property tests of `validate_plan`: random valid plans (redundant copies, replicas,
//! migration) are accepted, and each kind of corruption is rejected as a plan error (a
//! migration row repeated, or a second row into the same slot, included); derived placement
//! tables that disagree with phy2log are refused naming the entry.

mod common;

use common::{cell_tokens, is_plan_error, random_plan, topologies, window, Mix};
use proptest::prelude::*;
use routepack_core::cost::CostModel;
use routepack_core::simulate::simulate;
use routepack_core::validate::{validate_placement_tables, validate_plan};

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_plans_validate_and_corruptions_are_rejected(
        topo in topologies(),
        seed in any::<u64>(),
        micro in 1usize..3,
        extra in 0usize..10,
        kind in 0usize..16,
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
            14 | 15 => {
                // a slot filled twice: the same row again, or a second move into its slot
                if bad.migration.is_empty() {
                    return Ok(());
                }
                let i = mix.below(bad.migration.len());
                let mut twin = bad.migration[i];
                if kind == 15 {
                    twin.bytes += 1.0;
                    twin.src_slot = mix.below(bad.placement.num_slots) as i32;
                    twin.src_rank = (twin.src_slot as usize / topo.slots_per_rank) as i32;
                }
                let at = mix.below(bad.migration.len() + 1);
                bad.migration.insert(at, twin);
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
        if kind >= 14 {
            let msg = r.unwrap_err().to_string();
            prop_assert!(msg.contains("migration row") && msg.contains("again"), "{}", msg);
        }
        if kind != 6 {
            prop_assert!(simulate(&bad, &view, &topo, &CostModel::for_tests(layers), None).is_err());
        }
    }

    #[test]
    fn derived_tables_must_be_what_phy2log_gives(topo in topologies(), seed in any::<u64>(), which in 0usize..2) {
        let mut mix = Mix(seed);
        let layers = 1 + mix.below(3);
        let experts = 1 + mix.below(topo.num_slots());
        let w = window(&mut mix, topo.dp + 3, layers, experts, 60);
        let plan = random_plan(&mut mix, &w, &topo, 1);
        let p = &plan.placement;
        let (mut cnt, (mut l2p, r)) = (p.logcnt(), p.log2phy().unwrap());
        prop_assert!(validate_placement_tables(p, &cnt, &l2p, r).is_ok());
        let name = if which == 0 {
            let i = mix.below(cnt.len());
            cnt[i] += 1;
            "placement.logcnt["
        } else {
            let i = mix.below(l2p.len());
            l2p[i] = if l2p[i] == 0 { 1 } else { 0 };
            "placement.log2phy["
        };
        match validate_placement_tables(p, &cnt, &l2p, r) {
            Err(e) => prop_assert!(is_plan_error(&Err(e.clone())) && e.to_string().contains(name), "{}", e),
            Ok(()) => return Err(TestCaseError::fail("edited table accepted")),
        }
    }
}
