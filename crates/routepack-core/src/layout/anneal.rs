//! Parallel population annealing (Hukushima–Iba; Machta) over layouts.
//!
//! A population of chains starts from the same layout. At each temperature of a geometric
//! schedule every chain runs its share of the move budget (chains in parallel on rayon);
//! then the population is resampled: chain i gets weight exp(−(β_next − β)(E_i − E_min)) and
//! the next population is drawn by systematic resampling, so good layouts multiply and bad
//! ones die out. The start temperature is calibrated from the energy changes of random moves
//! at the initial layout.
//!
//! Determinism: chain i draws from Xoshiro256PlusPlus seeded by (seed, i) and keeps its
//! stream when it inherits another chain's layout; resampling and the best-so-far are
//! computed on the calling thread in index order. So for a move budget the result does not
//! depend on the number of threads. exp and ln come from `detmath`, not the platform's libm,
//! so the decisions are also the same on every machine. A deadline (wall clock) cuts steps
//! short and is the only source of nondeterminism.

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rayon::prelude::*;

use super::chain::{Chain, MoveMix};
use super::detmath::{exp, ln};
use super::proxy::Proxy;
use crate::error::{invalid, Result};

/// Search settings (the defaults are in `packing::routepack::Options::default`).
#[derive(Clone, Debug, PartialEq)]
pub struct AnnealParams {
    /// Seed of every chain's random stream.
    pub seed: u64,
    /// Total proposals over all chains and temperature steps.
    pub moves: u64,
    /// Chains in the population.
    pub chains: usize,
    /// Temperature steps of the schedule.
    pub steps: usize,
    /// Acceptance probability of a typical (mean) worsening move at the start temperature.
    pub start_accept: f64,
    /// Final temperature / start temperature.
    pub cooling: f64,
    /// Optional wall-clock cap for the whole search.
    pub time_budget: Option<Duration>,
    /// Relative frequencies of the proposals.
    pub mix: MoveMix,
}

/// One temperature step of the search.
#[derive(Clone, Debug, PartialEq)]
pub struct TemperatureStep {
    /// The temperature.
    pub temperature: f64,
    /// Best energy found so far.
    pub best_energy: f64,
    /// Proxy step time (max_g C_g) of the best layout so far.
    pub best_cost: f64,
    /// Mean energy of the population at the end of the temperature step.
    pub mean_energy: f64,
    /// Accepted / evaluated proposals in this temperature step, over all chains.
    pub accept_rate: f64,
    /// Proposals made in this temperature step, over all chains.
    pub moves: u64,
}

/// What the search found and did.
#[derive(Clone, Debug, PartialEq)]
pub struct AnnealResult {
    /// `[S]` best layout found: cell d·M + m of every sample.
    pub cell_of: Vec<u32>,
    /// Energy of the initial layout.
    pub initial_energy: f64,
    /// Proxy step time of the initial layout.
    pub initial_cost: f64,
    /// Energy of the best layout.
    pub best_energy: f64,
    /// Proxy step time of the best layout.
    pub best_cost: f64,
    /// The calibrated start temperature.
    pub start_temperature: f64,
    /// One record per temperature step run.
    pub history: Vec<TemperatureStep>,
    /// Proposals made.
    pub moves_done: u64,
    /// Feasible proposals evaluated.
    pub evaluated: u64,
    /// Proposals accepted.
    pub accepted: u64,
    /// Chains run.
    pub chains: usize,
    /// Temperature steps planned.
    pub steps: usize,
    /// A wall-clock budget cut the search short.
    pub stopped_by_time: bool,
}

/// Most chains a population may hold. Each chain is a full copy of the layout state, and a
/// count beyond a few per core buys nothing: the cap turns an absurd `anneal_chains` into an
/// error instead of an allocation failure (which aborts the process).
pub const MAX_CHAINS: usize = 4096;
/// Most temperature steps a schedule may have (the history keeps one record per step).
pub const MAX_STEPS: usize = 1_000_000;
/// Most bytes the population of chains may hold together (a fixed ceiling, not a fraction of
/// this machine's memory, so whether a request is refused does not depend on the machine).
pub const MAX_POPULATION_BYTES: u64 = 16 << 30;

