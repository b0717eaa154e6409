"""Independent checks of what the targets return (windows, placements, plans, simulations),
written against docs/design.md rather than the code under test, and the names a plan's
errors may carry."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import routepack as rp

from random_plans import assert_plan_invariants

#: what a plan error may name: the plan's fields and the entries validate describes
PLAN_NAMES = (
    "plan",
    "placement",
    "phy2log",
    "placement.phy2log",
    "sample_rank",
    "sample_micro",
    "num_micro",
    "replicas",
    "migration",
    "report",
    "policy",
    "sample",
    "replica",
    "migration row",
    "layer",
    "slot",
    "expert",
    "cell",
    "microbatch",
    "logcnt",
    "log2phy",
    "window",
    "topo",
    "token_cap",
    "seq_lens",
    "expert_tokens",
    "num_experts",
    "slots_per_rank",
    "other",
)


def check_window(w: Any, seq: Any, tokens: Any) -> None:
    """A returned window: dtypes, shapes, values as given, and docs/design.md's invariants,
    checked in numpy and exact Python ints."""
    assert isinstance(w, rp.Window), f"returned {type(w).__name__}"
    assert w.seq_lens.dtype == np.int64 and w.expert_tokens.dtype == np.int32, "dtypes"
    S = w.seq_lens.shape[0]
    assert w.seq_lens.ndim == 1 and w.expert_tokens.ndim == 3 and w.expert_tokens.shape[0] == S >= 1, "shapes"
    assert (w.seq_lens >= 1).all() and (w.expert_tokens >= 0).all(), "a length < 1 or a negative count"
    if seq is not None:
        assert [int(x) for x in np.asarray(seq, dtype=object).ravel()] == w.seq_lens.tolist(), "seq_lens changed"
    if tokens is not None:
        assert np.array_equal(np.asarray(tokens, dtype=object), w.expert_tokens.astype(object)), "expert_tokens changed"
    over = np.argwhere(w.expert_tokens.astype(np.int64) > w.seq_lens[:, None, None])
    assert over.size == 0, (
        f"accepted a window whose expert count exceeds its sample's length (sample {over[0][0]}, layer {over[0][1]})"
        if over.size
        else ""
    )
    exact = sum(int(x) for x in w.seq_lens.tolist())
    assert w.total_tokens == exact, f"total_tokens = {w.total_tokens}, the lengths sum to {exact}"
    load = w.layer_expert_load()
    assert load.shape == w.expert_tokens.shape[1:] and np.isfinite(load).all()
    assert np.array_equal(load, w.expert_tokens.sum(axis=0, dtype=np.float64))
    assert w == w and repr(w)


def derived_tables(phy2log: np.ndarray, num_experts: int):
    L = phy2log.shape[0]
    logcnt = np.zeros((L, num_experts), dtype=np.int64)
    slots = [[[] for _ in range(num_experts)] for _ in range(L)]
    for l in range(L):
        for p, e in enumerate(phy2log[l].tolist()):
            if e >= 0:
                logcnt[l, e] += 1
                slots[l][e].append(p)
    return logcnt, slots


def check_placement(p: Any, phy2log: Any = None, num_experts: Any = None) -> None:
    assert isinstance(p, rp.Placement), f"returned {type(p).__name__}"
    E = p.num_experts
    if phy2log is not None:
        assert np.array_equal(p.phy2log, np.asarray(phy2log).astype(np.int64)), "phy2log changed"
    assert p.phy2log.dtype == np.int32 and p.phy2log.ndim == 2 and p.num_slots % p.slots_per_rank == 0
    assert ((p.phy2log >= -1) & (p.phy2log < E)).all(), "phy2log entry out of range"
    logcnt, slots = derived_tables(p.phy2log, E)
    assert (logcnt >= 1).all(), "an expert without a slot"
    assert np.array_equal(p.logcnt, logcnt), "logcnt disagrees with phy2log"
    for l in range(p.num_layers):
        for e in range(E):
            got = p.log2phy[l, e]
            assert got[: len(slots[l][e])].tolist() == slots[l][e] and (got[len(slots[l][e]) :] == -1).all(), (
                f"log2phy disagrees with phy2log (layer {l}, expert {e})"
            )


def check_plan(plan: Any, window: Any, topo: Any, cap: int) -> None:
    """docs/design.md's invariants, independently of `Plan.validate`: `assert_plan_invariants`
    (tests/random_plans.py), cell tokens in exact integers, derived placement tables,
    replica sources that host their expert, migration rows without duplicates."""
    assert isinstance(plan, rp.Plan), f"returned {type(plan).__name__}"
    assert_plan_invariants(plan, window, topo, cap)
    M = plan.num_micro
    cells: dict = {}
    for s, (d, m) in enumerate(zip(plan.sample_rank.tolist(), plan.sample_micro.tolist())):
        cells[(d, m)] = cells.get((d, m), 0) + int(window.seq_lens[s])
    assert max(cells.values()) <= cap, f"a row of {max(cells.values())} tokens over the cap {cap}"
    assert len(cells) == topo.dp * M
    check_placement(plan.placement)
    spr = topo.slots_per_rank
    for r in plan.replicas.tolist():
        m, g, l, e, src, dst, share = r
        assert 0 <= m < M and 0 <= g < topo.num_groups and 0 <= l < window.num_layers and 0 <= e < window.num_experts
        assert src != dst and 0 <= dst < topo.ep
        assert e in plan.placement.phy2log[l, src * spr : (src + 1) * spr].tolist(), "replica source does not host it"
    mig = plan.migration
    if len(mig):
        keys = set(zip(mig["layer"].tolist(), mig["dst_slot"].tolist()))
        assert len(keys) == len(mig), "two migration rows fill one slot (a duplicated row)"
        for row in mig.tolist():
            l, e, sr, dr, ss, ds, b = row
            assert plan.placement.phy2log[l, ds] == e and sr == ss // spr and dr == ds // spr
            assert math.isfinite(b) and b >= 0


def check_sim(res: Any, plan: Any, window: Any, topo: Any) -> None:
    assert isinstance(res, rp.SimResult)
    vals = [
        res.step_time,
        res.ideal_time,
        res.lower_bound_time,
        res.attention,
        res.expert,
        res.all_to_all,
        res.replication,
        res.migration,
        res.mean_imbalance,
    ]
    # a step of 0 s (a window with none of the work the cost model prices) has throughput inf
    # and fractions 1 (SimResult's contract); every other figure is finite
    assert math.isfinite(res.step_time) and res.step_time >= 0, f"step {res.step_time}"
    assert res.throughput > 0 and (math.isfinite(res.throughput) or res.step_time == 0), (
        f"step {res.step_time}, throughput {res.throughput}"
    )
    assert (
        math.isfinite(res.ideal_time)
        and res.ideal_time >= 0
        and res.ideal_throughput > 0
        and (math.isfinite(res.ideal_throughput) or res.ideal_time == 0)
    ), f"ideal {res.ideal_time}, {res.ideal_throughput}"
    assert all(math.isfinite(v) for v in vals), f"a non-finite time {vals}"
    # SimResult's contract: the parts minus the hidden all-to-all add up to step_time
    parts = sum(res.breakdown().values()) - res.hidden
    assert abs(parts - res.step_time) <= 1e-9 * res.step_time + 1e-300, "the parts do not add up to step_time"
    # a bound as computed (issue 33: the bound's rounding margin): no tolerance
    assert res.lower_bound_time <= res.step_time, (
        f"lower bound {res.lower_bound_time!r} above the step {res.step_time!r}"
    )
    exact = sum(int(x) for x in window.seq_lens.tolist())
    assert (
        res.throughput == math.inf
        if res.step_time == 0
        else math.isclose(res.throughput, exact / res.step_time, rel_tol=1e-9)
    ), "throughput != tokens / step"
    assert res.group_times.shape == (topo.num_groups,), "group_times shape"
    # step_time: the slowest group plus the exposed migration and the once-a-step sum of the
    # redundant experts' gradients (which no group hides)
    assert math.isclose(res.group_times.max() + res.migration + res.redundant_grads, res.step_time, rel_tol=1e-9), (
        "step_time != slowest group + migration + redundant_grads"
    )
    assert 0 <= res.critical_group < topo.num_groups and res.group_times[res.critical_group] == res.group_times.max()
    assert res.imbalance.shape == (topo.num_groups, plan.num_micro, window.num_layers)
    assert (res.imbalance >= 1 - 1e-9).all() and (res.imbalance <= topo.ep + 1e-9).all(), "imbalance out of [1, ep]"
    assert 0 <= res.fraction_of_bound <= 1 and res.summary() and res.breakdown()
    # 0 only where the bound is 0 and the plan is not; 1 for a step of 0 s
    assert res.fraction_of_bound > 0 or (res.lower_bound_time == 0 and res.step_time > 0), "fraction_of_bound 0"
    assert res.step_time > 0 or (res.fraction_of_bound == 1 and res.fraction_of_balanced == 1)
