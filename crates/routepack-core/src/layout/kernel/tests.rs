//! The kernel against `simulate`'s formula, bit for bit, on the scalar and (where the CPU has it) the AVX2 build.

use super::inputs::{R_IN, S_EX, S_IN, TOK, X_IN};
use super::*;
use crate::cpu::Avx2;

/// Per (layer, rank) received, received from the node (incl. itself), sent, sent to the
/// node (incl. itself) and sent to itself: whole numbers with same ≤ tok, diag ≤ onode ≤
/// otot, diag ≤ same.
fn raw(layers: usize, ep: usize, seed: usize) -> Vec<[f32; 5]> {
    (0..layers * ep)
        .map(|i| {
            let v = |k: usize| ((i * 37 + seed * 11 + k * 53) % 97) as f32;
            let diag = v(0);
            let same = diag + v(1) * 3.0;
            let tok = same + v(2) * 5.0;
            let onode = diag + v(3) * 3.0;
            let otot = onode + v(4) * 5.0;
            [tok, same, otot, onode, diag]
        })
        .collect()
}

/// The kernel's state of `raw` values (zeros in the padding lanes).
fn state(raw: &[[f32; 5]], s: Shape) -> Vec<f32> {
    let mut st = vec![0f32; s.state_len()];
    for l in 0..s.layers {
        for p in 0..s.ep {
            let [tok, same, otot, onode, diag] = raw[l * s.ep + p];
            for (value, v) in [(TOK, tok), (R_IN, same - diag), (X_IN, tok - same), (S_IN, onode - diag), (S_EX, otot - onode)] {
                st[s.state_at(value, l, p)] = v;
            }
        }
    }
    st
}

/// A demand vector of whole numbers, otot and onode consistent with proj.
fn demand(s: Shape, seed: usize) -> Vec<f32> {
    let mut d = vec![0f32; s.demand_len()];
    let rpn = s.ep / s.nodes;
    for l in 0..s.layers {
        for p in 0..s.ep {
            let v = ((l * 31 + p * 7 + seed * 13) % 23) as f32;
            d[s.proj_at(l, p)] = v;
            d[s.otot_at(l)] += v;
            d[s.onode_at(l, p / rpn)] += v;
        }
    }
    d
}

fn hexp(s: Shape, uniform: bool) -> (Vec<f32>, Vec<f32>) {
    let mut per_rank = vec![0f32; s.hexp_len()];
    let mut per_layer = vec![0f32; s.blocks * LANES];
    for l in 0..s.layers {
        per_layer[l] = 0.01 * (l % 5) as f32;
        for p in 0..s.ep {
            per_rank[s.proj_at(l, p)] = if uniform { per_layer[l] } else { 0.01 * ((l + p) % 5) as f32 };
        }
    }
    (per_rank, per_layer)
}

/// `simulate`'s formula on the raw values after the move, one (layer, rank) at a time.
fn formula(raw: &[[f32; 5]], h: &[f32], d: &StepDelta, c: Coeffs, s: Shape) -> (f64, Vec<[f32; 5]>) {
    let rpn = s.ep / s.nodes;
    let zero = vec![0f32; s.demand_len()];
    let full = |r: Option<Demand>| match r {
        None => zero.clone(),
        Some(Demand::F32(x)) => x.to_vec(),
        Some(Demand::U16 { proj, tail }) => proj[..s.proj_len()].iter().map(|&v| v as f32).chain(tail.iter().copied()).collect(),
    };
    let (fa, fs) = (full(d.add), full(d.sub));
    let d = WithZeros { add: &fa, sub: &fs, d };
    let mut cost = 0.0f64;
    let mut after = raw.to_vec();
    for l in 0..s.layers {
        let (mut em, mut am) = (0f32, 0f32);
        let ot = d.add[s.otot_at(l)] - d.sub[s.otot_at(l)];
        for p in 0..s.ep {
            let r = d.add[s.proj_at(l, p)] - d.sub[s.proj_at(l, p)];
            let cm: f32 = d.ends[..d.n_ends].iter().filter(|e| e.0 / rpn == p / rpn).map(|e| e.1).sum();
            let [mut tok, mut same, mut otot, mut onode, mut diag] = raw[l * s.ep + p];
            tok += d.ts * r;
            same += cm * r;
            if let Some(&(_, sign)) = d.ends[..d.n_ends].iter().find(|e| e.0 == p) {
                let on = d.add[s.onode_at(l, p / rpn)] - d.sub[s.onode_at(l, p / rpn)];
                otot += sign * ot;
                onode += sign * on;
                diag += sign * r;
            }
            after[l * s.ep + p] = [tok, same, otot, onode, diag];
            em = em.max(c.ct * tok + h[s.proj_at(l, p)]);
            am = am.max(c.ki * (onode.max(same) - diag) + c.ke * (otot - onode).max(tok - same));
        }
        cost += (em + am) as f64;
    }
    (cost, after)
}

/// A move's demand vectors with zeros for missing ones (for `formula`).
struct WithZeros<'a> {
    add: &'a [f32],
    sub: &'a [f32],
    d: &'a StepDelta<'a>,
}

