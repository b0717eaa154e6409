//! routepack's packing end to end: feasible plans, the proxy against `simulate`, determinism.

use rand::SeedableRng;

use super::*;
use crate::layout::chain::Chain;
use crate::packing::rows::certified::certified_rows;
use crate::placement::static_placement;
use crate::plan::Plan;
use crate::simulate::simulate;
use crate::validate::validate_plan;

fn window(s_n: usize, l_n: usize, e_n: usize, seed: u64) -> (Vec<i64>, Vec<i32>) {
    use rand::RngExt;
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let lens: Vec<i64> = (0..s_n).map(|_| rng.random_range(20..1500i64)).collect();
    let mut tok = vec![0i32; s_n * l_n * e_n];
    for s in 0..s_n {
        let hot = rng.random_range(0..e_n);
        for l in 0..l_n {
            for _ in 0..lens[s] * 2 {
                let e = if rng.random_range(0..3) == 0 { hot } else { rng.random_range(0..e_n) };
                tok[(s * l_n + l) * e_n + e] += 1;
            }
        }
    }
    (lens, tok)
}

fn setup(s_n: usize) -> (Vec<i64>, Vec<i32>, Topology, CostModel) {
    let (lens, tok) = window(s_n, 4, 16, 11);
    (lens, tok, Topology::new(8, 4, 2, 5).unwrap(), CostModel::for_tests(4))
}

#[test]
fn chain_state_stays_exact_and_feasible() {
    let (lens, tok, topo, cost) = setup(96);
    let w = WindowView::new(&lens, &tok, 4, 16).unwrap();
    let pl = static_placement(4, 16, &topo).unwrap();
    let rows = certified_rows(&lens, 3000, 8, 1000, None).unwrap();
    let m_n = rows.rows.len() / 8;
    let px = Proxy::new(&w, &topo, &cost, &pl, 3000, m_n, 0.1).unwrap();
    let init = init::worst_fit(&px).unwrap_or_else(|| init::from_rows(&px, &rows.rows));
    let mix = Options::default().anneal.mix;
    let mut c = Chain::new(&px, &init, rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(1), mix);
    for round in 0..5 {
        c.run(&px, 2000, if round < 4 { 1e-4 } else { 0.0 }, None);
        assert!(c.consistent(&px), "incremental state drifted from a rebuild");
        let p = to_packing(&c.cell_of, m_n);
        let plan = Plan {
            placement: pl.clone(),
            sample_rank: p.sample_rank,
            sample_micro: p.sample_micro,
            num_micro: m_n,
            replicas: vec![],
            migration: vec![],
        };
        validate_plan(&plan, &w, &topo, 3000).unwrap();
    }
    assert!(c.accepted > 0 && c.evaluated > c.accepted);
}

#[test]
fn annealing_improves_and_the_proxy_tracks_simulate() {
    let (lens, tok, topo, cost) = setup(128);
    let w = WindowView::new(&lens, &tok, 4, 16).unwrap();
    let pl = static_placement(4, 16, &topo).unwrap();
    let mut opts = Options::default();
    opts.anneal.moves = 40_000;
    let (p, rep) = routepack_packing(&w, &topo, &cost, &pl, 4096, &opts).unwrap();
    assert!(rep.anneal.best_cost < rep.anneal.initial_cost);
    assert_eq!(rep.anneal.history.len(), rep.anneal.steps);
    let plan = Plan {
        placement: pl.clone(),
        sample_rank: p.sample_rank.clone(),
        sample_micro: p.sample_micro.clone(),
        num_micro: p.num_micro,
        replicas: vec![],
        migration: vec![],
    };
    validate_plan(&plan, &w, &topo, 4096).unwrap();
    let sim = simulate(&plan, &w, &topo, &cost, None).unwrap();
    let proxy = proxy_step_time(&w, &topo, &cost, &pl, &p).unwrap();
    assert!((sim.step_time - proxy).abs() / sim.step_time < 1e-3, "simulate {} proxy {proxy}", sim.step_time);
}

