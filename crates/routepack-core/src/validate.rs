//! `validate`: every invariant of docs/design.md, checked on a finished plan. Raises with the first
//! violation, in words that name the sample, cell, layer or row.
//!
//! A cell's tokens are summed in i128: lengths are i64, and a cell of a few samples near 2^62
//! tokens wraps an i64 sum below the cap. Migration moves are one per destination slot (a slot
//! filled twice would be charged twice by `simulate`), and [`validate_placement_tables`]
//! checks tables derived from `phy2log` that travel with a plan (they can be edited apart
//! from it).

use crate::error::{bad_plan, Error, Result};
use crate::oversize::Oversize;
use crate::plan::Placement;
use crate::plan::{cell_members, Plan};
use crate::split::Pieces;
use crate::topology::Topology;
use crate::window::WindowView;

/// Checks `plan` against the window `w`, the topology and `token_cap` (tokens per cell;
/// `i64::MAX` skips the cap): under a pipeline, the microbatch count meets Megatron's rule
/// (`Topology::micro_rule`) and the layers split into the topology's chunks; the placement
/// fits the topology and hosts every expert; every
/// sample runs exactly once, in range, and no cell is empty or over the cap (sums in i128);
/// replicas are in range, come from a rank that hosts the expert, go to another rank, their
/// shares per (exchange, expert) sum to at most 1, and no rank receives copies of more than
/// `topo.replica_slots` distinct experts in one exchange; migration moves are in range, land
/// in the slot the placement gives the expert, no (layer, slot) is moved into twice, and
/// their ranks match their slots. The error names the first violation (`Error::InvalidPlan`).
pub fn validate_plan(plan: &Plan, w: &WindowView, topo: &Topology, token_cap: i64) -> Result<()> {
    validate_plan_in(plan, w, topo, token_cap, Oversize::Refuse)
}

/// [`validate_plan`], where with [`Oversize::Alone`] a cell over the cap is valid when it holds
/// one sample (a sample over the cap running alone, docs/design.md "Samples over the cap"), and
/// with [`Oversize::Split`] a sample over the cap is valid split over a context-parallel group
/// (`crate::split`): at most `topo.cp` × `token_cap` tokens and at least cp, at a rank that
/// starts a CP group (a multiple of cp), alone in its cell, and the cells of the group's other
/// ranks at its microbatch hold no sample (they run its other pieces).
pub fn validate_plan_in(plan: &Plan, w: &WindowView, topo: &Topology, token_cap: i64, oversize: Oversize) -> Result<()> {
    topo.check_experts(w.num_experts)?;
    validate_checked(plan, w, topo, token_cap, oversize, false)
}

