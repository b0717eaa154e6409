"""routepack.integrations.megatron's on-device slot map (`megatron.tables.SlotMap`) against the
plan's routing rule, on CPU without a Megatron model: for random cells (placements with
redundant copies, replica rows, ranks and experts without tokens) every (token, expert) pair
lands on a physical expert holding its logical expert, the pairs each physical expert gets
from this rank are exactly the flow table's (`routepack.torch.flow_table`, what `simulate`
prices), probabilities are kept, and without replicas the assignment is `slot_topk`'s pair by
pair. The default table (outside a planned microbatch) keeps every pair on a placement copy of
its own expert."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import routepack as rp  # noqa: E402
from routepack.errors import InvalidPlanError  # noqa: E402
from routepack.integrations import megatron as rm  # noqa: E402
from routepack.integrations.megatron.tables import (  # noqa: E402
    SlotMap,
    _flows_to_table,
    _pack,
    _first_copies,
    buffer_of,
    default_table,
)
from routepack.plan import REPLICA_DTYPE  # noqa: E402
from routepack.torch import flow_table  # noqa: E402
from random_plans import TOPOLOGIES, random_phy2log, random_replicas  # noqa: E402
from verl_batches import distinct_topk  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cell(seed, topo_i, replicas):
    rng = np.random.default_rng(seed)
    dp, ep, gpn, spr = TOPOLOGIES[topo_i]
    topo = rp.Topology(dp=dp, ep=ep, gpus_per_node=gpn, slots_per_rank=spr)
    experts = int(rng.integers(max(2, topo.num_slots // 2), topo.num_slots + 1))
    k = int(rng.integers(1, min(3, experts) + 1))
    phy2log = random_phy2log(rng, 1, experts, topo, same_rank_pair=bool(rng.random() < 0.3))
    rows = np.zeros(0, dtype=REPLICA_DTYPE)
    if replicas:
        rows = random_replicas(rng, phy2log, topo, 1, experts)
        rows = rows[(rows["group"] == 0) & (rows["micro"] == 0)]
    ids = [distinct_topk(rng, int(rng.integers(0, 12)), 1, k, experts)[:, 0, :] for _ in range(topo.ep)]
    origin = np.stack([np.bincount(i.reshape(-1), minlength=experts) for i in ids]).astype(np.int64)
    return topo, experts, phy2log[0], rows, ids, origin


def physical_owner(phy2log_row, rows, bufs, topo, per_rank):
    """Megatron expert index → the logical expert it holds for the cell (-1: nothing)."""
    spr = topo.slots_per_rank
    out = np.full(topo.ep * per_rank, -1, dtype=np.int64)
    for p, e in enumerate(phy2log_row.tolist()):
        out[(p // spr) * per_rank + p % spr] = e
    for j, r in enumerate(rows):
        out[int(r["dst_rank"]) * per_rank + spr + int(bufs[j])] = int(r["expert"])
    return out


def run_map(topo, experts, row, rows, ids, origin, r, replica_slots):
    per_rank = topo.slots_per_rank + replica_slots
    bufs = buffer_of(rows, replica_slots, "cell")
    flows = flow_table(origin, row, topo, rows)
    first = _first_copies(row, topo, per_rank, experts)
    bounds, slots = _pack(*_flows_to_table(flows, rows, bufs, topo, per_rank, r, experts), first, True)
    sm = SlotMap(experts, topo.ep * per_rank)
    sm.upload(default_table(row, topo, r, replica_slots, origin), (bounds[None], slots[None]), "cpu")
    sm.micro = 0
    t = ids[r].shape[0]
    rmap = torch.zeros((t, experts), dtype=torch.bool)
    rmap[torch.arange(t).unsqueeze(1), torch.from_numpy(ids[r])] = True
    probs = (torch.rand(t, experts) + 0.1) * rmap
    probs.requires_grad_()
    pp, pm = sm.physical(probs, rmap)
    return flows, bufs, per_rank, probs, rmap, pp, pm


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), topo_i=st.integers(0, len(TOPOLOGIES) - 1), replicas=st.booleans())
def test_slot_map_gives_each_physical_expert_the_flow_tables_pairs(seed, topo_i, replicas):
    topo, experts, row, rows, ids, origin = cell(seed, topo_i, replicas)
    replica_slots = 0
    if len(rows):
        replica_slots = int(max(np.unique(rows["dst_rank"], return_counts=True)[1]))
    for r in range(topo.ep):
        flows, bufs, per_rank, probs, rmap, pp, pm = run_map(topo, experts, row, rows, ids, origin, r, replica_slots)
        owner = physical_owner(row, rows, bufs, topo, per_rank)
        tok, phys = torch.nonzero(pm, as_tuple=True)
        assert torch.equal(pm.sum(1), rmap.sum(1))  # every pair once
        assert all(owner[p] >= 0 for p in phys.tolist())
        for t in range(rmap.shape[0]):  # token t's physical experts hold exactly its logical ones
            got = sorted(owner[phys[tok == t].numpy()].tolist())
            assert got == sorted(ids[r][t].tolist())
        # per physical expert: the flow table's count from this rank
        want = np.zeros(topo.ep * per_rank, dtype=np.int64)
        spr = topo.slots_per_rank
        for f in flows[flows["origin"] == r]:
            d = int(f["dst_rank"])
            p = d * per_rank + (int(f["dst_slot"]) - d * spr if f["dst_slot"] >= 0 else spr + bufs[int(f["replica"])])
            want[p] += int(f["count"])
        assert np.array_equal(pm.sum(0).numpy(), want)
        # probabilities kept, gradients reach the logical ones once per pair
        lt = torch.from_numpy(owner).long()[phys]
        torch.testing.assert_close(pp[tok, phys], probs[tok, lt])
        (pp * pm).sum().backward()  # the dispatcher reads the selected pairs only
        torch.testing.assert_close(probs.grad, rmap.float())


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), topo_i=st.integers(0, len(TOPOLOGIES) - 1))
def test_without_replicas_the_map_is_slot_topk_pair_by_pair(seed, topo_i):
    topo, experts, row, rows, ids, origin = cell(seed, topo_i, False)
    spr = topo.slots_per_rank
    for r in range(topo.ep):
        *_, pm = run_map(topo, experts, row, rows, ids, origin, r, 0)
        want = rm.slot_topk(ids[r], origin, row, topo, r)  # plan slot ids, per (token, j)
        for t in range(ids[r].shape[0]):
            got = set(torch.nonzero(pm[t]).reshape(-1).tolist())
            assert got == {int(s) for s in want[t]}  # replica_slots=0: Megatron index = plan slot
        assert spr == topo.slots_per_rank


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), topo_i=st.integers(0, len(TOPOLOGIES) - 1), extra=st.integers(0, 2))
def test_default_table_keeps_pairs_on_their_experts_placement_copies(seed, topo_i, extra):
    topo, experts, row, _, ids, origin = cell(seed, topo_i, False)
    per_rank = topo.slots_per_rank + extra
    for r in range(topo.ep):
        sm = SlotMap(experts, topo.ep * per_rank)
        sm.upload(default_table(row, topo, r, extra, origin), None, "cpu")
        t = ids[r].shape[0]
        rmap = torch.zeros((t, experts), dtype=torch.bool)
        rmap[torch.arange(t).unsqueeze(1), torch.from_numpy(ids[r])] = True
        pp, pm = sm.physical(rmap.float(), rmap)
        owner = physical_owner(row, np.zeros(0, dtype=REPLICA_DTYPE), np.zeros(0), topo, per_rank)
        tok, phys = torch.nonzero(pm, as_tuple=True)
        assert torch.equal(pm.sum(1), rmap.sum(1))
        for t_ in range(t):
            assert sorted(owner[phys[tok == t_].numpy()].tolist()) == sorted(ids[r][t_].tolist())
        assert all(p % per_rank < topo.slots_per_rank for p in phys.tolist())  # never a replica buffer


def test_a_cell_with_more_copies_than_buffers_is_refused_naming_it():
    rows = np.array([(0, 0, 1, 3, 0, 1, 0.5), (0, 0, 1, 4, 0, 1, 0.5)], dtype=REPLICA_DTYPE)
    assert buffer_of(rows, 2, "x").tolist() == [0, 1]
    with pytest.raises(InvalidPlanError, match=r"\(cell 7\) puts 2 copies on EP rank 1.*replica_slots=1"):
        buffer_of(rows, 1, "(cell 7)")
