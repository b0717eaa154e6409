"""A checkpoint round trip keeps placement and weights, and the logical export equals the
unsharded model's experts (issue 16, item 2). 2 gloo processes migrate a model to a
placement with redundant slots and save each rank's ``state_dict``; 2 fresh processes build
the model on the static placement, load, and compare; a checkpoint of the other rank is
refused."""

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import numpy as np  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.plan import Placement, Plan  # noqa: E402
from routepack.torch import EPMoE, export_logical, import_logical, migrate  # noqa: E402
import selfcheck as sc  # noqa: E402

L, E, H, I, SPR = 2, 5, 4, 3, 4


def _setup(world):
    topo = rp.Topology(world, world, world, SPR)
    rng = np.random.default_rng(3)
    rows = [rng.permutation(np.concatenate([np.arange(E), rng.choice(E, topo.num_slots - E)])) for _ in range(L)]
    nxt = Placement(np.stack(rows).astype(np.int32), E, SPR)
    g = torch.Generator().manual_seed(1)
    return topo, nxt, torch.randn(L, E, H, 2 * I, generator=g), torch.randn(L, E, I, H, generator=g)


def save_ranks(rank, world, device, folder):
    topo, nxt, w1, w2 = _setup(world)
    start = Placement.static(L, E, topo)
    layers = torch.nn.ModuleList([EPMoE(l, E, H, I, topo, start.phy2log[l]) for l in range(L)])
    import_logical(layers, list(zip(w1, w2)))
    plan = Plan(
        nxt,
        np.arange(world, dtype=np.int32),
        np.zeros(world, dtype=np.int32),
        1,
        migration=sc.migration_rows(start, nxt),
    )
    migrate(list(layers), plan)
    torch.save(layers.state_dict(), os.path.join(folder, f"rank{rank}.pt"))
    return {"phy2log": [m.phy2log.tolist() for m in layers]}


def load_ranks(rank, world, device, folder):
    topo, nxt, w1, w2 = _setup(world)
    start = Placement.static(L, E, topo)
    layers = torch.nn.ModuleList([EPMoE(l, E, H, I, topo, start.phy2log[l]) for l in range(L)])
    out = {}
    try:  # another rank's checkpoint: refused, naming the field
        layers.load_state_dict(torch.load(os.path.join(folder, f"rank{1 - rank}.pt")))
        out["wrong_rank"] = "nothing"
    except rp.RoutepackError as e:
        out["wrong_rank"] = str(e)
    layers.load_state_dict(torch.load(os.path.join(folder, f"rank{rank}.pt")))
    out["placement_kept"] = all(np.array_equal(m.phy2log, nxt.phy2log[l]) for l, m in enumerate(layers))
    exported = export_logical(layers)
    out["export_equal"] = all(torch.equal(a, w1[l]) and torch.equal(b, w2[l]) for l, (a, b) in enumerate(exported))
    out["slots_equal"] = all(
        torch.equal(m.w1[s], w1[l, e]) and torch.equal(m.w2[s], w2[l, e])
        for l, m in enumerate(layers)
        for s, e in enumerate(m.local_experts().tolist())
        if e >= 0
    )
    out["redundant"] = int(sum(np.bincount(nxt.phy2log[l]).max() > 1 for l in range(L)))
    return out


def test_checkpoint_round_trip_keeps_placement_and_weights(tmp_path):
    saved = sc.run_ranks(save_ranks, 2, str(tmp_path), join_timeout_s=240)
    assert saved[0]["phy2log"] != [list(range(2 * SPR))] * L  # the placement really changed
    out = sc.run_ranks(load_ranks, 2, str(tmp_path), join_timeout_s=240)
    for rank, f in out.items():
        assert f["placement_kept"] and f["slots_equal"] and f["export_equal"], (rank, f)
        assert "'ep_rank'" in f["wrong_rank"], (rank, f["wrong_rank"])
        assert f["redundant"] > 0