/// Refuses chain and step counts beyond `MAX_CHAINS` / `MAX_STEPS`, naming the option and
/// what it would allocate, before anything is built.
pub fn check_sizes(params: &AnnealParams) -> Result<()> {
    if params.chains > MAX_CHAINS {
        return Err(invalid(
            "anneal_chains",
            format!("must be <= {MAX_CHAINS} (each chain holds a copy of the layout state), got {}", params.chains),
        ));
    }
    if params.steps > MAX_STEPS {
        let bytes = (params.steps as u128) * std::mem::size_of::<TemperatureStep>() as u128;
        return Err(invalid(
            "anneal_steps",
            format!("must be <= {MAX_STEPS}, got {} (its history alone would take {bytes} bytes)", params.steps),
        ));
    }
    Ok(())
}

fn chain_rng(seed: u64, index: u64) -> Xoshiro256PlusPlus {
    // distinct streams per index: mix the index into the seed with a 64-bit odd constant
    Xoshiro256PlusPlus::seed_from_u64(seed ^ index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Anneals from `init` (`[S]` cells, a feasible layout). Refuses (`Error::InvalidArgument`)
/// chain and step counts beyond the caps of `check_sizes`, and a population whose chains would
/// hold more than `MAX_POPULATION_BYTES` together.
pub fn anneal(px: &Proxy, init: &[u32], params: &AnnealParams) -> Result<AnnealResult> {
    check_sizes(params)?;
    let t_start = Instant::now();
    let deadline = crate::budget::deadline(t_start, params.time_budget);
    let chains_n = params.chains.max(1).min(params.moves.max(1) as usize);
    let steps = params.steps.max(1).min((params.moves / chains_n as u64).max(1) as usize);
    let per = params.moves / (chains_n * steps) as u64;

    let base = Chain::new(px, init, chain_rng(params.seed, 0), params.mix);
    let population = chains_n as u64 * base.heap_bytes() as u64;
    if population > MAX_POPULATION_BYTES {
        return Err(invalid(
            "anneal_chains",
            format!(
                "{chains_n} chains of {} bytes each would take {population} bytes, over the {MAX_POPULATION_BYTES}-byte ceiling",
                base.heap_bytes()
            ),
        ));
    }
    // below the ceiling, the population must fit what this process can hold now
    crate::sizes::check_call("anneal_chains", &format!("{chains_n} chains of {} bytes each", base.heap_bytes()), population as u128)?;
    let initial_energy = base.energy;
    let initial_cost = px.step_time(&base.sh);
    let mut best_cell = init.to_vec();
    let (mut best_energy, mut best_cost) = (initial_energy, initial_cost);

    // start temperature: typical worsening at the start, accepted with probability start_accept
    let mut probe = base.clone();
    probe.rng = chain_rng(params.seed, u64::MAX);
    let mut ups = Vec::new();
    for _ in 0..4096 {
        if ups.len() >= 256 {
            break;
        }
        if let Some(d) = probe.trial_delta(px) {
            if d > 0.0 {
                ups.push(d);
            }
        }
    }
    let mean_up = if ups.is_empty() { initial_energy * 1e-6 } else { ups.iter().sum::<f64>() / ups.len() as f64 };
    let t0 = (mean_up / ln(1.0 / params.start_accept.clamp(1e-6, 0.999))).max(f64::MIN_POSITIVE);
    let temp = |k: usize| {
        if steps == 1 {
            0.0
        } else {
            t0 * exp(ln(params.cooling) * k as f64 / (steps - 1) as f64)
        }
    };

    let mut result = AnnealResult {
        cell_of: Vec::new(),
        initial_energy,
        initial_cost,
        best_energy,
        best_cost,
        start_temperature: t0,
        history: Vec::with_capacity(steps),
        moves_done: 0,
        evaluated: 0,
        accepted: 0,
        chains: chains_n,
        steps,
        stopped_by_time: false,
    };
    if per == 0 {
        result.cell_of = best_cell;
        return Ok(result);
    }
    let mut pop: Vec<Chain> = (0..chains_n)
        .map(|i| {
            let mut c = base.clone();
            c.rng = chain_rng(params.seed, i as u64);
            c
        })
        .collect();
    let mut master = chain_rng(params.seed, u64::MAX - 1);

    for k in 0..steps {
        let t = temp(k);
        // each step gets an equal slice of the time budget, so the schedule completes
        let step_deadline = crate::budget::deadline(t_start, params.time_budget.map(|b| b.mul_f64((k + 1) as f64 / steps as f64)));
        let before: Vec<(u64, u64, u64)> = pop.iter().map(|c| (c.proposed, c.evaluated, c.accepted)).collect();
        let finished: Vec<bool> = pop.par_iter_mut().map(|c| c.run(px, per, t, step_deadline)).collect();
        let (mut moves, mut eval, mut acc) = (0u64, 0u64, 0u64);
        for (c, b) in pop.iter().zip(&before) {
            moves += c.proposed - b.0;
            eval += c.evaluated - b.1;
            acc += c.accepted - b.2;
        }
        result.moves_done += moves;
        result.evaluated += eval;
        result.accepted += acc;
        for c in &pop {
            if c.energy < best_energy {
                best_energy = c.energy;
                best_cost = px.step_time(&c.sh);
                best_cell.clone_from(&c.cell_of);
            }
        }
        let mean = pop.iter().map(|c| c.energy).sum::<f64>() / chains_n as f64;
        result.history.push(TemperatureStep {
            temperature: t,
            best_energy,
            best_cost,
            mean_energy: mean,
            accept_rate: if eval > 0 { acc as f64 / eval as f64 } else { 0.0 },
            moves,
        });
        // a step's deadline only ends that step (the schedule goes on cooling); the whole
        // anneal stops at the overall deadline
        if finished.iter().any(|f| !f) {
            result.stopped_by_time = true;
        }
        if crate::budget::passed(deadline) {
            result.stopped_by_time = true;
            break;
        }
        if k + 1 < steps {
            resample(&mut pop, 1.0 / temp(k + 1) - if t > 0.0 { 1.0 / t } else { 0.0 }, &mut master);
        }
    }
    result.cell_of = best_cell;
    result.best_energy = best_energy;
    result.best_cost = best_cost;
    Ok(result)
}

/// Systematic resampling by Boltzmann weight; chains drawn at least once keep their layout,
/// the others take copies of the chains drawn more than once (in index order).
fn resample(pop: &mut [Chain], dbeta: f64, rng: &mut Xoshiro256PlusPlus) {
    let n = pop.len();
    if n < 2 || !dbeta.is_finite() {
        return;
    }
    let e_min = pop.iter().map(|c| c.energy).fold(f64::INFINITY, f64::min);
    let w: Vec<f64> = pop.iter().map(|c| exp(-(dbeta * (c.energy - e_min)))).collect();
    let total: f64 = w.iter().sum();
    let u0 = (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64) / n as f64;
    let mut counts = vec![0usize; n];
    let (mut cum, mut i) = (w[0] / total, 0usize);
    for j in 0..n {
        let u = u0 + j as f64 / n as f64;
        while u > cum && i + 1 < n {
            i += 1;
            cum += w[i] / total;
        }
        counts[i] += 1;
    }
    let mut extra: Vec<usize> = Vec::new();
    for (i, &c) in counts.iter().enumerate() {
        for _ in 1..c.max(1) {
            extra.push(i);
        }
    }
    let empty: Vec<usize> = (0..n).filter(|&i| counts[i] == 0).collect();
    for (slot, parent) in empty.into_iter().zip(extra) {
        let (dst, src) = if slot < parent {
            let (lo, hi) = pop.split_at_mut(parent);
            (&mut lo[slot], &hi[0])
        } else {
            let (lo, hi) = pop.split_at_mut(slot);
            (&mut hi[0], &lo[parent])
        };
        dst.copy_state_from(src);
    }
}