/// [`validate_plan_in`] where `topo` was checked against the window's experts at the caller's
/// entry (`simulate_in`, a `crate::request::PlanRequest`), and where `lengths_checked`, the
/// window's lengths were checked against `token_cap` under `oversize` too (a request's own cap:
/// its split samples' pieces are then built without checking them again).
pub(crate) fn validate_checked(
    plan: &Plan,
    w: &WindowView,
    topo: &Topology,
    token_cap: i64,
    oversize: Oversize,
    lengths_checked: bool,
) -> Result<()> {
    debug_assert!(topo.num_slots() >= w.num_experts, "topology not checked against the window");
    let p = &plan.placement;
    if p.num_layers != w.num_layers || p.num_experts != w.num_experts {
        return Err(bad_plan(format!(
            "placement is for L={}, E={} but the window has L={}, E={}",
            p.num_layers, p.num_experts, w.num_layers, w.num_experts
        )));
    }
    p.check_topology(topo)?;
    p.check()?;

    let s_n = w.num_samples;
    if plan.sample_rank.len() != s_n || plan.sample_micro.len() != s_n {
        return Err(bad_plan(format!(
            "sample_rank has {} and sample_micro {} entries; the window has {s_n} samples (each exactly once)",
            plan.sample_rank.len(),
            plan.sample_micro.len()
        )));
    }
    let m_n = plan.num_micro;
    if m_n == 0 {
        return Err(bad_plan("num_micro is 0"));
    }
    if topo.pp > 1 {
        topo.chunk_bounds(w.num_layers)?;
        let rule = topo.micro_rule();
        if !rule.allows(m_n) {
            let multiple = if rule.multiple > 1 {
                format!(" and a multiple of {} (interleaved, vpp = {})", rule.multiple, topo.vpp)
            } else {
                String::new()
            };
            return Err(bad_plan(format!(
                "num_micro = {m_n}: a pipeline of pp = {} stages runs at least {} microbatches per DP rank{multiple}, as Megatron does",
                topo.pp, rule.min
            )));
        }
    }
    for s in 0..s_n {
        let (d, m) = (plan.sample_rank[s], plan.sample_micro[s]);
        if d < 0 || d as usize >= topo.dp {
            return Err(bad_plan(format!("sample {s} is on DP rank {d}, outside [0, {})", topo.dp)));
        }
        if m < 0 || m as usize >= m_n {
            return Err(bad_plan(format!("sample {s} is at microbatch {m}, outside [0, {m_n})")));
        }
    }
    let pieces = match oversize {
        Oversize::Split if lengths_checked => Some(Pieces::of_checked(w.seq_lens, token_cap, topo.cp)),
        Oversize::Split => Some(Pieces::new(w.seq_lens, token_cap, topo.cp).map_err(|e| match e {
            Error::Infeasible(msg) => bad_plan(msg),
            e => e,
        })?),
        _ => None,
    };
    // the cells the samples fill: a split sample fills cp
    let filled = pieces.as_ref().map_or(s_n, |p| p.lens.len());
    if topo.dp.checked_mul(m_n).is_none_or(|cells| cells > filled) {
        return Err(bad_plan(format!(
            "{} DP ranks x {m_n} microbatches is more cells than the {filled} the samples fill: some cell is empty",
            topo.dp
        )));
    }
    let (off, members) = cell_members(&plan.sample_rank, &plan.sample_micro, topo.dp, m_n);
    let owner = match &pieces {
        Some(p) => split_cells(plan, p, topo)?,
        None => Vec::new(),
    };
    for d in 0..topo.dp {
        for m in 0..m_n {
            let c = d * m_n + m;
            let here = &members[off[c]..off[c + 1]];
            if let Some(&Some(s)) = owner.get(c) {
                if let Some(&t) = here.first() {
                    return Err(bad_plan(format!(
                        "cell (rank {d}, micro {m}) runs a piece of sample {s}, split over the CP group of rank {}, but holds sample {t} too",
                        plan.sample_rank[s]
                    )));
                }
                continue;
            }
            if here.is_empty() {
                return Err(bad_plan(format!("cell (rank {d}, micro {m}) is empty; every DP rank must run {m_n} non-empty microbatches")));
            }
            let tokens: i128 = here.iter().map(|&s| w.seq_lens[s] as i128).sum();
            let alone = matches!(oversize, Oversize::Alone | Oversize::Split) && here.len() == 1;
            if tokens > token_cap as i128 && !alone {
                if let Some(&s) = here.iter().find(|&&s| pieces.as_ref().is_some_and(|p| p.is_split(s))) {
                    return Err(bad_plan(format!(
                        "cell (rank {d}, micro {m}) holds sample {s}, split over its CP group (oversize=\"split\"), and other samples"
                    )));
                }
                return Err(bad_plan(format!("cell (rank {d}, micro {m}) holds {tokens} tokens, over the cap {token_cap}")));
            }
        }
    }

    let g_n = topo.num_groups() as i32;
    let mut share_sum: std::collections::HashMap<(i32, i32, i32, i32), f64> = Default::default();
    for (i, r) in plan.replicas.iter().enumerate() {
        let ok = (0..m_n as i32).contains(&r.micro)
            && (0..g_n).contains(&r.group)
            && (0..w.num_layers as i32).contains(&r.layer)
            && (0..w.num_experts as i32).contains(&r.expert)
            && (0..topo.ep as i32).contains(&r.src_rank)
            && (0..topo.ep as i32).contains(&r.dst_rank);
        if !ok {
            return Err(bad_plan(format!("replica {i} is out of range: {r:?}")));
        }
        if !(r.share.is_finite() && (0.0..=1.0).contains(&r.share)) {
            return Err(bad_plan(format!("replica {i} has share {} outside [0, 1]", r.share)));
        }
        if r.src_rank == r.dst_rank {
            return Err(bad_plan(format!("replica {i} copies expert {} onto its own source rank {}", r.expert, r.src_rank)));
        }
        let layer = p.layer(r.layer as usize);
        let lo = r.src_rank as usize * topo.slots_per_rank;
        if !layer[lo..lo + topo.slots_per_rank].contains(&r.expert) {
            return Err(bad_plan(format!("replica {i}: src_rank {} does not host expert {} in layer {}", r.src_rank, r.expert, r.layer)));
        }
        *share_sum.entry((r.micro, r.group, r.layer, r.expert)).or_default() += r.share as f64;
    }
    if let Some((k, v)) = share_sum.iter().find(|(_, v)| **v > 1.0 + 1e-5) {
        return Err(bad_plan(format!("replica shares of (micro, group, layer, expert) = {k:?} sum to {v} > 1")));
    }
    check_replica_buffers(&plan.replicas, topo)?;

    for (i, mv) in plan.migration.iter().enumerate() {
        let ok = (0..w.num_layers as i32).contains(&mv.layer)
            && (0..w.num_experts as i32).contains(&mv.expert)
            && (0..topo.ep as i32).contains(&mv.src_rank)
            && (0..topo.ep as i32).contains(&mv.dst_rank)
            && (0..p.num_slots as i32).contains(&mv.dst_slot)
            && (0..p.num_slots as i32).contains(&mv.src_slot)
            && mv.bytes.is_finite()
            && mv.bytes >= 0.0;
        if !ok {
            return Err(bad_plan(format!("migration row {i} is out of range: {mv:?}")));
        }
        if p.layer(mv.layer as usize)[mv.dst_slot as usize] != mv.expert {
            return Err(bad_plan(format!(
                "migration row {i} moves expert {} into slot {} of layer {}, but the placement holds {} there",
                mv.expert,
                mv.dst_slot,
                mv.layer,
                p.layer(mv.layer as usize)[mv.dst_slot as usize]
            )));
        }
        if topo.rank_of_slot(mv.dst_slot as usize) != mv.dst_rank as usize
            || topo.rank_of_slot(mv.src_slot as usize) != mv.src_rank as usize
        {
            return Err(bad_plan(format!("migration row {i}: slot and rank disagree: {mv:?}")));
        }
    }
    if let Some((first, again)) = repeated_destination(&plan.migration) {
        let mv = &plan.migration[again];
        return Err(bad_plan(format!(
            "migration row {again} moves an expert into slot {} of layer {} again (row {first} already does): {mv:?}",
            mv.dst_slot, mv.layer
        )));
    }
    Ok(())
}

