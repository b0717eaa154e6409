"""One checked request across the seam (issue 39, item 4): `plan_window` checks its arguments
once (`routepack.planner.plan_request`) and hands the stages that checked context, which they
take without checking it again; the final validation and simulate go to the core in one call
with the checked arguments. Counted here by watching the checkers run: the one check of a token
cap (`routepack._checks.token_cap`, and any `positive_int` named ``token_cap``), the context's
full check (`PlanContext.check`) and the check that the window can fill the cells.

Before this, one `plan_window` call checked ``token_cap`` 7 times in Python (`PlanContext.check`
4 times through `stage_context`, `check_fills_cells` twice, `simulate` once) before the core's
own."""

from __future__ import annotations

import dataclasses
import sys
from contextlib import contextmanager
from typing import Dict, Iterator

import pytest

import routepack as rp
from routepack import _checks
from routepack.stages import context as stage_context_module
from routepack.stages.context import PlanContext
from routepack.stages.options import NoOptions

PROFILE = dataclasses.replace(rp.traces.profile("tiny"), samples=64)
WINDOW = next(iter(rp.traces.synthetic(PROFILE, 1, 0)))
TOPO, COST, CAP = PROFILE.topology(), PROFILE.cost(), PROFILE.token_cap


@contextmanager
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Dict[str, int]]:
    """Counts, while the block runs: ``token_cap`` (the cap checker's calls, by its code object,
    whatever name a module imported it under), ``positive_int token_cap`` (every int check named
    ``token_cap``: the checker's and any other), ``context`` (full `PlanContext.check` runs) and
    ``fills`` (runs of the check that the window fills the cells)."""
    n = {"token_cap": 0, "positive_int token_cap": 0, "context": 0, "fills": 0}
    cap_code, int_code = _checks.token_cap.__code__, _checks.positive_int.__code__

    def profile(frame, event, arg):  # noqa: ARG001 (sys.setprofile's signature)
        if event == "call":
            if frame.f_code is cap_code:
                n["token_cap"] += 1
            elif frame.f_code is int_code and frame.f_locals.get("name") == "token_cap":
                n["positive_int token_cap"] += 1

    check, fills = PlanContext.check, stage_context_module._check_fills_cells

    def counting_check(self):
        n["context"] += 1
        return check(self)

    def counting_fills(ctx):
        n["fills"] += 1
        return fills(ctx)

    monkeypatch.setattr(PlanContext, "check", counting_check)
    monkeypatch.setattr(stage_context_module, "_check_fills_cells", counting_fills)
    sys.setprofile(profile)
    try:
        yield n
    finally:
        sys.setprofile(None)


@pytest.mark.parametrize(
    "policy", ["routepack", "static", "eplb_oracle", "hot_n", "relibra", "routepack_no_replication"]
)
def test_token_cap_is_checked_once_per_plan_window_call(monkeypatch, policy):
    with counted(monkeypatch) as n:
        plan = rp.plan_window(WINDOW, TOPO, COST, CAP, policy=policy, anneal_moves=2000)
    plan.validate(WINDOW, TOPO, CAP)
    # the cap checker ran once, and no other int check named token_cap ran beside it
    assert n == {"token_cap": 1, "positive_int token_cap": 1, "context": 1, "fills": 1}, n


def test_the_cap_is_checked_once_under_the_modes_for_samples_over_it(monkeypatch):
    """``oversize="alone"`` and ``"split"`` (replication on the pieces' window, a context
    derived from the checked one) check the request once too."""
    window = rp.Window(WINDOW.seq_lens.copy(), WINDOW.counts)
    cap = int(window.seq_lens.max()) - 1  # the longest sample is over the cap
    topo = dataclasses.replace(TOPO, cp=2)
    for mode in ("alone", "split"):
        with counted(monkeypatch) as n:
            plan = rp.plan_window(window, topo, COST, cap, policy="routepack", oversize=mode, anneal_moves=2000)
        plan.validate(window, topo, cap, oversize=mode)
        assert n == {"token_cap": 1, "positive_int token_cap": 1, "context": 1, "fills": 1}, (mode, n)


def test_a_stage_called_directly_checks_its_context_and_a_changed_one_again(monkeypatch):
    """Checked once is not unchecked: a context a caller builds is checked by the first stage it
    reaches, and one changed after its check is checked again (the change is named)."""
    ctx = PlanContext(WINDOW, TOPO, COST, CAP)
    with counted(monkeypatch) as n:
        rp.stages.static_placement(ctx, NoOptions())
        rp.stages.static_placement(ctx, NoOptions())
    assert n["context"] == 1 and n["token_cap"] == 1, n
    assert ctx.checked
    ctx.token_cap = 0
    assert not ctx.checked
    with pytest.raises(rp.RoutepackError, match="token_cap: must be >= 1, got 0"):
        rp.stages.static_placement(ctx, NoOptions())
    ctx.token_cap = CAP
    ctx.window = rp.Window(WINDOW.seq_lens, WINDOW.counts[:, :, :-1].copy())  # one expert fewer
    with pytest.raises(rp.RoutepackError, match="cost"):
        rp.stages.static_placement(ctx, NoOptions())
    # a derived context is checked only where its parent was
    fresh = PlanContext(WINDOW, TOPO, COST, CAP)
    assert not fresh.derived(window=WINDOW).checked
    assert fresh.check().derived(window=WINDOW).checked


def test_the_request_is_what_plan_window_plans(monkeypatch):
    """`plan_request` + `plan_stages` is `plan_window`, byte for byte."""
    from routepack.planner import plan_request, plan_stages, run_replication

    args = (WINDOW, TOPO, COST, CAP, "routepack", None, None, 3, 2000, None, None, {"placement_chunks": 8})
    request = plan_request(*args, stacklevel=2)
    assert request.ctx.checked and request.name == "routepack"
    direct = rp.plan_window(WINDOW, TOPO, COST, CAP, seed=3, anneal_moves=2000, placement_chunks=8)
    assert plan_stages(request, run_replication).digest() == direct.digest()
