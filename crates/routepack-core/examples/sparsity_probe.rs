use rand::SeedableRng;
use rand_xoshiro::Xoshiro256PlusPlus;
use routepack_core::layout::chain::{Chain, MoveMix};
use routepack_core::layout::kernel::{R_IN, S_EX, S_IN, TOK, X_IN};
use routepack_core::layout::{init, Proxy};
use routepack_core::packing::certified::certified_rows;
use routepack_core::placement::static_placement;
use routepack_core::{Topology, WindowView};
#[path = "../benches/support/mod.rs"]
mod support;
use support::{flash_window, FLASH_CAP, FLASH_E, FLASH_L};
fn main() {
    let (lens, tok) = flash_window(1);
    let topo = Topology::new(64, 32, 8, 17).unwrap();
    let cost = support::flash_cost(FLASH_L);
    let w = WindowView::new(&lens, &tok, FLASH_L, FLASH_E).unwrap();
    let pl = static_placement(FLASH_L, FLASH_E, &topo).unwrap();
    let rows = certified_rows(&lens, FLASH_CAP, topo.dp, 200_000, None).unwrap();
    let micro = rows.rows.len() / topo.dp;
    let px = Proxy::new(&w, &topo, &cost, &pl, FLASH_CAP, micro, 0.1).unwrap();
    let start = init::worst_fit(&px).unwrap_or_else(|| init::from_rows(&px, &rows.rows));
    let mut ch = Chain::new(&px, &start, Xoshiro256PlusPlus::seed_from_u64(0), MoveMix::default());
    ch.run(&px, 300_000, 2e-3, None);
    let s = px.shape;
    let (l_n, ep) = (px.num_layers, px.ep);
    // per layer: distribution of max_p proj over samples
    let mut q = vec![];
    for l in 0..l_n {
        let mut m: Vec<f32> = (0..px.num_samples).map(|smp| (0..ep).map(|p| px.demand[smp * px.row_len() + s.proj_at(l, p)]).fold(0.0, f32::max)).collect();
        m.sort_by(|a, b| a.partial_cmp(b).unwrap());
        q.push((m[m.len() / 2], m[m.len() * 95 / 100], m[m.len() - 1]));
    }
    println!("layer 0: max_p proj over samples: median {} p95 {} max {}", q[0].0, q[0].1, q[0].2);
    let len = s.state_len();
    for frac in [0.5f32, 0.95, 1.0] {
        let (mut cand_c, mut cand_a, mut cand_u, mut tot) = (0usize, 0usize, 0usize, 0usize);
        for gm in 0..px.groups * px.micro {
            let st = &ch.sh.gm[gm * len..(gm + 1) * len];
            for l in 0..l_n {
                let d = match frac { x if x < 0.9 => q[l].0, x if x < 0.99 => q[l].1, _ => q[l].2 };
                let tokv: Vec<f32> = (0..ep).map(|p| st[s.state_at(TOK, l, p)]).collect();
                let a2a: Vec<f32> = (0..ep).map(|p| px.ki * st[s.state_at(S_IN, l, p)].max(st[s.state_at(R_IN, l, p)]) + px.ke * st[s.state_at(S_EX, l, p)].max(st[s.state_at(X_IN, l, p)])).collect();
                let mt = tokv.iter().cloned().fold(0.0, f32::max);
                let ma = a2a.iter().cloned().fold(0.0, f32::max);
                for p in 0..ep {
                    let c = tokv[p] >= mt - 2.0 * d;
                    let a = a2a[p] >= ma - 2.0 * (px.ki + px.ke) * d;
                    cand_c += c as usize; cand_a += a as usize; cand_u += (c || a) as usize; tot += 1;
                }
            }
        }
        println!("margin from {frac}: candidates compute {:.1}% a2a {:.1}% union {:.1}%", 100.0 * cand_c as f64 / tot as f64, 100.0 * cand_a as f64 / tot as f64, 100.0 * cand_u as f64 / tot as f64);
    }
    // union over the 8 layers of a chunk (what a rank-level skip can use)
    println!("mean tok layer0 gm0 {}", (0..ep).map(|p| ch.sh.gm[s.state_at(TOK, 0, p)]).sum::<f32>() / ep as f32);
}
