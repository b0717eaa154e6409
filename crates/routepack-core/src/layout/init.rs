//! The layout the annealer starts from.
//!
//! First choice: worst-fit decreasing over the fixed grid of cells. Samples, heaviest first
//! (weight: attention over all layers plus a per-token share of expert work and all-to-all),
//! go to the lightest cell that still has room under the cap. Empty cells weigh 0, so the
//! first dp·M samples open every cell and no cell stays empty. This spreads attention and
//! tokens evenly, which is most of the objective. It can fail when rows are nearly full
//! (a sample finds no cell with room); then the certified rows are laid out instead: heaviest
//! row first onto the lightest (group, microbatch) with a free rank.

use super::proxy::Proxy;

/// Weight of sample s: Σ_l attention + tokens × (expert + all-to-all cost per token). A
/// heuristic for ordering samples, not a cost-model term: the all-to-all share charges every
/// token the slower link (not `CostModel::uniform_seconds_per_byte`'s split), and changing it
/// would change the starting layouts and so the plans.
pub fn sample_weight(px: &Proxy, s: usize) -> f64 {
    let n = px.lens[s] as f64;
    let att: f64 = px.kinds.iter().map(|&(q3, cnt)| cnt * (px.att_lin * n + q3 * n * n)).sum();
    let per_token = px.ct as f64 / px.ep as f64 + if px.nodes > 1 { px.ke as f64 } else { px.ki as f64 };
    let toks: f64 = (0..px.num_layers).map(|l| px.sent(s, l) as f64).sum();
    att + per_token * toks
}

/// Worst-fit decreasing onto the cells; None if some sample finds no cell with room.
///
/// Cells are kept ordered by (load, index), so a sample takes the first cell of that order
/// with room instead of scanning every cell: the choice the scan made (the lightest cell with
/// room, the lowest index among equal loads, empty cells first) in O(log cells) when the
/// lightest cells have room. The order by bits is the order by value for loads >= 0; weights
/// that are negative or not finite (no cost model gives them) take the scan.
pub fn worst_fit(px: &Proxy) -> Option<Vec<u32>> {
    let w: Vec<f64> = (0..px.num_samples).map(|s| sample_weight(px, s)).collect();
    let mut order: Vec<usize> = (0..px.num_samples).collect();
    order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    if w.iter().all(|x| x.is_finite() && *x >= 0.0) {
        worst_fit_ordered(px, &w, &order)
    } else {
        worst_fit_scan(px, &w, &order)
    }
}

/// `worst_fit` over cells ordered by load (every weight finite and >= 0).
fn worst_fit_ordered(px: &Proxy, w: &[f64], order: &[usize]) -> Option<Vec<u32>> {
    use std::collections::BTreeSet;
    let cells = px.cells();
    let cap = px.token_cap as i128;
    let mut load = vec![0f64; cells];
    let mut tokens = vec![0i64; cells];
    let mut cell_of = vec![0u32; px.num_samples];
    // used cells by (load bits, index); the unused ones are 0..cells from `fresh` on, and an
    // unused cell comes before every used one (see `worst_fit_scan`)
    let mut used: BTreeSet<(u64, usize)> = BTreeSet::new();
    let mut fresh = 0usize;
    for &s in order {
        let n = px.lens[s];
        // (an empty cell takes any sample: one over the cap then runs alone there)
        let pick = if fresh < cells {
            fresh += 1;
            fresh - 1
        } else {
            let &(bits, c) = used.iter().find(|&&(_, c)| tokens[c] as i128 + n as i128 <= cap)?;
            used.remove(&(bits, c));
            c
        };
        load[pick] += w[s];
        tokens[pick] += n;
        used.insert((load[pick].to_bits(), pick));
        cell_of[s] = pick as u32;
    }
    Some(cell_of)
}

/// `worst_fit` by a scan over every cell per sample.
fn worst_fit_scan(px: &Proxy, w: &[f64], order: &[usize]) -> Option<Vec<u32>> {
    let cells = px.cells();
    let mut load = vec![0f64; cells];
    let mut tokens = vec![0i64; cells];
    let mut used = vec![false; cells];
    let mut cell_of = vec![0u32; px.num_samples];
    for &s in order {
        let n = px.lens[s];
        let mut pick = usize::MAX;
        for c in 0..cells {
            // An empty cell is lighter than any used one, whatever the loads: a zero-weight
            // sample (no attention cost, no expert tokens) must still open a cell, or the
            // annealer is handed an empty cell. Where every weight is positive, used cells
            // weigh more than 0 and this orders cells exactly as the loads alone did.
            let lighter = pick == usize::MAX || (!used[c] && used[pick]) || (used[c] == used[pick] && load[c] < load[pick]);
            if (tokens[c] as i128 + n as i128 <= px.token_cap as i128 || !used[c]) && lighter {
                pick = c;
            }
        }
        if pick == usize::MAX {
            return None;
        }
        load[pick] += w[s];
        tokens[pick] += n;
        used[pick] = true;
        cell_of[s] = pick as u32;
    }
    Some(cell_of)
}

/// A key whose order is `f64::total_cmp`'s.
fn total_key(x: f64) -> i64 {
    let b = x.to_bits() as i64;
    b ^ (((b >> 63) as u64) >> 1) as i64
}

