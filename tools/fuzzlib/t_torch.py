"""Targets of `routepack.torch` on a gloo process group of world size 1 (one EP rank, so
migration is local slot copies and there are no replicas to send; the multi-rank protocol is
the business of tests/torch's gloo tests). Imported only when torch is."""

from __future__ import annotations

import copy
import datetime
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, List

import numpy as np
import routepack as rp

from fuzzlib.engine import Case, Target, hyp_gen, mixed
from fuzzlib.inputs import BAD_INTS, BAD_OBJECTS, mutate_array, pick, spoil_one
from fuzzlib.valid import valid_plan

_PG: List[bool] = []


def ensure_group() -> None:
    """A gloo process group of one rank (once per worker)."""
    import torch.distributed as dist

    if not _PG:
        store = os.path.join(tempfile.mkdtemp(prefix="rp_fuzz_pg_"), "store")
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
        )
        _PG.append(True)


def _with_group(fn: Any) -> Any:
    def call(*a: Any, **k: Any) -> Any:
        ensure_group()
        return fn(*a, **k)

    call.__qualname__ = getattr(fn, "__qualname__", "call")
    return call


#: (target name, function in routepack.torch); the generators are built on first use, so a
#: worker imports torch (seconds) only when it reaches a torch case
NAMES = [
    ("plan_digest", "plan_digest"),
    ("broadcast_plan", "broadcast_plan"),
    ("agree_on_plan", "agree_on_plan"),
    ("gather_ints", "gather_ints"),
    ("expert_counts", "expert_counts"),
    ("flow_table", "flow_table"),
    ("route_tokens", "route_tokens"),
    ("rank_microbatches", "rank_microbatches"),
    ("checksum", "checksum"),
    ("dense_moe", "dense_moe"),
    ("EPMoE", "EPMoE"),
    ("migrate", "migrate"),
]
_GENS: dict = {}


def targets() -> List[Target]:
    """The torch targets, or none (with a line on stderr) when torch is not importable."""
    if importlib.util.find_spec("torch") is None:
        print("routepack.torch left out: torch is not importable", file=sys.stderr)
        return []
    return [Target(f"torch.{name}", f"routepack.torch:{fn}", _lazy(name), weight=1) for name, fn in NAMES]


def _lazy(name: str) -> Any:
    def gen(seed: int, n: int) -> List[Case]:
        if not _GENS:
            _GENS.update(_build())
        return _GENS[name](seed, n)

    return gen


