"""`routepack.torch.plan_window_distributed` and `window_from_ranks` across 2 and 4 gloo
processes (spawned by `routepack.torch.spawn.run_ranks`, every wait bounded).

On `tiny` (synthetic window, seed 0) and a small `flash`-shaped window (flash's 512 experts
top-8 over ep 32 and two EP groups, 6 layers, 1,024 samples), each rank plans with several
policies and returns its plans' digests; the parent plans the same with `plan_window` in one
process: every rank's plan must be byte-identical (digest and `same_as`), and pass validate.
Each rank also assembles a window from its share of routed ids (split unevenly, ranks of
short and long samples), which must equal the window counted from all ids in one process;
and bad arguments on one rank or all (another window, a time budget, no process group, a
group the rank is not in, bad ids) raise `RoutepackError` on every rank instead of hanging.
The encode/decode of the wire format is property-tested in-process (hypothesis).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routepack as rp

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from routepack.torch import window_gather as wg  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402

FLASH_SMALL = replace(
    rp.traces.profile("flash"), name="flash_small", num_layers=6, attention=("linear",) * 5 + ("full",), samples=1024
)
#: (profile, policies): routepack and baselines whose replication is spread (hot_n, relibra),
#: plus one whose replication is not (routepack_no_replication: runs whole on every rank)
CASES = (("tiny", ("routepack", "relibra", "routepack_no_replication")), ("flash_small", ("routepack", "hot_n")))
#: keyword arguments passed through (a stage option and a smaller layout search than the
#: default, to keep the test short: the plans are byte-identical for any move budget)
OPTIONS = {"replication_slots": 3, "anneal_moves": 4000}
#: a token cap 5% of `tiny`'s samples (51 of 1024) are longer than (`oversize`)
OVER_CAP = 12000
#: `tiny`'s topology with context-parallel pairs to split them over
SPLIT_TOPO = rp.Topology(16, 8, 8, 17, replica_slots=3, cp=2)


def _profile(name):
    return FLASH_SMALL if name == "flash_small" else rp.traces.profile(name)


def _windows():
    return {name: next(rp.traces.synthetic(_profile(name), 1, seed=0)) for name, _ in CASES}


def _routed(seed, samples, layers, experts, k):
    """Random top-k ids [T, L, k] (distinct per token and layer) of samples of 1..300 tokens."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 300, size=samples)
    lens[::3] = rng.integers(1, 4, size=len(lens[::3]))  # some very short: their rank may go sparse
    t = int(lens.sum())
    ids = np.argsort(rng.random((t, layers, experts)), axis=-1)[..., :k].astype(np.int16)
    return ids, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def _raises(fn):
    """The error type and message ``fn()`` raises (None if it returns)."""
    try:
        fn()
    except rp.RoutepackError as e:
        return type(e).__name__, str(e)
    return None


