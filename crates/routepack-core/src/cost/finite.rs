//! A cost model whose step time cannot overflow.
//!
//! Every coefficient is finite on its own ([`CostModel::check`]), but a finite coefficient can
//! still price one unit of work at more than an `f64` holds (`c_migrate = 1.7e308` seconds a
//! byte times the 42 MB of one expert's state is `inf`), or a window's many units at more: the
//! step time, and with it every comparison the planner makes, is then `inf`. So each unit a
//! step counts is priced here in seconds (a token, a token pair of quadratic attention, one
//! expert's call, one all-to-all, one expert's weights or gradient on a link or a replica hop,
//! one expert's state migrated) and refused, naming the coefficient, above
//! [`MAX_UNIT_SECONDS`]: a step counts at most 2^160 of any unit (the largest is quadratic
//! attention's token pairs, `Σ n² ≤ 2^126` over a window's samples, times at most 2^31 layers)
//! and adds at most 16 such terms, so below it every step time is finite.

use crate::error::{invalid, Result};

use super::CostModel;

/// Most seconds one unit of a step's work may cost: `f64::MAX / 2^164` (about 1.1e259), so
/// 2^160 units of each of 16 terms still add up to a finite step.
pub const MAX_UNIT_SECONDS: f64 = f64::MAX / 2.3384026197294447e49;

/// Refuses a coefficient whose unit of work costs more than [`MAX_UNIT_SECONDS`] (naming the
/// coefficient, the unit and its price), so that no step the core prices is infinite.
pub(super) fn check_finite_step(c: &CostModel) -> Result<()> {
    // bandwidths are > 0 and finite here (`check` ran first); the slowest link prices a byte
    let mut links = vec![("cost.bw_intra", c.bw_intra), ("cost.bw_inter", c.bw_inter)];
    if c.bw_reduce > 0.0 {
        links.push(("cost.bw_reduce", c.bw_reduce));
    }
    let (slowest, bw) = links.into_iter().fold(("cost.bw_intra", f64::INFINITY), |a, b| if b.1 < a.1 { b } else { a });
    let per_byte = 1.0 / bw;
    let expert_bytes = c.expert_weight_bytes.max(c.expert_grad_bytes);
    let units: [(&str, &str, f64); 18] = [
        ("cost.a_lin", "a token's attention", c.a_lin),
        ("cost.c_tok", "a routed token", c.c_tok),
        ("cost.c_exp", "an active expert", c.c_exp),
        ("cost.c_weights", "an active expert's floor", c.c_weights),
        ("cost.c_gemm", "an expert's GEMM step", c.c_gemm),
        ("cost.c_call", "a rank's kernel call", c.c_call),
        ("cost.a2a_latency", "an all-to-all", c.a2a_latency),
        ("cost.reduce_latency", "an all-reduce", c.reduce_latency),
        ("cost.migration_latency", "a window's migration", c.migration_latency),
        ("cost.token_bytes", "a routed token's size", c.token_bytes),
        ("cost.expert_weight_bytes", "one expert's weights' size", c.expert_weight_bytes),
        ("cost.expert_grad_bytes", "one expert's gradient's size", c.expert_grad_bytes),
        ("cost.expert_state_bytes", "one expert's state's size", c.expert_state_bytes),
        (slowest, "a byte on the slowest link", per_byte),
        ("cost.token_bytes", "a routed token on the slowest link", c.token_bytes * per_byte),
        ("cost.expert_state_bytes", "an expert's state on the slowest link", c.expert_state_bytes * per_byte),
        ("cost.c_replica", "a replica hop of one expert's weights or gradient", c.c_replica * expert_bytes),
        ("cost.c_migrate", "one expert's state migrated", c.c_migrate * c.expert_state_bytes),
    ];
    let weights = if c.expert_weight_bytes >= c.expert_grad_bytes { "cost.expert_weight_bytes" } else { "cost.expert_grad_bytes" };
    let on_link = [(weights, "an expert's weights or gradient on the slowest link", expert_bytes * per_byte)];
    for (name, unit, v) in units.into_iter().chain(on_link) {
        if v.is_nan() || v > MAX_UNIT_SECONDS {
            return Err(invalid(name, too_dear(unit, v)));
        }
    }
    for (l, &v) in c.a_quad.iter().enumerate() {
        if v.is_nan() || v > MAX_UNIT_SECONDS {
            return Err(invalid(format!("cost.a_quad[{l}]"), too_dear("a token pair of quadratic attention", v)));
        }
    }
    for (i, &(_, v)) in c.expert_table.iter().enumerate() {
        if v.is_nan() || v > MAX_UNIT_SECONDS {
            return Err(invalid(format!("cost.expert_table[{i}]"), too_dear("an active expert", v)));
        }
    }
    Ok(())
}

fn too_dear(unit: &str, v: f64) -> String {
    // sizes (bytes) are bounded alike: a step adds up to 2^160 of them before dividing by a bandwidth
    let measure = if unit.ends_with("size") { "bytes" } else { "s" };
    format!(
        "puts {unit} at {v:e} {measure}, over the {MAX_UNIT_SECONDS:.3e} one unit may take: a step counts up to 2^160 \
         units, so its time could not be finite"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_per_byte_coefficient_is_refused_naming_it() {
        for (field, set) in [
            ("cost.c_migrate", (|c: &mut CostModel| c.c_migrate = 1.7e308) as fn(&mut CostModel)),
            ("cost.c_replica", |c: &mut CostModel| c.c_replica = 1.7e308),
            ("cost.c_tok", |c: &mut CostModel| c.c_tok = 1e300),
            ("cost.a_quad[0]", |c: &mut CostModel| c.a_quad[0] = 1e300),
            ("cost.bw_inter", |c: &mut CostModel| c.bw_inter = 1e-300),
        ] {
            let mut c = CostModel::for_tests(4);
            set(&mut c);
            let e = c.check(4).unwrap_err().to_string();
            assert!(e.starts_with(field), "{field}: {e}");
            assert!(e.contains("could not be finite"), "{e}");
        }
    }

    #[test]
    fn ordinary_and_large_but_safe_coefficients_pass() {
        let mut c = CostModel::for_tests(4);
        c.check(4).unwrap();
        c.c_migrate = 1e200;
        c.c_tok = 1e250;
        c.check(4).unwrap();
        assert!((MAX_UNIT_SECONDS * 2f64.powi(164) / f64::MAX - 1.0).abs() < 1e-12);
    }
}
