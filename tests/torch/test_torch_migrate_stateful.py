"""`routepack.torch.migrate(..., optimizer=None)` with migration rows while an optimizer that has
stepped keeps state for the layers (issue 31, item 2): refused on every rank before anything
moves, naming the optimizer (it used to go through and leave Adam's ``exp_avg`` rows with the
old slots). ``optimizer=None`` stays valid where no optimizer holds state (a fresh one, or
none), and passing the optimizer moves its state. 2 gloo processes."""

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import numpy as np  # noqa: E402

import routepack as rp  # noqa: E402
import selfcheck as sc  # noqa: E402
from routepack.plan import Placement, Plan  # noqa: E402
from routepack.torch import EPMoE, migrate  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402

L, E, H, I, SPR = 2, 4, 4, 2, 3


def check_optimizer_none(rank, world, device):
    topo = rp.Topology(world, world, world, SPR)
    rng = np.random.default_rng(3)
    rows = [rng.permutation(np.concatenate([np.arange(E), rng.choice(E, topo.num_slots - E)])) for _ in range(L)]
    start, nxt = Placement.static(L, E, topo), Placement(np.stack(rows).astype(np.int32), E, SPR)
    plan = Plan(
        nxt,
        np.arange(world, dtype=np.int32),
        np.zeros(world, dtype=np.int32),
        1,
        migration=sc.migration_rows(start, nxt),
    )

    def layers():
        out = [EPMoE(l, E, H, I, topo, start.phy2log[l]) for l in range(L)]
        g = torch.Generator().manual_seed(0)
        for mod in out:
            mod.load_logical(torch.randn(E, H, 2 * I, generator=g), torch.randn(E, I, H, generator=g))
        return out

    out = {"moved": int(plan.migration.size)}
    stepped = layers()
    opt = torch.optim.Adam([p for m in stepped for p in (m.w1, m.w2)], lr=0.1)
    for m in stepped:
        m.w1.grad, m.w2.grad = torch.ones_like(m.w1), torch.ones_like(m.w2)
    opt.step()
    before = [(m.w1.detach().clone(), m.phy2log.copy()) for m in stepped]
    try:
        migrate(stepped, plan, None)
        out["none_after_step"] = "nothing"
    except rp.RoutepackError as e:
        out["none_after_step"] = str(e)
    out["intact"] = all(torch.equal(w, m.w1) and np.array_equal(r, m.phy2log) for (w, r), m in zip(before, stepped))
    # with the optimizer, its state moves; a fresh model with a fresh optimizer may pass None
    migrate(stepped, plan, opt)
    out["moved_with_optimizer"] = all(np.array_equal(m.phy2log, nxt.phy2log[l]) for l, m in enumerate(stepped))
    fresh = layers()
    torch.optim.Adam([p for m in fresh for p in (m.w1, m.w2)], lr=0.1)  # never stepped: no state
    migrate(fresh, plan, None)
    out["fresh_none"] = all(np.array_equal(m.phy2log, nxt.phy2log[l]) for l, m in enumerate(fresh))
    return out


def test_optimizer_none_is_refused_while_a_stepped_optimizer_holds_state():
    out = run_ranks(check_optimizer_none, 2, join_timeout_s=240, pg_timeout_s=60)
    for rank, f in out.items():
        assert f["moved"] > 0
        msg = f["none_after_step"]
        # the rank that cannot map names the optimizer; its peers name the rank
        assert ("optimizer: None, but Adam" in msg and "keeps state" in msg) or "cannot map" in msg, (rank, msg)
        assert f["intact"] and f["moved_with_optimizer"] and f["fresh_none"], (rank, f)
