"""routepack.integrations.megatron on CPU, without Megatron-Core: `slot_topk` against
`routepack.torch.route_tokens` (every EP rank's sends and receives, over random placements
with redundant copies, ranks without tokens and experts without tokens), `PlanRouter`'s
physical (probs, routing_map) against the logical ones, and the weight / checkpoint
mappings' round trips. tests/test_integrations_megatron_real.py adds Megatron-Core's own
router and RouterReplay; tools/gpu_megatron.py the whole MoE layer on GPUs."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import routepack as rp  # noqa: E402
from routepack.integrations import megatron as rm  # noqa: E402
from routepack.integrations.megatron.router import PlanRouter  # noqa: E402
from routepack.plan import REPLICA_DTYPE  # noqa: E402
from routepack.torch import route_tokens  # noqa: E402
from random_plans import TOPOLOGIES, random_phy2log  # noqa: E402
from verl_batches import distinct_topk  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NO_REPLICAS = np.zeros(0, dtype=REPLICA_DTYPE)


def random_cell(rng, topo_i):
    dp, ep, gpn, spr = TOPOLOGIES[topo_i]
    topo = rp.Topology(dp=dp, ep=ep, gpus_per_node=gpn, slots_per_rank=spr)
    experts = int(rng.integers(max(2, topo.num_slots // 2), topo.num_slots + 1))
    k = int(rng.integers(1, min(4, experts) + 1))
    row = random_phy2log(rng, 1, experts, topo, same_rank_pair=bool(rng.random() < 0.3))[0]
    ids = [distinct_topk(rng, int(rng.integers(0, 9)), 1, k, experts)[:, 0, :] for _ in range(topo.ep)]
    origin = np.stack([np.bincount(i.reshape(-1), minlength=experts) for i in ids]).astype(np.int64)
    return topo, experts, row, ids, origin


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), topo_i=st.integers(0, len(TOPOLOGIES) - 1))
def test_slot_topk_equals_route_tokens(seed, topo_i):
    rng = np.random.default_rng(seed)
    topo, experts, row, ids, origin = random_cell(rng, topo_i)
    spr = topo.slots_per_rank
    slots = [rm.slot_topk(ids[r], origin, row, topo, r) for r in range(topo.ep)]
    routes = [route_tokens(ids[r], origin, row, topo, NO_REPLICAS, r) for r in range(topo.ep)]
    for r in range(topo.ep):
        s = slots[r]
        assert s.shape == ids[r].shape and s.dtype == np.int64
        assert np.array_equal(row[s], ids[r])  # every pair lands on a copy of its own expert
        assert np.bincount(s.reshape(-1) // spr, minlength=topo.ep).tolist() == routes[r].send_splits
    # what each rank receives, named by local slot, in the order the all-to-all delivers it
    # (by origin rank, each origin's rows in its send order): route_tokens' recv_unit
    for q in range(topo.ep):
        got = []
        for r in range(topo.ep):
            flat = slots[r].reshape(-1)[routes[r].send_order]
            got.extend((flat[flat // spr == q] - q * spr).tolist())
        assert got == routes[q].recv_unit.tolist()
        assert len(got) == routes[0].received[q]


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), topo_i=st.integers(0, len(TOPOLOGIES) - 1))
def test_plan_router_moves_pairs_to_slots_keeping_probs(seed, topo_i):
    """One EP rank (topo.ep = 1 is what a process without a group is): the physical map has
    the pairs `slot_topk` names, with the logical probabilities."""
    rng = np.random.default_rng(seed)
    dp, _, gpn, spr = TOPOLOGIES[topo_i]
    topo = rp.Topology(dp=dp, ep=1, gpus_per_node=gpn, slots_per_rank=spr * 2)
    experts = int(rng.integers(2, topo.num_slots + 1))
    k = int(rng.integers(1, min(3, experts) + 1))
    phy2log = random_phy2log(rng, 2, experts, topo)
    placement = rp.Placement(phy2log, experts, topo.slots_per_rank)
    ids = torch.from_numpy(distinct_topk(rng, int(rng.integers(1, 9)), 1, k, experts)[:, 0, :])
    logical_map = torch.zeros((ids.shape[0], experts), dtype=torch.bool).scatter_(1, ids, True)
    logical_probs = torch.rand(ids.shape[0], experts) * logical_map
    router = PlanRouter(lambda x: (x[0], x[1]), placement, 1, topo)
    probs, rmap = router((logical_probs.requires_grad_(), logical_map))
    assert rmap.shape == (ids.shape[0], topo.num_slots) and rmap.dtype == torch.bool
    assert torch.equal(rmap.sum(1), logical_map.sum(1))
    tok, slot = torch.nonzero(rmap, as_tuple=True)
    logical_of_slot = torch.from_numpy(phy2log[1]).long()[slot]
    for t in range(ids.shape[0]):  # token t's slots hold exactly its k logical experts
        assert sorted(logical_of_slot[tok == t].tolist()) == sorted(ids[t].tolist())
    torch.testing.assert_close(probs[tok, slot], logical_probs[tok, logical_of_slot])
    probs.sum().backward()  # gradients reach the logical probabilities, once per selected pair
    torch.testing.assert_close(logical_probs.grad, logical_map.float())


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), topo_i=st.integers(0, len(TOPOLOGIES) - 1), layers=st.integers(1, 3))
def test_weight_and_checkpoint_mappings_round_trip(seed, topo_i, layers):
    rng = np.random.default_rng(seed)
    dp, ep, gpn, spr = TOPOLOGIES[topo_i]
    topo = rp.Topology(dp=dp, ep=ep, gpus_per_node=gpn, slots_per_rank=spr)
    experts = int(rng.integers(1, topo.num_slots + 1))
    placement = rp.Placement(random_phy2log(rng, layers, experts, topo, same_rank_pair=True), experts, spr)
    assert rm.num_moe_experts(placement) == ep * spr
    local = rm.local_experts(placement)
    assert local.shape == (layers, ep, spr)
    for l in range(layers):
        for r in range(ep):
            for i in range(spr):  # weight{i} on EP rank r: checkpoint name r*n_local + i = slot
                assert local[l, r, i] == placement.phy2log[l, r * spr + i]
        weights = rng.standard_normal((experts, 3))  # a logical checkpoint, E experts
        load = rm.logical_to_checkpoint(placement, l)
        phys = np.full((topo.num_slots, 3), np.nan)
        phys[load >= 0] = weights[load[load >= 0]]  # each slot loads its logical expert
        export = rm.checkpoint_to_logical(placement, l)
        assert np.array_equal(phys[export], weights)  # exported back in logical ids
        assert np.array_equal(load[export], np.arange(experts))


def test_refusals_name_the_argument():
    topo = rp.Topology(dp=2, ep=2, gpus_per_node=2, slots_per_rank=2)
    placement = rp.Placement.static(2, 4, topo)
    ids = np.array([[0, 1]])
    origin = np.array([[1, 1, 0, 0], [0, 0, 0, 0]])
    rows = np.zeros(1, dtype=REPLICA_DTYPE)
    with pytest.raises(rp.RoutepackError, match="cell_rows: 1 intra-batch replicas"):
        rm.slot_topk(ids, origin, placement.phy2log[0], topo, 0, rows)
    with pytest.raises(rp.RoutepackError, match=r"origin\[0\]"):
        rm.slot_topk(ids, origin[::-1], placement.phy2log[0], topo, 0)
    with pytest.raises(rp.RoutepackError, match="layer"):
        rm.checkpoint_to_logical(placement, 2)
    with pytest.raises(rp.RoutepackTypeError, match="placement"):
        rm.local_experts("plan")
    with pytest.raises(rp.RoutepackError, match="ep_group"):
        PlanRouter(lambda x: x, placement, 0, topo)  # no group but topo.ep = 2


def test_gpu_check_fails_fast_without_cuda_and_rehearses_on_cpu():
    """tools/gpu_megatron.py (one GPU, the stock CUDA path) exits at once with status 2 and a
    clear line where CUDA is missing; its CPU rehearsal (tests/megatron_cpu.py's stand-ins, one
    window, no timing) passes every check; its plans re-place redundant copies every window."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("megatron.core")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: run tools/gpu_megatron.py itself")
    tool = Path(__file__).resolve().parent.parent / "tools" / "gpu_megatron.py"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(rp.__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, str(tool)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout, (
        proc.returncode,
        proc.stdout,
        proc.stderr[-2000:],
    )
    proc = subprocess.run(
        [sys.executable, str(tool), "--cpu-standins", "--windows", "1", "--no-timing"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "ALL CHECKS PASSED" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    assert proc.stdout.count("\nok   ") >= 4, proc.stdout