/// Lays `rows` (exactly dp·M, each within the cap) onto cells: heaviest row first onto the
/// (group, microbatch) with the least weight that still has a free rank (the lowest index among
/// equal weights), kept in an ordered set rather than found by a scan over every microbatch.
pub fn from_rows(px: &Proxy, rows: &[Vec<usize>]) -> Vec<u32> {
    use std::collections::BTreeSet;
    debug_assert_eq!(rows.len(), px.cells());
    let (ep, m_n) = (px.ep, px.micro);
    let gms = px.groups * m_n;
    let rw: Vec<f64> = rows.iter().map(|r| r.iter().map(|&s| sample_weight(px, s)).sum()).collect();
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| rw[b].total_cmp(&rw[a]).then(a.cmp(&b)));
    let mut load = vec![0f64; gms];
    let mut used = vec![0usize; gms];
    let mut open: BTreeSet<(i64, usize)> = (0..gms).map(|gm| (total_key(0.0), gm)).collect();
    let mut cell_of = vec![0u32; px.num_samples];
    for r in order {
        let (key, gm) = open.pop_first().expect("dp·M rows fill exactly the dp·M cells");
        debug_assert_eq!(key, total_key(load[gm]));
        let (g, m) = (gm / m_n, gm % m_n);
        let d = g * ep + used[gm];
        used[gm] += 1;
        load[gm] += rw[r];
        if used[gm] < ep {
            open.insert((total_key(load[gm]), gm));
        }
        for &s in &rows[r] {
            cell_of[s] = (d * m_n + m) as u32;
        }
    }
    cell_of
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostModel;
    use crate::placement::static_placement;
    use crate::topology::Topology;
    use crate::window::WindowView;

    /// Samples of zero weight (no attention cost, no expert tokens) still open every cell.
    #[test]
    fn zero_weight_samples_open_every_cell() {
        let (s_n, l_n, e_n) = (24, 2, 8);
        let lens: Vec<i64> = (0..s_n).map(|s| 10 + s as i64).collect();
        let tok = vec![0i32; s_n * l_n * e_n];
        let topo = Topology::new(4, 2, 2, 4).unwrap();
        let mut cost = CostModel::for_tests(l_n);
        cost.a_lin = 0.0;
        cost.a_quad = vec![0.0; l_n];
        let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
        let pl = static_placement(l_n, e_n, &topo).unwrap();
        let px = Proxy::new(&w, &topo, &cost, &pl, 1000, 3, 0.1).unwrap();
        assert!((0..s_n).all(|s| sample_weight(&px, s) == 0.0));
        let cell_of = worst_fit(&px).expect("room everywhere");
        let mut count = vec![0usize; px.cells()];
        cell_of.iter().for_each(|&c| count[c as usize] += 1);
        assert!(count.iter().all(|&n| n >= 1), "an empty cell: {count:?}");
    }

    /// The scan over every (group, microbatch) that `from_rows` replaced.
    fn from_rows_scan(px: &Proxy, rows: &[Vec<usize>]) -> Vec<u32> {
        let (ep, m_n) = (px.ep, px.micro);
        let gms = px.groups * m_n;
        let rw: Vec<f64> = rows.iter().map(|r| r.iter().map(|&s| sample_weight(px, s)).sum()).collect();
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by(|&a, &b| rw[b].total_cmp(&rw[a]).then(a.cmp(&b)));
        let (mut load, mut used) = (vec![0f64; gms], vec![0usize; gms]);
        let mut cell_of = vec![0u32; px.num_samples];
        for r in order {
            let gm = (0..gms).filter(|&gm| used[gm] < ep).min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b))).unwrap();
            let d = gm / m_n * ep + used[gm];
            used[gm] += 1;
            load[gm] += rw[r];
            rows[r].iter().for_each(|&s| cell_of[s] = (d * m_n + gm % m_n) as u32);
        }
        cell_of
    }

    /// The ordered cells choose what the scans chose: worst fit (tight caps, where it fails
    /// too) and the rows' layout, on several topologies and microbatch counts.
    #[test]
    fn ordered_cells_choose_as_the_scans_did() {
        let (l_n, e_n) = (2, 8);
        for seed in 0..12u64 {
            let s_n = 20 + 7 * seed as usize;
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            let lens: Vec<i64> = (0..s_n).map(|_| 50 + next(850) as i64).collect();
            let tok: Vec<i32> = (0..s_n * l_n * e_n).map(|_| next(40) as i32).collect();
            let w = WindowView::new(&lens, &tok, l_n, e_n).unwrap();
            let topo =
                [Topology::new(4, 2, 2, 4), Topology::new(2, 1, 1, 8), Topology::new(8, 4, 2, 2)][seed as usize % 3].clone().unwrap();
            let cost = CostModel::for_tests(l_n);
            let pl = static_placement(l_n, e_n, &topo).unwrap();
            let total: i64 = lens.iter().sum();
            for micro in [1usize, 2, 3] {
                let cells = (topo.dp * micro) as i64;
                for cap in [total / cells + 900, total / cells + 200, 900] {
                    let px = Proxy::new(&w, &topo, &cost, &pl, cap, micro, 0.1).unwrap();
                    let order: Vec<usize> = {
                        let wt: Vec<f64> = (0..s_n).map(|s| sample_weight(&px, s)).collect();
                        let mut o: Vec<usize> = (0..s_n).collect();
                        o.sort_by(|&a, &b| wt[b].total_cmp(&wt[a]).then(a.cmp(&b)));
                        o
                    };
                    let wt: Vec<f64> = (0..s_n).map(|s| sample_weight(&px, s)).collect();
                    assert_eq!(worst_fit(&px), worst_fit_scan(&px, &wt, &order), "seed {seed} micro {micro} cap {cap}");
                    // rows: consecutive samples dealt to the cells in turn
                    let rows: Vec<Vec<usize>> = (0..px.cells()).map(|c| (c..s_n).step_by(px.cells()).collect()).collect();
                    if rows.iter().all(|r| !r.is_empty()) {
                        assert_eq!(from_rows(&px, &rows), from_rows_scan(&px, &rows), "seed {seed} micro {micro}");
                    }
                }
            }
        }
    }
}
