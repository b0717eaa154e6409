//! Property tests of the one checked request (`routepack_core::request`): on random windows,
//! topologies, cost models and caps with at most one fault, `PlanRequest::new` refuses every
//! faulty request naming the faulty argument, accepts every other, and the stages that take an
//! accepted request (routepack's packing, the baselines, validation and the simulator) plan it
//! without an argument error; the entries that take the parts give the request's verdict.

use proptest::prelude::*;
use routepack_core::error::Error;
use routepack_core::oversize::Oversize;
use routepack_core::packing::cells::Cells;
use routepack_core::packing::kk::verl_kk_of;
use routepack_core::packing::routepack::{routepack_packing_in, Options};
use routepack_core::packing::sequential::{sequential_in, sequential_of};
use routepack_core::packing::Packing;
use routepack_core::placement::static_placement;
use routepack_core::plan::ReplicaTiming;
use routepack_core::simulate::simulate_request;
use routepack_core::{CostModel, Plan, PlanRequest, Topology, WindowView};

const L: usize = 2;
const E: usize = 8;

/// The one fault a case carries, and the argument its error names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// token_cap <= 0.
    CapBelowOne,
    /// A sample over the cap, refused.
    OverCap,
    /// A sample over cp x cap, split.
    OverSplit,
    /// oversize="split" on a topology without CP groups.
    NoCpGroup,
    /// A cost model for another layer count.
    CostLayers,
    /// A negative cost coefficient.
    CostNegative,
    /// Fewer slots than experts.
    FewSlots,
}

const FAULTS: [Fault; 8] = [
    Fault::None,
    Fault::CapBelowOne,
    Fault::OverCap,
    Fault::OverSplit,
    Fault::NoCpGroup,
    Fault::CostLayers,
    Fault::CostNegative,
    Fault::FewSlots,
];

#[derive(Clone, Debug)]
struct Case {
    lens: Vec<i64>,
    tok: Vec<i32>,
    cap: i64,
    oversize: Oversize,
    topo: Topology,
    cost: CostModel,
    fault: Fault,
}

impl Case {
    /// What the request's error must name (its start), None where it must be accepted.
    fn names(&self) -> Option<&'static str> {
        match self.fault {
            Fault::None => None,
            Fault::CapBelowOne => Some("token_cap: must be >= 1"),
            Fault::OverCap => Some("infeasible: sample"),
            Fault::OverSplit => Some("infeasible: sample"),
            Fault::NoCpGroup => Some("topo.cp: "),
            Fault::CostLayers => Some("cost.a_quad: "),
            Fault::CostNegative => Some("cost.c_tok: must be finite and >= 0"),
            Fault::FewSlots => Some("topo: ep*slots_per_rank"),
        }
    }
}