impl<'a> std::ops::Deref for WithZeros<'a> {
    type Target = StepDelta<'a>;
    fn deref(&self) -> &StepDelta<'a> {
        self.d
    }
}

#[test]
fn kernel_matches_the_formula_on_both_builds() {
    let c = Coeffs { ct: 1e-3, ki: 2e-4, ke: 3e-3 };
    for (layers, ep, nodes) in [(3usize, 1usize, 1usize), (9, 7, 7), (8, 8, 2), (5, 13, 1), (17, 16, 1), (11, 12, 3), (32, 32, 4)] {
        let s = Shape::new(layers, ep, nodes);
        let raw = raw(layers, ep, layers + ep);
        let st = state(&raw, s);
        let (ra, rs) = (demand(s, 2), demand(s, 5));
        let two = ep > 1;
        let deltas = [
            StepDelta { add: Some(Demand::F32(&ra)), sub: Some(Demand::F32(&rs)), ts: 1.0, ends: [(ep / 2, 1.0), (0, 0.0)], n_ends: 1 },
            StepDelta { add: Some(Demand::F32(&ra)), sub: None, ts: -1.0, ends: [(ep - 1, -1.0), (0, 0.0)], n_ends: 1 },
            StepDelta { add: None, sub: Some(Demand::F32(&rs)), ts: 1.0, ends: [(0, 1.0), (0, 0.0)], n_ends: 1 },
            StepDelta {
                add: Some(Demand::F32(&ra)),
                sub: Some(Demand::F32(&rs)),
                ts: 0.0,
                ends: [(ep - 1, 1.0), (0, -1.0)],
                n_ends: if two { 2 } else { 0 },
            },
            StepDelta {
                add: Some(Demand::F32(&ra)),
                sub: Some(Demand::F32(&rs)),
                ts: 0.0,
                ends: [(0, 1.0), (ep - 1, -1.0)],
                n_ends: if two { 2 } else { 0 },
            },
            StepDelta { add: None, sub: None, ts: 0.0, ends: [(0, 0.0); 2], n_ends: 0 },
        ];
        for uniform in [false, true] {
            let (per_rank, per_layer) = hexp(s, uniform);
            let hosted = Hosted { per_rank: &per_rank, per_layer: uniform.then_some(&per_layer[..]) };
            for d in &deltas {
                let (want, after) = formula(&raw, &per_rank, d, c, s);
                let mut got = Vec::new();
                for avx2 in [None, Avx2::detect()] {
                    let x = gm_cost(&st, &hosted, d, c, s, avx2);
                    assert_eq!(x.to_bits(), want.to_bits(), "layers {layers} ep {ep} avx2 {avx2:?}");
                    let mut r1 = st.clone();
                    gm_apply(&mut r1, &hosted, d, c, s, avx2);
                    assert_eq!(r1, state(&after, s), "layers {layers} ep {ep} avx2 {avx2:?}");
                    got.push(r1);
                }
                assert_eq!(got[0], got[1]);
            }
            // a move between two microbatches, priced and applied in one pass
            let state_b = state(&raw.iter().rev().copied().collect::<Vec<_>>(), s);
            let compact = |r: &[f32]| (r[..s.proj_len()].iter().map(|&v| v as u16).collect::<Vec<u16>>(), r[s.proj_len()..].to_vec());
            let ((pa, ta), (ps, tsl)) = (compact(&ra), compact(&rs));
            let (ca, cs) = (Demand::U16 { proj: &pa, tail: &ta }, Demand::U16 { proj: &ps, tail: &tsl });
            let (fa, fs) = (Demand::F32(&ra), Demand::F32(&rs));
            for (add, sub) in
                [(Some(fa), Some(fs)), (None, Some(fs)), (Some(fa), None), (Some(ca), Some(cs)), (None, Some(cs)), (Some(ca), None)]
            {
                let da = StepDelta { add, sub, ts: 1.0, ends: [(ep / 3, 1.0), (0, 0.0)], n_ends: 1 };
                let db = StepDelta { add, sub, ts: -1.0, ends: [(ep - 1 - ep / 3, -1.0), (0, 0.0)], n_ends: 1 };
                let (want_a, _) = formula(&raw, &per_rank, &da, c, s);
                for avx2 in [None, Avx2::detect()] {
                    assert_eq!(gm_cost(&st, &hosted, &da, c, s, avx2).to_bits(), want_a.to_bits());
                    let (x, y) = gm_cost_pair(&st, &state_b, &hosted, &da, &db, c, s, avx2);
                    assert_eq!(x.to_bits(), gm_cost(&st, &hosted, &da, c, s, avx2).to_bits());
                    assert_eq!(y.to_bits(), gm_cost(&state_b, &hosted, &db, c, s, avx2).to_bits());
                    let (mut a1, mut b1, mut a2, mut b2) = (st.clone(), state_b.clone(), st.clone(), state_b.clone());
                    gm_apply_pair(&mut a1, &mut b1, &hosted, &da, &db, c, s, avx2);
                    gm_apply(&mut a2, &hosted, &da, c, s, avx2);
                    gm_apply(&mut b2, &hosted, &db, c, s, avx2);
                    assert_eq!((a1, b1), (a2, b2));
                }
            }
        }
    }
}