/// `[dp · M]` the split sample whose piece each cell runs beyond its first (None elsewhere),
/// checking that every split sample sits at a rank that starts a CP group (ranks and
/// microbatches in range, checked first).
fn split_cells(plan: &Plan, pieces: &Pieces, topo: &Topology) -> Result<Vec<Option<usize>>> {
    let (m_n, cp) = (plan.num_micro, pieces.cp);
    let mut owner = vec![None; topo.dp * m_n];
    for s in (0..pieces.num_samples()).filter(|&s| pieces.is_split(s)) {
        let (d, m) = (plan.sample_rank[s] as usize, plan.sample_micro[s] as usize);
        if !d.is_multiple_of(cp) {
            return Err(bad_plan(format!(
                "sample {s} is over the cap and split over a CP group of topo.cp = {cp} ranks (oversize=\"split\"), so it \
                 runs at a rank that starts one (a multiple of {cp}), not at rank {d}"
            )));
        }
        for j in 1..cp {
            owner[(d + j) * m_n + m] = Some(s);
        }
    }
    Ok(owner)
}

/// Every rank receives copies of at most `topo.replica_slots` distinct experts per exchange
/// (group, microbatch, layer): its replica buffers. Rows are in range (checked first). The
/// error names the first (group, microbatch, layer, rank) in that order.
fn check_replica_buffers(replicas: &[crate::plan::Replica], topo: &Topology) -> Result<()> {
    if replicas.is_empty() {
        return Ok(());
    }
    let mut keys: Vec<(i32, i32, i32, i32, i32)> = replicas.iter().map(|r| (r.group, r.micro, r.layer, r.dst_rank, r.expert)).collect();
    keys.sort_unstable();
    keys.dedup();
    let mut i = 0;
    while i < keys.len() {
        let (g, m, l, d, _) = keys[i];
        let j = i + keys[i..].iter().take_while(|k| (k.0, k.1, k.2, k.3) == (g, m, l, d)).count();
        if j - i > topo.replica_slots {
            return Err(bad_plan(format!(
                "rank {d} of EP group {g} receives copies of {} experts in microbatch {m}, layer {l}: more than its topo.replica_slots = {} replica buffers",
                j - i,
                topo.replica_slots
            )));
        }
        i = j;
    }
    Ok(())
}