/// 8-20 samples of 1..=cap tokens, some over the cap where the mode allows it (up to cp x cap),
/// 2 tokens a token routed by a per-sample hash; then one fault.
fn case() -> impl Strategy<Value = Case> {
    (0..FAULTS.len(), 8i64..60, 8usize..20, 0usize..3, prop::collection::vec(any::<u32>(), 20)).prop_map(|(f, cap, n, mode, raw)| {
        let fault = FAULTS[f];
        let mut oversize = [Oversize::Refuse, Oversize::Alone, Oversize::Split][mode];
        match fault {
            Fault::OverCap => oversize = Oversize::Refuse,
            Fault::OverSplit | Fault::NoCpGroup => oversize = Oversize::Split,
            _ => {}
        }
        let cp = if fault == Fault::NoCpGroup { 1 } else { 2 };
        let mut lens: Vec<i64> = raw[..n].iter().map(|&x| 1 + x as i64 % cap).collect();
        if oversize != Oversize::Refuse {
            // a sample over the cap that its mode holds: at most cp x cap
            lens[raw[0] as usize % n] = cap + 1 + raw[1] as i64 % cap;
        }
        match fault {
            Fault::OverCap => lens[raw[2] as usize % n] = cap + 1 + raw[3] as i64 % 100,
            Fault::OverSplit => lens[raw[2] as usize % n] = 2 * cap + 1 + raw[3] as i64 % 100,
            _ => {}
        }
        let mut tok = vec![0i32; lens.len() * L * E];
        for (s, &len) in lens.iter().enumerate() {
            for l in 0..L {
                let mut h = (raw[s] as u64 | 1) ^ ((l as u64 + 1) << 40);
                for _ in 0..2 * len {
                    h ^= h << 13;
                    h ^= h >> 7;
                    h ^= h << 17;
                    tok[(s * L + l) * E + (h % E as u64) as usize] += 1;
                }
            }
        }
        let slots = if fault == Fault::FewSlots { 3 } else { 4 };
        let topo = Topology::new(4, 2, 2, slots).unwrap().with_cp(cp).unwrap();
        let mut cost = CostModel::for_tests(if fault == Fault::CostLayers { L + 1 } else { L });
        if fault == Fault::CostNegative {
            cost.c_tok = -1.0;
        }
        let cap = if fault == Fault::CapBelowOne { -(raw[4] as i64 % 3) } else { cap };
        Case { lens, tok, cap, oversize, topo, cost, fault }
    })
}

fn plan_of(c: &Case, p: &Packing) -> Plan {
    Plan {
        placement: static_placement(L, E, &c.topo).unwrap(),
        sample_rank: p.sample_rank.clone(),
        sample_micro: p.sample_micro.clone(),
        num_micro: p.num_micro,
        replicas: vec![],
        migration: vec![],
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn a_faulty_request_is_refused_by_its_one_check_and_an_accepted_one_plans(c in case()) {
        let w = WindowView::new(&c.lens, &c.tok, L, E).unwrap();
        let req = PlanRequest::new(w, &c.topo, &c.cost, c.cap, c.oversize);
        match (c.names(), &req) {
            (Some(name), Err(e)) => prop_assert!(e.to_string().starts_with(name), "{:?}: {e}", c.fault),
            (Some(_), Ok(_)) => prop_assert!(false, "{:?} accepted", c.fault),
            (None, Err(e)) => prop_assert!(false, "a valid request refused: {e}"),
            (None, Ok(req)) => {
                let pl = static_placement(L, E, &c.topo).unwrap();
                let mut o = Options::default();
                o.anneal.moves = 500;
                let (p, _) = routepack_packing_in(req, &pl, &o).unwrap();
                simulate_request(&plan_of(&c, &p), req, None, ReplicaTiming::Prefetched).unwrap();
                // a baseline may find no rows for the cells (Infeasible), never an argument error
                for packed in [sequential_of(req).map(|x| x.0), verl_kk_of(req).map(|x| x.0)] {
                    match packed {
                        Ok(p) => { simulate_request(&plan_of(&c, &p), req, None, ReplicaTiming::Prefetched).unwrap(); }
                        Err(e) => prop_assert!(matches!(e, Error::Infeasible(_)), "{e}"),
                    }
                }
            }
        }
        // the entry that takes the lengths alone gives the request's verdict on them
        if matches!(c.fault, Fault::None | Fault::CapBelowOne | Fault::OverCap | Fault::OverSplit | Fault::NoCpGroup) {
            let seq = sequential_in(&c.lens, c.cap, &Cells::of(&c.topo, c.oversize));
            match (&req, seq) {
                (Err(a), Err(b)) => prop_assert_eq!(a.to_string(), b.to_string()),
                (Ok(_), Err(b)) => prop_assert!(matches!(b, Error::Infeasible(_)), "{b}"),
                (Ok(_), Ok(_)) => {}
                (Err(a), Ok(_)) => prop_assert!(false, "the entry accepted what the request refused: {a}"),
            }
        }
    }
}
