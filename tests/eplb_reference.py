"""A line-by-line numpy transcription of DeepSeek's published `eplb.py`
(deepseek-ai/EPLB: balanced_packing, replicate_experts, rebalance_experts_hierarchical,
rebalance_experts), used only by the tests to cross-check routepack's Rust port.

Deliberate choices where the original leaves order to torch: sorting is stable (equal weights
keep ascending index order) and argmax/argmin take the lowest index, the same rules the Rust
port documents. Weights are float64 (the original casts to float32).
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, num_packs: int):
    """weight [X, n] → (pack_index [X, n], rank_in_pack [X, n]) int64."""
    num_layers, num_groups = weight.shape
    assert num_groups % num_packs == 0
    groups_per_pack = num_groups // num_packs
    if groups_per_pack == 1:
        pack_index = np.broadcast_to(np.arange(num_groups, dtype=np.int64), weight.shape).copy()
        return pack_index, np.zeros_like(pack_index)
    indices = np.argsort(-weight, axis=-1, kind="stable")
    pack_index = np.full(weight.shape, -1, dtype=np.int64)
    rank_in_pack = np.full(weight.shape, -1, dtype=np.int64)
    for i in range(num_layers):
        pack_weights = [0.0] * num_packs
        pack_items = [0] * num_packs
        for group in indices[i]:
            pack = min((p for p in range(num_packs) if pack_items[p] < groups_per_pack), key=pack_weights.__getitem__)
            pack_index[i, group] = pack
            rank_in_pack[i, group] = pack_items[pack]
            pack_weights[pack] += weight[i, group]
            pack_items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int):
    """weight [X, n] → (phy2log [X, num_phy], rank [X, num_phy], logcnt [X, n])."""
    n, num_log = weight.shape
    assert num_phy >= num_log
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (n, 1))
    rank = np.zeros((n, num_phy), dtype=np.int64)
    logcnt = np.ones((n, num_log), dtype=np.int64)
    arangen = np.arange(n)
    for i in range(num_log, num_phy):
        redundant = np.argmax(weight / logcnt, axis=-1)
        phy2log[:, i] = redundant
        rank[:, i] = logcnt[arangen, redundant]
        logcnt[arangen, redundant] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_experts_hierarchical(weight, num_physical_experts, num_groups, num_nodes, num_gpus):
    num_layers, num_logical_experts = weight.shape
    group_size = num_logical_experts // num_groups
    groups_per_node = num_groups // num_nodes
    phy_experts_per_gpu = num_physical_experts // num_gpus

    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    group_pack_index, group_rank_in_pack = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (
        ((group_pack_index * groups_per_node + group_rank_in_pack) * group_size)[:, :, None] + np.arange(group_size)
    ).reshape(num_layers, -1)
    mlog2log = _inverse(log2mlog)

    tokens_per_mlog = np.take_along_axis(weight, mlog2log, -1).reshape(-1, num_logical_experts // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical_experts // num_nodes)

    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, -1)
    pack_index, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    phy2pphy = pack_index * phy_experts_per_gpu + rank_in_pack
    pphy2phy = _inverse(phy2pphy)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)
    pphy2mlog = (
        pphy2mlog.reshape(num_layers, num_nodes, -1)
        + np.arange(0, num_logical_experts, num_logical_experts // num_nodes).reshape(1, -1, 1)
    ).reshape(num_layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, -1), log2mlog, -1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus):
    weight = np.asarray(weight, dtype=np.float64)
    num_layers, num_logical_experts = weight.shape
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    maxlogcnt = int(logcnt.max())
    log2phy = np.full((num_layers, num_logical_experts * maxlogcnt), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy,
        phy2log * maxlogcnt + phyrank,
        np.broadcast_to(np.arange(num_replicas), (num_layers, num_replicas)),
        axis=-1,
    )
    return phy2log, log2phy.reshape(num_layers, num_logical_experts, maxlogcnt), logcnt