/// The earliest migration row whose (layer, destination slot) an earlier row has, with that
/// earlier row: a slot is filled once (exact duplicates included).
fn repeated_destination(moves: &[crate::plan::ExpertMove]) -> Option<(usize, usize)> {
    let mut keys: Vec<(i32, i32, usize)> = moves.iter().enumerate().map(|(i, m)| (m.layer, m.dst_slot, i)).collect();
    keys.sort_unstable();
    keys.windows(2).filter(|p| (p[0].0, p[0].1) == (p[1].0, p[1].1)).map(|p| (p[0].2, p[1].2)).min_by_key(|&(_, again)| again)
}

/// Checks `logcnt` (`[L, E]`, replicas of each expert) and `log2phy` (`[L, E, R]`, each
/// expert's slots ascending, padded with -1) against what `p`'s `phy2log` gives, naming the
/// first entry that differs. `log2phy_replicas` is R, the table's last dimension.
pub fn validate_placement_tables(p: &Placement, logcnt: &[i32], log2phy: &[i32], log2phy_replicas: usize) -> Result<()> {
    let (l_n, e_n) = (p.num_layers, p.num_experts);
    let want_cnt = p.logcnt();
    if logcnt.len() != want_cnt.len() {
        return Err(bad_plan(format!(
            "placement.logcnt has {} entries; phy2log gives [L={l_n}, E={e_n}] = {}",
            logcnt.len(),
            want_cnt.len()
        )));
    }
    if let Some(i) = (0..want_cnt.len()).find(|&i| logcnt[i] != want_cnt[i]) {
        return Err(bad_plan(format!(
            "placement.logcnt[{}, {}] = {} but phy2log gives {} replicas (a table edited apart from phy2log)",
            i / e_n,
            i % e_n,
            logcnt[i],
            want_cnt[i]
        )));
    }
    let (want_l2p, r) = p.log2phy()?;
    if log2phy_replicas != r || log2phy.len() != want_l2p.len() {
        return Err(bad_plan(format!(
            "placement.log2phy has {} entries with last dimension {log2phy_replicas}; phy2log gives [L={l_n}, E={e_n}, R={r}]",
            log2phy.len()
        )));
    }
    if let Some(i) = (0..want_l2p.len()).find(|&i| log2phy[i] != want_l2p[i]) {
        return Err(bad_plan(format!(
            "placement.log2phy[{}, {}, {}] = {} but phy2log gives {} (a table edited apart from phy2log)",
            i / (e_n * r),
            i / r % e_n,
            i % r,
            log2phy[i],
            want_l2p[i]
        )));
    }
    Ok(())
}