def _build() -> dict:
    import torch
    import routepack.torch as rt

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "torch"))
    from test_torch_remap import cells

    torch.set_num_threads(1)

    # -------------------------------------------------------------- plans across ranks
    def digest_case(rng: np.random.Generator) -> Case:
        pc = valid_plan(rng)
        if rng.random() < 0.3:
            return Case("malformed", rt.plan_digest, (pick(rng, BAD_OBJECTS),), expect="error", names=("plan",))
        other = copy.deepcopy(pc.plan)
        changed = False
        if rng.random() < 0.5 and pc.plan.num_micro > 1:
            other.sample_micro = (other.sample_micro + 1) % other.num_micro
            changed = True

        def check(d: Any) -> None:
            assert isinstance(d, bytes) and len(d) == 32
            assert (rt.plan_digest(other) != d) == changed, "digest does not follow the decisions"

        return Case("valid", rt.plan_digest, (pc.plan,), check=check, expect="ok")

    def broadcast_case(rng: np.random.Generator) -> Case:
        pc = valid_plan(rng)
        call: List[Any] = [pc.plan, 0]
        kind = (
            "valid"
            if spoil_one(rng, call, {0: BAD_OBJECTS, 1: [1, -1, 2**40, None, "0"]}, 0.4) is None
            else "malformed"
        )
        plan, src = call
        return Case(
            kind,
            _with_group(rt.broadcast_plan),
            (plan, src),
            expect="ok" if kind == "valid" else "error",
            check=lambda got: None if got.same_as(pc.plan) else _fail("broadcast changed the plan"),
            names=("plan", "src"),
        )

    def agree_case(rng: np.random.Generator) -> Case:
        pc = valid_plan(rng)
        plan: Any = pc.plan if rng.random() < 0.7 else pick(rng, BAD_OBJECTS)
        return Case(
            "valid" if plan is pc.plan else "malformed",
            _with_group(rt.agree_on_plan),
            (plan,),
            expect="ok" if plan is pc.plan else "error",
            names=("plan",),
        )

    def gather_case(rng: np.random.Generator) -> Case:
        vals: Any = [int(x) for x in rng.integers(-(2**62), 2**62, size=int(rng.integers(1, 4)))]
        kind = "valid"
        if rng.random() < 0.4:
            kind = "malformed"
            vals = pick(rng, [[2**63], [1.5], ["x"], None, [[1]], 3])

        def check(out: Any) -> None:
            assert out.shape == (1, len(vals)) and out[0].tolist() == vals

        return Case(
            kind,
            _with_group(rt.gather_ints),
            (vals,),
            check=check,
            expect="ok" if kind == "valid" else "error",
            names=("values",),
        )

    # -------------------------------------------------------------- routing
    def counts_case(rng: np.random.Generator) -> Case:
        E = int(rng.integers(1, 16))
        ids: Any = rng.integers(0, E, size=(int(rng.integers(0, 20)), int(rng.integers(1, 4))))
        kind, expect = "valid", "ok"
        if rng.random() < 0.4:
            kind, expect = "malformed", None
            label, ids = mutate_array(rng, ids)
            if rng.random() < 0.3:
                E = pick(rng, [0, -1, None, 1.5, "3"])
                expect = "error"

        def check(out: Any) -> None:
            want = np.bincount(np.asarray(ids).astype(np.int64).ravel(), minlength=E)
            assert np.array_equal(out, want) and out.dtype == np.int64

        return Case(kind, rt.expert_counts, (ids, E), check=check, expect=expect, names=("topk_ids", "num_experts"))

    def flow_case(x: Any) -> Case:
        topo, row, ids, reps, e_n, k = x
        origin = np.stack([rt.expert_counts(i, e_n) for i in ids])

        def check(flows: Any) -> None:
            got = np.zeros_like(origin)
            np.add.at(got, (flows["origin"], flows["expert"]), flows["count"])
            assert np.array_equal(got, origin), "flows do not carry every (rank, expert) count"
            slot = flows["dst_slot"] >= 0
            assert (row[flows["dst_slot"][slot]] == flows["expert"][slot]).all(), "a flow into a slot of another expert"

        return Case("valid", rt.flow_table, (origin, row, topo, reps), check=check, expect="ok")

    def route_case(x: Any) -> Case:
        topo, row, ids, reps, e_n, k = x
        origin = np.stack([rt.expert_counts(i, e_n) for i in ids])
        r = 0
        rng = np.random.default_rng(int(origin.sum()) + len(ids))
        args: List[Any] = [ids[r], origin, row, topo, reps, r]
        kind, expect = "valid", "ok"
        if rng.random() < 0.3:
            kind, expect = "malformed", None
            i = int(rng.integers(6))
            if i == 5:
                args[5] = pick(rng, [-1, topo.ep, None, 1.5])
            elif i == 3:
                args[3] = pick(rng, BAD_OBJECTS)
            else:
                args[i] = mutate_array(rng, np.asarray(args[i]))[1] if i != 4 else pick(rng, [None, np.zeros(2)])

        def check(rt_: Any) -> None:
            n = np.asarray(args[0]).size
            assert np.array_equal(np.sort(rt_.send_order), np.arange(n)) and sum(rt_.send_splits) == n
            assert sum(rt_.recv_splits) == rt_.recv_unit.size == rt_.received[r]

        return Case(
            kind,
            rt.route_tokens,
            tuple(args),
            check=check,
            expect=expect,
            names=("topk_ids", "origin", "phy2log_row", "topo", "cell_rows", "ep_rank"),
        )

    def micro_case(rng: np.random.Generator) -> Case:
        pc = valid_plan(rng)
        plan, w = pc.plan, pc.window
        k = int(rng.integers(1, 3))
        cu = np.concatenate([[0], np.cumsum(w.seq_lens)]).astype(np.int64)
        routed: Any = rng.integers(0, w.num_experts, size=(int(cu[-1]), w.num_layers, k)).astype(np.int32)
        rank: Any = int(rng.integers(pc.topo.dp))
        cu_arg: Any = cu
        kind, expect = "valid", "ok"
        if rng.random() < 0.2:
            cu_arg, routed = None, [routed[cu[s] : cu[s + 1]] for s in range(w.num_samples)]
        elif rng.random() < 0.4:
            kind, expect = "malformed", None
            i = int(rng.integers(3))
            if i == 0:
                rank = pick(rng, [-1, pc.topo.dp + 5, None, "0", 1.5])
                expect = "error"
            elif i == 1:
                cu_arg = mutate_array(rng, cu)[1]
            else:
                routed = pick(rng, [None, "x", routed[:-1], routed[..., 0]])
                expect = "error"

        def check(mbs: Any) -> None:
            assert [mb.micro for mb in mbs] == list(range(plan.num_micro))
            for mb in mbs:
                assert np.array_equal(mb.samples, plan.cell_samples(rank, mb.micro))

        return Case(
            kind,
            rt.rank_microbatches,
            (plan, routed, rank, cu_arg),
            check=check,
            expect=expect,
            names=("plan", "routed", "rank", "cu_seqlens"),
        )

    # -------------------------------------------------------------- kernels and layers
    def checksum_case(rng: np.random.Generator) -> Case:
        n = int(rng.choice([0, 1, 7, 4096, 300000]))
        sub = np.random.default_rng(int(rng.integers(2**32)))
        buf: Any = torch.from_numpy(rng.integers(0, 256, size=n, dtype=np.uint8))
        kind = "valid"
        if rng.random() < 0.3:
            kind = "malformed"
            buf = pick(rng, [None, b"abc", torch.zeros(3), torch.zeros((2, 2), dtype=torch.uint8)])

        def check(c: Any) -> None:
            assert buf.dtype == torch.uint8, f"a checksum of a {buf.dtype} tensor, not of a uint8 buffer"
            assert isinstance(c, int) and 0 <= c < 2**63 and rt.checksum(buf.clone()) == c
            if buf.numel():
                flipped = buf.clone().reshape(-1)
                flipped[int(sub.integers(buf.numel()))] ^= 1
                assert rt.checksum(flipped) != c, "a flipped bit left the checksum unchanged"

        return Case(kind, rt.checksum, (buf,), check=check, expect="ok" if kind == "valid" else None, names=("buf",))

    def moe_case(rng: np.random.Generator) -> Case:
        T, H, I, E = int(rng.integers(0, 12)), int(rng.integers(1, 8)), int(rng.integers(1, 6)), int(rng.integers(1, 6))
        k = int(rng.integers(1, E + 1))
        g = torch.Generator().manual_seed(int(rng.integers(2**31)))
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        w1 = torch.randn(E, H, 2 * I, generator=g, dtype=torch.float64)
        w2 = torch.randn(E, I, H, generator=g, dtype=torch.float64)
        ids = torch.from_numpy(np.argsort(rng.random((T, E)), axis=1)[:, :k].copy())
        gw = torch.rand(T, k, generator=g, dtype=torch.float64)
        kind = "valid"
        args: List[Any] = [x, ids, gw, w1, w2]
        if rng.random() < 0.25:
            kind = "malformed"
            args[int(rng.integers(5))] = pick(rng, [None, torch.zeros(1), torch.zeros(T, 99)])

        def check(out: Any) -> None:
            ax, aids, agw, aw1, aw2 = args
            try:  # the reference, from the arguments passed: it fails if their shapes disagree
                want = torch.zeros(ax.shape[0], ax.shape[1], dtype=torch.float64)
                for t in range(ax.shape[0]):
                    for j in range(aids.shape[1]):
                        e = int(aids[t, j])
                        want[t] += agw[t, j] * rt.swiglu(ax[t : t + 1], aw1[e], aw2[e])[0]
            except (RuntimeError, IndexError, AttributeError, TypeError) as e:
                raise AssertionError(f"accepted arguments of inconsistent shapes ({type(e).__name__})") from None
            assert torch.allclose(out, want, rtol=1e-10, atol=1e-10), "dense_moe != the gate-weighted sum"
            if kind != "valid":
                return

            layer = rt.EPMoE(0, E, H, I, rp.Topology(1, 1, 1, E), np.arange(E, dtype=np.int32), dtype=torch.float64)
            layer.load_logical(w1, w2)
            assert torch.allclose(layer(x, ids, gw), want, rtol=1e-9, atol=1e-9), "EPMoE != dense_moe"

        return Case(kind, _with_group(rt.dense_moe), tuple(args), check=check, expect="ok" if kind == "valid" else None)

    def epmoe_case(rng: np.random.Generator) -> Case:
        E, spr = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        spr = max(spr, E)
        row = np.concatenate([rng.permutation(E), rng.integers(-1, E, spr - E)]).astype(np.int32)
        args: List[Any] = [0, E, 4, 3, rp.Topology(1, 1, 1, spr), row]
        kind, expect = "valid", "ok"
        if rng.random() < 0.5:
            kind, expect = "malformed", None
            i = int(rng.integers(6))
            args[i] = (
                pick(rng, BAD_INTS)
                if i < 4
                else (pick(rng, BAD_OBJECTS + [rp.Topology(2, 2, 1, spr)]) if i == 4 else mutate_array(rng, row)[1])
            )

        def check(layer: Any) -> None:
            t, r_ = args[4], np.asarray(args[5])
            assert layer.w1.shape == (t.slots_per_rank, int(args[2]), 2 * int(args[3]))
            assert np.array_equal(layer.phy2log, r_.astype(np.int64)), "phy2log_row changed"

        return Case(
            kind,
            _with_group(rt.EPMoE),
            tuple(args),
            check=check,
            expect=expect,
            names=("layer", "num_experts", "hidden", "ffn", "topo", "phy2log_row", "group"),
        )

    def migrate_case(rng: np.random.Generator) -> Case:
        from random_plans import migration_rows, random_phy2log

        L, E = int(rng.integers(1, 3)), int(rng.integers(1, 6))
        topo = rp.Topology(1, 1, 1, E + int(rng.integers(0, 3)))
        prev = random_phy2log(rng, L, E, topo)
        nxt = random_phy2log(rng, L, E, topo)
        mig = migration_rows(prev, nxt, E, topo.slots_per_rank, 1.0)
        plan = rp.Plan(
            rp.Placement(nxt, E, topo.slots_per_rank), np.zeros(1, np.int32), np.zeros(1, np.int32), 1, migration=mig
        )
        g = torch.Generator().manual_seed(int(rng.integers(2**31)))
        w1, w2 = torch.randn(E, 4, 6, generator=g), torch.randn(E, 3, 4, generator=g)
        tamper = None
        if rng.random() < 0.4 and len(mig):
            tamper = str(rng.choice(["dup", "expert", "slot", "drop"]))
            m = plan.migration.copy()  # plan arrays are read-only: tamper with a copy, then assign it
            if tamper == "dup":
                plan.migration = np.concatenate([m, m[:1]])
            elif tamper == "expert":
                m["expert"][0] = (m["expert"][0] + 1) % E if E > 1 else m["expert"][0]
            elif tamper == "slot":
                m["dst_slot"][0] = topo.num_slots + 3
            if tamper in ("expert", "slot"):
                plan.migration = m
            elif tamper == "drop":
                plan.migration = m[1:]

        def run(_plan: Any) -> Any:
            ensure_group()
            layers = [rt.EPMoE(l, E, 4, 3, topo, prev[l]) for l in range(L)]
            for mod in layers:
                mod.load_logical(w1, w2)
            report = rt.migrate(layers, _plan)
            for l, mod in enumerate(layers):
                assert np.array_equal(mod.phy2log, nxt[l]), "placement not applied"
                for s, e in enumerate(nxt[l].tolist()):
                    if e >= 0:
                        assert torch.equal(mod.w1[s], w1[e]), f"slot {s} of layer {l} does not hold expert {e}"
            return report

        run.__qualname__ = "migrate"
        refuse = tamper in ("dup", "slot") or (tamper == "expert" and E > 1) or tamper == "drop"
        return Case(
            "tampered" if tamper else "valid",
            run,
            (plan,),
            note=tamper or "",
            expect="error" if refuse else "ok",
            names=("migration row", "migration rows", "slot", "plan", "migration"),
        )

    remap = cells()
    return {
        "plan_digest": mixed((1, digest_case)),
        "broadcast_plan": mixed((1, broadcast_case)),
        "agree_on_plan": mixed((1, agree_case)),
        "gather_ints": mixed((1, gather_case)),
        "expert_counts": mixed((1, counts_case)),
        "flow_table": hyp_gen(remap, flow_case),
        "route_tokens": hyp_gen(remap, route_case),
        "rank_microbatches": mixed((1, micro_case)),
        "checksum": mixed((1, checksum_case)),
        "dense_moe": mixed((1, moe_case)),
        "EPMoE": mixed((1, epmoe_case)),
        "migrate": mixed((1, migrate_case)),
    }


def _fail(msg: str) -> None:
    raise AssertionError(msg)
