"""`routepack.torch.migrate(..., optimizer=None)` with migration rows while an optimizer keeps
state for the layers: refused on every rank before anything moves, naming the optimizer and
its state keys, whether the optimizer stepped (issue 31, item 2) or had its state restored by
``load_state_dict`` in a resumed run before its first step (issue 40, finding 1: 7 of 8
checked experts' Adam rows stayed with the old slots), or holds any entry put into its
``state``. ``optimizer=None`` stays valid where no optimizer holds state (a fresh one, or
none), and passing the optimizer moves its state. `PlanRunner.begin_window` requires the
optimizer or ``optimizer_state="none"``, and with ``"none"`` still refuses to migrate while an
optimizer holds state. 2 gloo processes."""

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import numpy as np  # noqa: E402

import routepack as rp  # noqa: E402
import selfcheck as sc  # noqa: E402
from routepack.plan import Placement, Plan  # noqa: E402
from routepack.torch import EPMoE, PlanRunner, migrate  # noqa: E402
from routepack.torch import slot_state  # noqa: E402
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


def _outcome(call):
    try:
        call()
        return "nothing"
    except rp.RoutepackError as e:
        return str(e)


def check_loaded_state(rank, world, device):
    """A resumed run: Adam's state restored with ``load_state_dict``, never stepped here."""
    topo = rp.Topology(world, world, world, SPR)
    rng = np.random.default_rng(5)
    rows = [rng.permutation(np.concatenate([np.arange(E), rng.choice(E, topo.num_slots - E)])) for _ in range(L)]
    start, nxt = Placement.static(L, E, topo), Placement(np.stack(rows).astype(np.int32), E, SPR)
    plan = Plan(
        nxt,
        np.arange(world, dtype=np.int32),
        np.zeros(world, dtype=np.int32),
        1,
        migration=sc.migration_rows(start, nxt),
    )
    window = rp.Window(np.full(world, 2), np.ones((world, L, E), np.int32))

    def layers():
        out = [EPMoE(l, E, H, I, topo, start.phy2log[l]) for l in range(L)]
        g = torch.Generator().manual_seed(0)
        for mod in out:
            mod.load_logical(torch.randn(E, H, 2 * I, generator=g), torch.randn(E, I, H, generator=g))
        return out

    # the state a checkpoint holds: what a first process's Adam had after one step
    first = layers()
    opt0 = torch.optim.Adam([p for m in first for p in (m.w1, m.w2)], lr=0.1)
    for m in first:
        m.w1.grad, m.w2.grad = torch.randn_like(m.w1), torch.randn_like(m.w2)
    opt0.step()
    saved = opt0.state_dict()
    slot_state._STEPPED.discard(opt0)  # as in a fresh process: only the loaded optimizer exists
    del opt0, first

    out = {"moved": int(plan.migration.size)}
    model = layers()
    opt = torch.optim.Adam([p for m in model for p in (m.w1, m.w2)], lr=0.1)
    opt.load_state_dict(saved)
    out["stepped_here"] = opt in slot_state._STEPPED
    before = [(m.w1.detach().clone(), opt.state[m.w1]["exp_avg"].clone(), m.phy2log.copy()) for m in model]

    def intact():
        return all(
            torch.equal(w, m.w1) and torch.equal(a, opt.state[m.w1]["exp_avg"]) and np.array_equal(r, m.phy2log)
            for (w, a, r), m in zip(before, model)
        )

    out["migrate_none"] = _outcome(lambda: migrate(model, plan, None))
    out["intact_after_migrate"] = intact()
    runner = PlanRunner(model, topo)
    out["begin_without"] = _outcome(lambda: runner.begin_window(plan, window))
    out["begin_none"] = _outcome(lambda: runner.begin_window(plan, window, optimizer_state="none"))
    out["intact_after_begin"] = intact()
    out["begin_both"] = _outcome(lambda: runner.begin_window(plan, window, opt, optimizer_state="none"))
    # an entry put into the optimizer's state by hand counts too
    fresh = layers()
    hand = torch.optim.SGD([p for m in fresh for p in (m.w1, m.w2)], lr=0.1, momentum=0.9)
    hand.state[fresh[0].w2]["momentum_buffer"] = torch.zeros_like(fresh[0].w2)
    out["by_hand"] = _outcome(lambda: migrate(fresh, plan, None))
    # with the optimizer, its loaded state moves with the experts
    out["with_optimizer"] = _outcome(lambda: runner.begin_window(plan, window, opt))
    out["moved_with_optimizer"] = all(np.array_equal(m.phy2log, nxt.phy2log[l]) for l, m in enumerate(model))
    return out


def test_state_loaded_into_the_optimizer_is_never_left_behind():
    out = run_ranks(check_loaded_state, 2, join_timeout_s=240, pg_timeout_s=60)
    for rank, f in out.items():
        assert f["moved"] > 0 and not f["stepped_here"], (rank, f)
        for key in ("migrate_none", "begin_none"):
            msg = f[key]
            assert ("optimizer: None, but Adam (state keys" in msg and "stepped or loaded" in msg) or (
                "cannot map" in msg
            ), (rank, key, msg)
        assert f["intact_after_migrate"] and f["intact_after_begin"], (rank, f)
        assert f["begin_without"].startswith("optimizer: None; begin_window needs the optimizer"), f["begin_without"]
        assert "optimizer_state='none'" in f["begin_without"]
        assert f["begin_both"].startswith("optimizer_state: 'none', but optimizer is a Adam"), f["begin_both"]
        assert "SGD (state keys ['momentum_buffer']" in f["by_hand"] or "cannot map" in f["by_hand"], f["by_hand"]
        assert f["with_optimizer"] == "nothing" and f["moved_with_optimizer"], (rank, f)
