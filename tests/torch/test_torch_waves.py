"""Migration in waves of a few layers under ``max_bytes_in_flight`` (issue 16, item 2):
the figures of `routepack.torch.waves` on random migrations (no processes), and on 2 gloo
processes a migration in waves that moves every expert's bytes exactly like the one-wave
migration, and a ceiling below one layer's need refused on every rank before anything
moves."""

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import numpy as np  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.plan import Placement, Plan  # noqa: E402
from routepack.torch import EPMoE, migrate  # noqa: E402
from routepack.torch.migrate import MigrationReport  # noqa: E402
import selfcheck as sc  # noqa: E402
from routepack.torch.waves import plan_waves, rank_bytes  # noqa: E402

L, E, H, I, SPR = 4, 4, 4, 2, 3


def _plans(world, seed=5):
    topo = rp.Topology(world, world, world, SPR)
    rng = np.random.default_rng(seed)
    rows = [rng.permutation(np.concatenate([np.arange(E), rng.choice(E, topo.num_slots - E)])) for _ in range(L)]
    start = Placement.static(L, E, topo)
    nxt = Placement(np.stack(rows).astype(np.int32), E, SPR)
    return (
        topo,
        start,
        Plan(
            nxt,
            np.arange(world, dtype=np.int32),
            np.zeros(world, dtype=np.int32),
            1,
            migration=sc.migration_rows(start, nxt),
        ),
    )


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ep=st.integers(2, 4), ceiling_frac=st.floats(0.0, 1.0))
def test_waves_cover_every_row_once_and_respect_the_ceiling(seed, ep, ceiling_frac):
    _, _, plan = _plans(ep, seed)
    rows = plan.migration
    sizes = np.random.default_rng(seed).integers(1, 100, L)
    per = rank_bytes(rows, sizes, ep)
    lo, hi = int(per.max(initial=0)), int(per.sum(axis=0).max(initial=0))
    ceiling = max(1, lo + int(ceiling_frac * (hi - lo)))
    waves, peak = plan_waves(rows, sizes, ep, ceiling)
    assert sorted(i for _, idx in waves for i in idx) == list(range(rows.size))
    assert peak <= ceiling and all(int(per[ls].sum(axis=0).max(initial=0)) <= ceiling for ls, _ in waves)
    one, peak_one = plan_waves(rows, sizes, ep, None)
    assert len(one) == 1 and peak_one == hi and peak <= peak_one
    if lo > 1:
        with pytest.raises(rp.RoutepackError, match="max_bytes_in_flight"):
            plan_waves(rows, sizes, ep, lo - 1)


def check_waves(rank, world, device):
    topo, start, plan = _plans(world)
    g = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(L, E, H, 2 * I, generator=g), torch.randn(L, E, I, H, generator=g)
    out = {}
    results = {}
    for name, ceiling in (("one", None), ("waves", "min"), ("too_small", 1)):
        layers = [EPMoE(l, E, H, I, topo, start.phy2log[l]) for l in range(L)]
        for l, m in enumerate(layers):
            m.load_logical(w1[l], w2[l])
        opt = torch.optim.Adam([p for m in layers for p in (m.w1, m.w2)])
        for m in layers:
            m.w1.grad, m.w2.grad = torch.ones_like(m.w1), torch.ones_like(m.w2)
        opt.step()
        before = sc.fingerprints(layers, opt)
        if ceiling == "min":
            sizes = [m.w1[0].numel() * 4 * 3 + m.w2[0].numel() * 4 * 3 for m in layers]  # weights + 2 Adam tensors
            ceiling = int(rank_bytes(plan.migration, sizes, world).max())
        try:
            rep = migrate(layers, plan, opt, max_bytes_in_flight=ceiling)
            results[name] = (rep.waves, rep.peak_bytes)
        except rp.RoutepackError as e:
            results[name] = str(e)
        after = sc.fingerprints(layers, opt)
        out[name + "_identical"] = set(after) == set(before) and all(after[k] == before[k] for k in before)
        out[name + "_placement"] = [m.phy2log.tolist() for m in layers]
    out["results"] = results
    out["plan"] = plan.placement.phy2log.tolist()
    out["start"] = start.phy2log.tolist()
    return out


def test_migration_in_waves_moves_the_same_bytes_and_a_too_small_ceiling_is_refused():
    out = sc.run_ranks(check_waves, 2, join_timeout_s=240)
    for rank, f in out.items():
        r = f["results"]
        assert r["one"][0] == 1 and r["waves"][0] > 1 and r["waves"][1] < r["one"][1], (rank, r)
        assert f["one_identical"] and f["waves_identical"], rank
        assert f["one_placement"] == f["plan"] and f["waves_placement"] == f["plan"], rank
        assert "max_bytes_in_flight" in r["too_small"] and f["too_small_placement"] == f["start"], (rank, r)


def test_the_old_names_of_the_waves_still_work_with_a_warning():
    """``routepack.torch.staging`` / ``plan_stages`` and ``MigrationReport.stages`` are the old
    names of `routepack.torch.waves` / ``plan_waves`` and ``MigrationReport.waves``."""
    import importlib
    import sys

    _, _, plan = _plans(2)
    sizes = [10] * L
    sys.modules.pop("routepack.torch.staging", None)
    with pytest.warns(DeprecationWarning, match="routepack.torch.waves"):
        staging = importlib.import_module("routepack.torch.staging")
    with pytest.warns(DeprecationWarning, match="plan_waves"):
        assert staging.plan_stages(plan.migration, sizes, 2, None) == plan_waves(plan.migration, sizes, 2, None)
    rep = MigrationReport(1, 2, 3, 0, 0.5, waves=4, peak_bytes=5)
    with pytest.warns(DeprecationWarning, match="MigrationReport.waves"):
        assert rep.stages == 4
