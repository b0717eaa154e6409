"""The memory-limit targets (issue 33, class 1): calls that would allocate more than the
worker's address-space limit (``--memory-limit-gib``, 8 GiB by default) must be refused with a
`RoutepackError` naming the argument that sized the allocation and the bytes: never an
interpreter abort (Rust's failed allocation), a kill, or a bare ``MemoryError``.

Four families, each sized from the limit (``targets(limit)``), so that whatever the call
allocates first is already more than the limit holds: it fails at once, with no memory
touched, and a case cannot press the machine even where the library were wrong.

* ``memory.<function>``: an argument multiplies a table up (`Placement.static`'s layers or
  slots, `Window.from_routed_experts`' experts, EPLB's replicas, every preset of
  `plan_window` on a topology of huge ``slots_per_rank``): 1.1 to 6 times the limit, and now
  and then past the core's 16 GiB ceiling.
* ``memory.held``: an input the caller holds for free (a broadcast view, no memory behind it)
  given to each public function that takes an array (or a profile sizing its windows): the
  package's copy of it, or its list of the items, is 1.5 to 4 times the limit. (Dtypes that
  the package copies without first scanning the values: a scan of billions of entries takes
  minutes, which is work, not a fault.)
* ``memory.held_window``: a window the caller holds (counts of zero pages, a tenth of the
  limit) given to `simulate` and `plan_window`, whose buffers grow with the window's L x E once
  per exchange (16 bytes an entry): at least 1.6 times the limit in all.

The refusal must name the argument (``Case.require``) and its bytes (``Case.pattern``); a
RoutepackError that does not is ``clean(unnamed)``; anything else is ``other``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Tuple

import numpy as np
import routepack as rp
from routepack import placement, traces

from fuzzlib.engine import Case, Target, mixed

#: a refusal of an allocation states its size
BYTES = r"\d{6,} bytes"
#: the core's ceiling on one table (`sizes::MAX_TABLE_BYTES`)
CEILING = 16 << 30
COST = (1e-9, 1e-9, 1e-6, 10.0, 1e9, 1e8, 1e3, 1e3, 1e3)


def cost_for(L: int) -> rp.CostModel:
    a_lin, c_exp, *rest = COST
    return rp.CostModel(a_lin, [0.0] * L, c_exp, *rest)


def small_window(S: int = 1, L: int = 1, E: int = 1) -> rp.Window:
    return rp.Window(np.full(S, 3), np.ones((S, L, E), np.int32))


def view(shape: Tuple[int, ...], dtype: Any = np.int32, value: Any = 0) -> np.ndarray:
    """A read-only array of ``shape`` with no memory behind it (every entry is ``value``)."""
    return np.broadcast_to(np.array(value, dtype=dtype), shape)


def over(rng: np.random.Generator, limit: int, lo: float = 1.1, hi: float = 6.0) -> int:
    """Bytes between ``lo`` and ``hi`` times the limit, now and then past the ceiling."""
    if rng.random() < 0.15:
        return int(max(CEILING, limit) * rng.uniform(1.05, 4.0))
    return int(limit * rng.uniform(lo, hi))


def refusal(
    fn: Callable[..., Any], args: tuple, kwargs: dict, names: Tuple[str, ...], note: str, setup: Any = None
) -> Case:
    return Case(
        "absurd", fn, args, kwargs, expect="error", note=note, require=names, pattern=BYTES, names=names, setup=setup
    )


# ------------------------------------------------------------------ argument-sized tables
def static_case(limit: int) -> Callable[[np.random.Generator], Case]:
    def make(rng: np.random.Generator) -> Case:
        ep = int(rng.choice([1, 2, 4]))
        b = over(rng, limit)
        if rng.random() < 0.5:  # layers x slots of phy2log alone is b bytes (L < 2**31)
            topo = rp.Topology(ep, ep, ep, int(rng.integers(2, 9)))
            L = min(-(-b // (topo.num_slots * 4)), 2**31 - 1)
            E = int(rng.integers(1, topo.num_slots + 1))
            return refusal(
                rp.Placement.static, (L, E, topo), {}, ("num_layers",), f"{b / 2**30:.1f} GiB of phy2log by layers"
            )
        L = int(rng.integers(1, 5))
        spr = min(-(-b // (L * ep * 4)), (2**31 - 1) // ep)
        topo = rp.Topology(ep, ep, ep, spr)
        E = int(rng.integers(1, 64))
        return refusal(
            rp.Placement.static,
            (L, E, topo),
            {},
            ("topo.slots_per_rank",),
            f"{L * topo.num_slots * 4 / 2**30:.1f} GiB by slots",
        )

    return make


def routed_case(limit: int) -> Callable[[np.random.Generator], Case]:
    def make(rng: np.random.Generator) -> Case:
        E = int(rng.integers(2**29, 2**31))
        b = over(rng, limit)
        cells = max(1, -(-b // E))  # S x L, each count a byte at least
        L = int(rng.integers(1, min(cells, 8) + 1))
        S = -(-cells // L)
        routed = np.zeros((S, L, 1), dtype=rng.choice([np.int32, np.int64]))
        cu = np.arange(S + 1)
        return refusal(rp.Window.from_routed_experts, (routed, cu, E), {}, ("num_experts",), f"counts [{S}, {L}, {E}]")

    return make


def rebalance_case(limit: int) -> Callable[[np.random.Generator], Case]:
    def make(rng: np.random.Generator) -> Case:
        L, E = int(rng.integers(1, 4)), int(rng.choice([4, 8, 16]))
        R = min(-(-over(rng, limit) // (L * 64)), 2**40)
        return refusal(
            placement.rebalance_experts,
            (np.ones((L, E)), R, 1, 1, 1),
            {},
            ("num_replicas",),
            f"{R} replicas of {L} layers",
        )

    return make


def plan_window_case(limit: int) -> Callable[[np.random.Generator], Case]:
    def make(rng: np.random.Generator) -> Case:
        policy = str(rng.choice(sorted(rp.PRESETS)))
        ep = int(rng.choice([1, 2]))
        L = int(rng.integers(1, 4))
        spr = min(-(-over(rng, limit) // (L * ep * 4)), (2**31 - 1) // ep)
        topo = rp.Topology(ep, ep, ep, spr)
        window = small_window(ep * int(rng.integers(1, 3)), L, int(rng.integers(1, 9)))
        kw = {"token_cap": 64, "policy": policy, "previous_window": window}
        return refusal(
            rp.plan_window,
            (window, topo, cost_for(L)),
            kw,
            ("topo.slots_per_rank",),
            f"{policy} on [L, slots] = [{L}, {topo.num_slots}]",
        )

    return make


# ------------------------------------------------------------------ inputs the caller holds
def held_case(limit: int) -> Callable[[np.random.Generator], Case]:
    """Each public function given a free view whose copy (or list) is 1.5-4 x the limit."""

    def make(rng: np.random.Generator) -> Case:
        b = int(limit * rng.uniform(1.5, 4.0))

        def n(itemsize: int, per: int = 1) -> int:
            return -(-b // (itemsize * per))

        plc = rp.Placement.static(1, 1, rp.Topology(1, 1, 1, 1))
        calls: List[Tuple[str, Callable[[], Tuple[Callable[..., Any], tuple]], Tuple[str, ...]]] = [
            (
                # S = 4 samples the caller holds for real; their [4, L, E] counts a view
                "Window(expert_tokens)",
                lambda: (rp.Window, (np.full(4, 10**6), view((4, 64, n(4, 4 * 64)), np.int32))),
                ("expert_tokens",),
            ),
            (
                "Window(seq_lens)",
                lambda: (rp.Window, (view((n(8),), np.int64, 1), view((n(8), 1, 1), np.uint8))),
                ("seq_lens",),
            ),
            (
                "Placement(phy2log)",
                lambda: (rp.Placement, (view((n(4, 2), 2), rng.choice([np.int32, np.int16])), 1, 2)),
                ("phy2log", "placement.phy2log"),
            ),
            (
                "Plan(sample_rank)",
                lambda: (rp.Plan, (plc, view((n(4),), np.int16), view((n(4),), np.int32), 1)),
                ("sample_rank", "sample_micro"),
            ),
            (
                "Window.from_routed_experts(routed)",
                lambda: (rp.Window.from_routed_experts, (view((n(4, 2), 2, 1)), [0, n(4, 2)], 4)),
                ("routed",),
            ),
            (
                "Window.from_slime(per_sample)",
                lambda: (rp.Window.from_slime, ([view((n(4, 2), 2, 1))], 4)),
                ("per_sample",),
            ),
            (
                # the mask's boolean copy (B x T bytes) is the first to fail
                "Window.from_verl(attention_mask)",
                lambda: (
                    rp.Window.from_verl,
                    (view((n(1, 2**15), 2**15, 1, 1), np.int16), view((n(1, 2**15), 2**15), np.bool_, True), 4),
                ),
                ("attention_mask",),
            ),
            (
                "placement.rebalance_experts(weight)",
                lambda: (placement.rebalance_experts, (view((n(8, 2048), 2048), np.float64, 1.0), 2048, 1, 1, 1)),
                ("weight",),
            ),
            (
                "placement.imbalance_lower_bound(loads)",
                lambda: (
                    placement.imbalance_lower_bound,
                    (view((n(8, 64), 64), np.float32, 1.0), rp.Topology(1, 1, 1, 64)),
                ),
                ("loads",),
            ),
            (
                "placement.aggregate_imbalance(loads)",
                lambda: (placement.aggregate_imbalance, (plc, view((n(8), 1), np.int64, 1))),
                ("loads",),
            ),
            (
                "CostModel(a_quad)",
                lambda: (rp.CostModel, (COST[0], view((n(8),), np.float64, 0.0), *COST[1:])),
                ("cost.a_quad", "a_quad"),
            ),
            (
                "traces.synthetic(profile_name)",
                lambda: (
                    lambda p: next(traces.synthetic(p)),
                    # group_size 8: the first array the windows need is one float64 a
                    # prompt, samples / 8 of them
                    (dataclasses.replace(traces.profile("tiny"), samples=8 * n(8)),),
                ),
                ("profile_name",),
            ),
        ]
        label, build, names = calls[int(rng.integers(len(calls)))]
        fn, args = build()
        return refusal(fn, args, {}, names, f"{label}: {b / 2**30:.1f} GiB copied")

    return make


def held_window_case(limit: int) -> Callable[[np.random.Generator], Case]:
    """A window of zero counts (zero pages: a tenth of the limit in address space, no memory)
    whose S microbatches x L x E x 16 bytes of simulate's sums are 1.6 x the limit or more."""

    def make(rng: np.random.Generator) -> Case:
        S = int(rng.choice([128, 256]))
        L = int(rng.choice([64, 128]))
        E = -(-limit // (10 * S * L))
        # (the policies that replicate plan for seconds before the simulation is refused)
        what = str(
            rng.choice(["simulate", "plan_window[static]", "plan_window[eplb_oracle]", "Plan.validate+simulate"])
        )

        def setup() -> Tuple[tuple, dict]:
            w = rp.Window(np.full(S, 4), np.zeros((S, L, E), np.uint8))
            topo = rp.Topology(1, 1, 1, E)
            cost = cost_for(L)
            if what.startswith("plan_window"):
                return (w, topo, cost), {"token_cap": 4, "policy": what[12:-1]}
            plan = rp.Plan(rp.Placement.static(L, E, topo), np.zeros(S, np.int32), np.arange(S, dtype=np.int32), S)
            return (plan, w, topo, cost), ({"token_cap": 4, "validate": True} if "validate" in what else {})

        fn = rp.plan_window if what.startswith("plan_window") else rp.simulate
        return refusal(fn, (), {}, ("window",), f"{what}: a held window [{S}, {L}, {E}] of zero pages", setup=setup)

    return make


def targets(limit: int) -> List[Target]:
    """The family for a worker under an address-space limit of ``limit`` bytes."""
    return [
        Target("memory.Placement.static", rp.Placement.static, mixed((1, static_case(limit))), weight=1, batch=8),
        Target(
            "memory.Window.from_routed_experts",
            rp.Window.from_routed_experts,
            mixed((1, routed_case(limit))),
            weight=1,
            batch=8,
        ),
        Target(
            "memory.placement.rebalance_experts",
            placement.rebalance_experts,
            mixed((1, rebalance_case(limit))),
            weight=1,
            batch=8,
        ),
        Target("memory.plan_window", rp.plan_window, mixed((1, plan_window_case(limit))), weight=2, batch=8),
        Target("memory.held", rp.Window, mixed((1, held_case(limit))), weight=2, batch=8),
        Target("memory.held_window", rp.simulate, mixed((1, held_window_case(limit))), weight=1, batch=4),
    ]