def _battery(group, windows, ids, cu):
    """Every check on the ranks of ``group``: the plans' digests, the window from the ranks'
    ids, and each bad argument's error (type, message) on this rank."""
    from routepack.torch import gather_window, plan_window_distributed, window_from_ranks

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = {"digests": {}, "reports": {}}
    for name, policies in CASES:
        prof, w = _profile(name), windows[name]
        for pol in policies:
            plan = plan_window_distributed(
                w, prof.topology(), prof.cost(), token_cap=prof.token_cap, policy=pol, group=group, **OPTIONS
            )
            plan.validate(w, prof.topology(), prof.token_cap)
            out["digests"][name, pol] = plan.digest()
            out["reports"][name, pol] = plan.report["distributed"]
    tiny, prof = windows["tiny"], rp.traces.profile("tiny")
    args = (prof.topology(), prof.cost())

    # routed ids: rank r of the group gets an uneven slice of the samples (rank 0 the fewest)
    cuts = np.array([0] + [int((len(cu) - 1) * ((i + 1) / world) ** 1.5) for i in range(world - 1)] + [len(cu) - 1])
    lo, hi = cuts[rank], cuts[rank + 1]
    mine, my_cu = ids[cu[lo] : cu[hi]], cu[lo : hi + 1] - cu[lo]
    got = window_from_ranks(torch.from_numpy(mine), my_cu, 64, group=group)
    out["window"] = (got.window.seq_lens, got.window.expert_tokens, got.window.top_k)
    out["wire"] = (got.encodings, got.payload_bytes.tolist(), got.raw_id_bytes.tolist(), got.samples.tolist())
    out["window_numpy_equal"] = window_from_ranks(mine, my_cu, 64, group=group).window == got.window

    # bad arguments, each on one rank or all; the group must still work afterwards
    counts = tiny.expert_tokens.copy()  # `expert_tokens` is a read-only int32 copy: edit a copy of it
    counts[5, 2, 7] = max(0, counts[5, 2, 7] - 1)
    other = rp.Window(tiny.seq_lens, counts, tiny.top_k)
    err, g = {}, {"group": group}
    err["other_window"] = _raises(lambda: plan_window_distributed(other if rank == world - 1 else tiny, *args, **g))
    err["other_seed"] = _raises(lambda: plan_window_distributed(tiny, *args, seed=rank % 2, **g))
    err["budget_one"] = _raises(
        lambda: plan_window_distributed(tiny, *args, time_budget_s=5.0 if rank == 0 else None, **g)
    )
    err["budget_all"] = _raises(lambda: plan_window_distributed(tiny, *args, time_budget_s=5.0, **g))
    err["group_not_a_group"] = _raises(lambda: plan_window_distributed(tiny, *args, group="world"))
    err["bad_option_one"] = _raises(
        lambda: plan_window_distributed(tiny, *args, **({"replication_slots": -1} if rank == 1 else {}), **g)
    )
    bad_ids = mine.copy()
    if rank == 0:
        bad_ids[0, 0, 0] = 64  # out of range on rank 0 only
    err["bad_ids_one"] = _raises(lambda: window_from_ranks(bad_ids, my_cu, 64, group=group))
    err["gather_not_a_window"] = _raises(lambda: gather_window("x" if rank == 1 else got.window, group=group))
    # samples over the cap: each mode plans as plan_window does; None and "refuse" are one mode
    over = {}
    for mode in ("alone", "split"):
        topo = SPLIT_TOPO if mode == "split" else args[0]
        plan = plan_window_distributed(tiny, topo, args[1], token_cap=OVER_CAP, oversize=mode, anneal_moves=4000, **g)
        plan.validate(tiny, topo, OVER_CAP)
        over[mode] = plan.digest()
    out["oversize"] = over
    err["oversize_refused"] = _raises(
        lambda: plan_window_distributed(tiny, *args, token_cap=OVER_CAP, oversize=None if rank else "refuse", **g)
    )
    # (under the default cap no sample is over it, so each mode alone would plan)
    err["other_oversize"] = _raises(
        lambda: plan_window_distributed(tiny, *args, oversize="alone" if rank else None, **g)
    )
    out["errors"] = err
    out["alive"] = plan_window_distributed(tiny, *args, policy="hot_n", group=group).digest()
    # an option under its deprecated name on one rank is the same option
    old_name = {"replica_slots": 3} if rank == 0 else {"replication_slots": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        out["old_name"] = plan_window_distributed(
            tiny, *args, token_cap=prof.token_cap, policy="relibra", anneal_moves=4000, group=group, **old_name
        ).digest()
    return out


def _rank(rank, world, device, windows, ids, cu):
    """On 4 processes: the battery on the whole world (4 ranks) and, at the same time, on two
    disjoint pairs {0, 1} and {2, 3} (2 ranks each: what 2 processes do, without a second
    spawn, whose torch imports dominate this test's time); then a group of 3 that rank 3 is
    not in."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    trio = dist.new_group([0, 1, 2])
    out = {"world": _battery(None, windows, ids, cu), "pair": _battery(pairs[rank // 2], windows, ids, cu)}
    from routepack.torch import plan_window_distributed

    prof = rp.traces.profile("tiny")
    if rank < 3:
        out["trio"] = plan_window_distributed(
            windows["tiny"], prof.topology(), prof.cost(), group=trio, anneal_moves=4000
        ).digest()
    else:
        out["trio"] = _raises(
            lambda: plan_window_distributed(windows["tiny"], prof.topology(), prof.cost(), group=trio)
        )
    return out


@pytest.fixture(scope="module")
def inputs():
    ids, cu = _routed(1, 48, 3, 64, 4)
    return _windows(), ids, cu


@pytest.fixture(scope="module")
def reference(inputs):
    windows, ids, cu = inputs
    out = {}
    for name, policies in CASES:
        prof, w = _profile(name), windows[name]
        for pol in policies:
            plan = rp.plan_window(w, prof.topology(), prof.cost(), token_cap=prof.token_cap, policy=pol, **OPTIONS)
            plan.validate(w, prof.topology(), prof.token_cap)
            out[name, pol] = plan
    out["window"] = rp.Window.from_routed_experts(ids, cu, 64)
    tiny, prof = windows["tiny"], rp.traces.profile("tiny")
    out["tiny_routepack"] = rp.plan_window(tiny, prof.topology(), prof.cost(), anneal_moves=4000).digest()
    out["tiny_hot_n"] = rp.plan_window(tiny, prof.topology(), prof.cost(), policy="hot_n").digest()
    for mode in ("alone", "split"):
        topo = SPLIT_TOPO if mode == "split" else prof.topology()
        plan = rp.plan_window(tiny, topo, prof.cost(), token_cap=OVER_CAP, oversize=mode, anneal_moves=4000)
        plan.validate(tiny, topo, OVER_CAP)
        assert plan.report["oversize"]["samples"], mode  # the cap does leave samples over it
        out["oversize", mode] = plan.digest()
    return out


@pytest.fixture(scope="module")
def spawned(inputs):
    return run_ranks(_rank, 4, *inputs, join_timeout_s=240, pg_timeout_s=60)


@pytest.fixture(params=[("world", 4), ("pair", 2)], ids=["4 ranks", "2 ranks"])
def ranks(request, spawned):
    """(group size, [each group's results in group-rank order]): the world, or the two pairs."""
    key, world = request.param
    return world, [[spawned[p][key] for p in range(first, first + world)] for first in range(0, 4, world)]


def _each(groups):
    """(group rank, results) of every process."""
    return [(r, out) for group in groups for r, out in enumerate(group)]


def test_every_rank_returns_plan_windows_plan(ranks, reference):
    world, groups = ranks
    for name, policies in CASES:
        for pol in policies:
            ref = reference[name, pol]
            assert len(ref.replicas) > 0 or pol == "routepack_no_replication"
            for r, out in _each(groups):
                assert out["digests"][name, pol] == ref.digest(), (world, r, name, pol)


def test_replication_was_spread_over_the_ranks(ranks, reference):
    world, groups = ranks
    for name, policies in CASES:
        for pol in policies:
            for group in groups:
                reps = [out["reports"][name, pol] for out in group]
                assert all(rep["ranks"] == world for rep in reps)
                if pol == "routepack_no_replication":
                    assert not any(rep["spread"] for rep in reps)
                    continue
                assert all(rep["spread"] for rep in reps)
                assert sum(reps[0]["replica_rows"]) == len(reference[name, pol].replicas)
                # the blocks tile the exchanges in rank order
                blocks = [rep["exchanges"] for rep in reps]
                assert blocks[0][0] == 0 and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))


def test_window_from_ranks_is_the_window_of_all_ids(ranks, reference):
    world, groups = ranks
    ref = reference["window"]
    for r, out in _each(groups):
        lens, counts, top_k = out["window"]
        assert np.array_equal(lens, ref.seq_lens) and np.array_equal(counts, ref.expert_tokens)
        assert top_k == ref.top_k == 4 and out["window_numpy_equal"]
        encodings, payload, raw, samples = out["wire"]
        assert sum(samples) == ref.num_samples and len(encodings) == world
        assert all(p > 0 for p in payload) and sum(payload) < sum(raw)


@pytest.mark.parametrize(
    "case, message",
    [
        ("other_window", "window: differs between the ranks"),
        ("other_seed", "seed: differs between the ranks"),
        ("other_oversize", "oversize: differs between the ranks"),
        ("budget_all", "time_budget_s: plan_window_distributed plans without a wall-clock cap"),
        ("group_not_a_group", "group: expected a torch.distributed process group"),
    ],
)
def test_bad_arguments_raise_on_every_rank(ranks, case, message):
    world, groups = ranks
    for r, out in _each(groups):
        got = out["errors"][case]
        assert got is not None and message in got[1], (r, got)


@pytest.mark.parametrize(
    "case, culprit, own, peers",
    [
        ("budget_one", 0, "time_budget_s: plan_window_distributed", "rank(s) [0] of the group passed invalid"),
        ("bad_option_one", 1, "replication_slots", "rank(s) [1] of the group passed invalid"),
        ("bad_ids_one", 0, "routed", "local: rank(s) [0] of the group failed"),
        ("gather_not_a_window", 1, "local: expected routepack.Window", "local: rank(s) [1] of the group failed"),
    ],
)
def test_a_bad_argument_on_one_rank_raises_on_every_rank(ranks, case, culprit, own, peers):
    world, groups = ranks
    for r, out in _each(groups):
        got = out["errors"][case]
        assert got is not None, (r, case)
        assert (own if r == culprit else peers) in got[1], (r, got)


def test_samples_over_the_cap_plan_as_plan_window_plans_them(ranks, reference):
    world, groups = ranks
    for r, out in _each(groups):
        for mode, digest in out["oversize"].items():
            assert digest == reference["oversize", mode], (r, mode)
        # None and "refuse" agree: every rank raises the same InfeasibleError naming both ways out
        kind, msg = out["errors"]["oversize_refused"]
        assert kind == "InfeasibleError" and 'oversize="alone"' in msg, (r, msg)


def test_the_group_still_plans_after_every_error(ranks, reference):
    world, groups = ranks
    for r, out in _each(groups):
        assert out["alive"] == reference["tiny_hot_n"], r


def test_an_option_under_its_old_name_agrees_with_its_new_name(ranks, reference):
    world, groups = ranks
    for r, out in _each(groups):
        assert out["old_name"] == reference["tiny", "relibra"].digest(), r


def test_a_group_of_three_plans_alone_and_the_outsider_refuses(spawned, reference):
    for p in range(3):
        assert spawned[p]["trio"] == reference["tiny_routepack"]
    assert "is not a member of the group" in spawned[3]["trio"][1]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(1, 40),
    st.sampled_from([3, 300, 70_000]),
    st.floats(0.0, 1.0),
    st.integers(0, 2**32 - 1),
)
def test_the_wire_format_round_trips_and_is_the_smallest(samples, layers, experts, max_len, density, seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len + 1, size=samples)
    counts = rng.integers(0, lens[:, None, None] + 1, size=(samples, layers, experts))
    counts[rng.random(counts.shape) > density] = 0
    w = rp.Window(lens, counts.astype(np.int32))
    code, payload = wg.encode(w)
    back = wg.decode(code, payload, samples, layers, experts, int(lens.max()))
    assert np.array_equal(back[0], w.seq_lens) and np.array_equal(back[1], w.expert_tokens)
    assert back[1].dtype == np.int32 and back[0].dtype == np.int64
    top = int(counts.max())
    width = 1 if top <= 255 else 2 if top <= 65535 else 4
    nnz = int(np.count_nonzero(counts))
    lens_bytes = samples * (2 if lens.max() <= 65535 else 4)
    assert payload.size == lens_bytes + min(counts.size * width, nnz * (4 + width))
    assert wg.ENCODINGS[code].endswith({1: "uint8", 2: "uint16", 4: "int32"}[width])