#[test]
fn same_plan_on_one_and_two_threads() {
    let (lens, tok, topo, cost) = setup(128);
    let w = WindowView::new(&lens, &tok, 4, 16).unwrap();
    let pl = static_placement(4, 16, &topo).unwrap();
    let mut opts = Options::default();
    opts.anneal.moves = 20_000;
    opts.anneal.seed = 5;
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| routepack_packing(&w, &topo, &cost, &pl, 4096, &opts).unwrap())
    };
    let (a, ra) = run(1);
    let (b, rb) = run(2);
    assert_eq!(a, b);
    assert_eq!(ra.anneal.history, rb.anneal.history);
    opts.anneal.seed = 6;
    let (c, _) = pool_free(&w, &topo, &cost, &pl, &opts);
    assert_ne!(a, c, "another seed should give another layout");
}

fn pool_free(w: &WindowView, topo: &Topology, cost: &CostModel, pl: &Placement, opts: &Options) -> (Packing, Report) {
    routepack_packing(w, topo, cost, pl, 4096, opts).unwrap()
}

/// Samples of zero cost weight (a cost model with no attention cost, a window with no expert
/// tokens) are placed like any other: every cell gets one, and the plan is valid.
#[test]
fn zero_weight_samples_are_placed() {
    let (s_n, l_n, e_n) = (40, 4, 16);
    let lens: Vec<i64> = (0..s_n).map(|s| 20 + 7 * s as i64).collect();
    let tok = vec![0i32; s_n * l_n * e_n];
    let topo = Topology::new(8, 4, 2, 5).unwrap();
    for zero_c_tok in [false, true] {
        let mut cost = CostModel::for_tests(l_n);
        cost.a_lin = 0.0;
        cost.a_quad = vec![0.0; l_n];
        if zero_c_tok {
            cost = CostModel { c_tok: 0.0, c_exp: 0.0, token_bytes: 0.0, ..cost };
        }
        let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
        let pl = static_placement(l_n, e_n, &topo).unwrap();
        let mut opts = Options::default();
        opts.anneal.moves = 5_000;
        let (p, _) = routepack_packing(&w, &topo, &cost, &pl, 600, &opts).unwrap();
        let plan = Plan {
            placement: pl.clone(),
            sample_rank: p.sample_rank,
            sample_micro: p.sample_micro,
            num_micro: p.num_micro,
            replicas: vec![],
            migration: vec![],
        };
        validate_plan(&plan, &w, &topo, 600).unwrap();
    }
}

/// Chain and temperature-step counts beyond the caps are refused, naming the option, before
/// anything is allocated (an allocation failure would abort the process).
#[test]
fn absurd_anneal_sizes_are_refused() {
    let (lens, tok, topo, cost) = setup(32);
    let w = WindowView::new(&lens, &tok, 4, 16).unwrap();
    let pl = static_placement(4, 16, &topo).unwrap();
    let cases: [(usize, usize, u64, &str); 3] = [
        (100_000_000, 24, u64::MAX, "anneal_chains"),
        (2, 1_000_000_000, u64::MAX, "anneal_steps"),
        (2, 1 << 62, u64::MAX, "anneal_steps"),
    ];
    for (chains, steps, moves, arg) in cases {
        let mut opts = Options::default();
        opts.anneal.chains = chains;
        opts.anneal.steps = steps;
        opts.anneal.moves = moves;
        let e = routepack_packing(&w, &topo, &cost, &pl, 4096, &opts).unwrap_err().to_string();
        assert!(e.contains(arg), "{arg}: {e}");
    }
    // at the caps the sizes are accepted (a small budget keeps it quick)
    let mut opts = Options::default();
    opts.anneal.chains = crate::layout::anneal::MAX_CHAINS;
    opts.anneal.steps = crate::layout::anneal::MAX_STEPS;
    opts.anneal.moves = 10_000;
    routepack_packing(&w, &topo, &cost, &pl, 4096, &opts).unwrap();
}

#[test]
fn default_moves_anneal_only_inside_one_node() {
    // ep 8: one node with 8 GPUs per node, two with 4, eight with 1
    let cases = [(8, DEFAULT_MOVES), (16, DEFAULT_MOVES), (4, DEFAULT_MOVES_ACROSS_NODES), (1, DEFAULT_MOVES_ACROSS_NODES)];
    for (gpus_per_node, want) in cases {
        let topo = Topology::new(16, 8, gpus_per_node, 4).unwrap();
        assert_eq!(default_moves(&topo), want, "gpus_per_node {gpus_per_node}");
    }
}
