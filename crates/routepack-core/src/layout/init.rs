//! The layout the annealer starts from.
//!
//! First choice: worst-fit decreasing over the fixed grid of cells. Samples, heaviest first
//! (weight: attention over all layers plus a per-token share of expert work and all-to-all),
//! go to the lightest cell that still has room under the cap. Empty cells weigh 0, so the
//! first dp·M samples open every cell and no cell stays empty. This spreads attention and
//! tokens evenly, which is most of the objective. It can fail when rows are nearly full
//! (a sample finds no cell with room); then the certified rows are laid out instead: heaviest
//! row first onto the lightest (group, step) with a free rank.

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
pub fn worst_fit(px: &Proxy) -> Option<Vec<u32>> {
    let cells = px.cells();
    let w: Vec<f64> = (0..px.num_samples).map(|s| sample_weight(px, s)).collect();
    let mut order: Vec<usize> = (0..px.num_samples).collect();
    order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
    let mut load = vec![0f64; cells];
    let mut tokens = vec![0i64; cells];
    let mut used = vec![false; cells];
    let mut cell_of = vec![0u32; px.num_samples];
    for s in order {
        let n = px.lens[s];
        let mut pick = usize::MAX;
        for c in 0..cells {
            // An empty cell is lighter than any used one, whatever the loads: a zero-weight
            // sample (no attention cost, no expert tokens) must still open a cell, or the
            // annealer is handed an empty cell. Where every weight is positive, used cells
            // weigh more than 0 and this orders cells exactly as the loads alone did.
            let lighter = pick == usize::MAX
                || (!used[c] && used[pick])
                || (used[c] == used[pick] && load[c] < load[pick]);
            if tokens[c] + n <= px.token_cap && lighter {
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

/// Lays `rows` (exactly dp·M, each within the cap) onto cells: heaviest row first onto the
/// (group, step) with the least weight that still has a free rank.
pub fn from_rows(px: &Proxy, rows: &[Vec<usize>]) -> Vec<u32> {
    debug_assert_eq!(rows.len(), px.cells());
    let (ep, m_n) = (px.ep, px.micro);
    let gms = px.groups * m_n;
    let rw: Vec<f64> = rows.iter().map(|r| r.iter().map(|&s| sample_weight(px, s)).sum()).collect();
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by(|&a, &b| rw[b].total_cmp(&rw[a]).then(a.cmp(&b)));
    let mut load = vec![0f64; gms];
    let mut used = vec![0usize; gms];
    let mut cell_of = vec![0u32; px.num_samples];
    for r in order {
        let gm = (0..gms)
            .filter(|&gm| used[gm] < ep)
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
            .expect("dp·M rows fill exactly the dp·M cells");
        let (g, m) = (gm / m_n, gm % m_n);
        let d = g * ep + used[gm];
        used[gm] += 1;
        load[gm] += rw[r];
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
}
