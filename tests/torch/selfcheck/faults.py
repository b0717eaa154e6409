"""`check_faults`, `check_peer_death` and `check_agreement`: bad plans refused before any
transfer, a fault at every protocol point and a rank dying mid-migration all leave every
rank's state intact; plans that differ between ranks, damaged plan files and a rank late to
the plan agreement fail every rank, with one message (see `selfcheck`; killed ranks and the
restart from a checkpoint: `selfcheck.kills`)."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import replace
from typing import Any, Dict, Tuple

import numpy as np
import torch
import torch.distributed as dist

import routepack as rp
from routepack.plan import REPLICA_DTYPE, Placement, Plan
from routepack.torch.broadcast import agree_on_plan, broadcast_plan, digest_int, load_plan, plan_digest
from routepack.torch.migrate import migrate
from selfcheck.case import Case, make_plans, migration_rows
from selfcheck.kills import fresh_model, snapshot, train_window
from selfcheck.model import EPModel, fingerprints


@contextlib.contextmanager
def count_transfers():
    """Counts batched point-to-point exchanges started while inside (``[calls, tensors]``)."""
    seen = [0, 0]
    orig = dist.batch_isend_irecv

    def counting(ops):
        seen[0] += 1
        seen[1] += len(ops)
        return orig(ops)

    dist.batch_isend_irecv = counting
    try:
        yield seen
    finally:
        dist.batch_isend_irecv = orig


def _trained_model(case: Case, device: Any) -> Tuple[EPModel, Plan, rp.Window]:
    """A rebalanced model after window 0 (migrated, one Adam step, so state exists) and the plan
    of window 1 that migrates from it."""
    model = fresh_model(case, device)
    train_window(model, case, 0, device)
    current = Placement(np.stack([mod.phy2log for mod in model.layers]), case.experts, case.slots_per_rank)
    plan1, _, window1, _, _ = make_plans(case, 1, current)
    return model, plan1, window1


def _diverged(case: Case, plan1: Plan, window1: rp.Window, rank: int) -> Tuple[Plan, rp.Window]:
    """(plan, window) of this rank where rank 0 holds another valid plan than the others: the
    same placement and migration, another layout (a window of another seed)."""
    if rank != 0:
        return plan1, window1
    topo = case.topology()
    diverged = make_plans(replace(case, seed=case.seed + 7), 1, Placement.static(case.layers, case.experts, topo))
    plan = Plan(
        plan1.placement,
        diverged[0].sample_rank,
        diverged[0].sample_micro,
        plan1.num_micro,
        np.zeros(0, REPLICA_DTYPE),
        plan1.migration,
    )
    return plan, diverged[2]


def check_faults(rank: int, world: int, device: Any, case: Case = Case()) -> Dict[str, Any]:
    """Bad plans, injected faults at every protocol point, then a clean migration and a plan
    broadcast. Returns, per scenario, the exception type raised here, whether this rank's
    weights/optimizer state/placement are byte-identical to before, and transfers started."""
    model, plan1, window1 = _trained_model(case, device)
    topo = case.topology()
    figs: Dict[str, Any] = {"bad_plans": {}, "faults": {}}
    snap = snapshot(model)

    def attempt(plan: Plan, window: rp.Window, fault: Any = None, extra: Any = None) -> Dict[str, Any]:
        t0 = time.perf_counter()
        message = ""
        with count_transfers() as seen:
            try:
                model.runner.begin_window(plan, window, model.opt, fault=fault, extra_state=extra)
                raised = None
            except Exception as e:  # noqa: BLE001 (the figure is the type)
                raised, message = type(e).__name__, str(e)
        return {
            "raised": raised,
            "message": message if raised else None,
            "intact": snapshot(model) == snap,
            "transfers": seen[1],
            "seconds": time.perf_counter() - t0,
        }

    # bad plans: each must be refused on every rank before any transfer
    # same slot count, another split over ranks (or one slot more per rank when ep is odd)
    other = (
        replace(
            case,
            ep=case.ep // 2,
            slots_per_rank=case.slots_per_rank * 2,
            gpus_per_node=min(case.gpus_per_node, case.ep // 2),
        )
        if case.ep % 2 == 0
        else replace(case, slots_per_rank=case.slots_per_rank + 1)
    )
    figs["bad_plans"]["other_topology"] = attempt(
        *make_plans(other, 1, Placement.static(case.layers, case.experts, other.topology()))[0:3:2]
    )
    # no constructor accepts a placement without a slot for some expert (and plan arrays are
    # read-only): build the bad table anew and put it in a fresh placement's place
    holes = plan1.placement.phy2log.copy()
    only = [s for s in range(topo.num_slots) if (holes[0] == holes[0, s]).sum() == 1]
    holes[0, only[0]] = -1
    missing = Plan(
        Placement(plan1.placement.phy2log, case.experts, case.slots_per_rank),
        plan1.sample_rank,
        plan1.sample_micro,
        plan1.num_micro,
        plan1.replicas,
        plan1.migration,
    )
    missing.placement.phy2log = holes
    figs["bad_plans"]["missing_slot"] = attempt(missing, window1)
    rows = plan1.replicas
    if rows.size == 0:  # ep = 1 plans have no replicas; give the bad share a row to live in
        e = int(plan1.placement.phy2log[0, 0])
        rows = np.array([(0, 0, 0, e, 0, 1 % case.ep, 0.5)], dtype=REPLICA_DTYPE)
    for name, share in (("share_above_one", 1.5), ("share_negative", -0.25)):
        bad_rows = rows.copy()
        bad_rows["share"][0] = share
        bad = Plan(plan1.placement, plan1.sample_rank, plan1.sample_micro, plan1.num_micro, bad_rows, plan1.migration)
        figs["bad_plans"][name] = attempt(bad, window1)
    stale = Plan(
        plan1.placement,
        plan1.sample_rank,
        plan1.sample_micro,
        plan1.num_micro,
        plan1.replicas,
        migration_rows(Placement.static(case.layers, case.experts, topo), plan1.placement),
    )
    figs["bad_plans"]["migration_from_other_placement"] = attempt(stale, window1)
    if world > 1:  # a lone rank has nobody to disagree with
        figs["bad_plans"]["different_plan_on_rank0"] = attempt(*_diverged(case, plan1, window1, rank))

    # a fault on one rank at each point of the protocol
    # the commit fault fires after the failing rank has written its first slot: pick the rank
    # that receives most rows, so a real rollback happens there
    dst_rows = np.bincount(plan1.migration["dst_rank"], minlength=case.ep)
    commit_rank = int(np.argmax(dst_rows))
    figs["commit_fault_rank_rows"] = int(dst_rows[commit_rank])
    for point, bad_rank in (
        ("checked", 0),
        ("packed", 1 % world),
        ("staged", 2 % world),
        ("verified", 3 % world),
        ("commit", commit_rank),
    ):

        def fault(p: str, point: str = point, bad_rank: int = bad_rank) -> None:
            if p == point and rank == bad_rank:
                raise RuntimeError(f"injected fault at {p}")

        figs["faults"][point] = attempt(plan1, window1, fault)

    # then the same migration succeeds, moving bytes unchanged
    # ... with an extra per-slot tensor (as fp32 master weights would be) holding its expert's id
    tags = [
        torch.tensor(mod.local_experts(), dtype=torch.float32, device=device)[:, None].repeat(1, 3)
        for mod in model.layers
    ]
    before = fingerprints(model.layers, model.opt)
    ok = attempt(plan1, window1, extra={l: [t] for l, t in enumerate(tags)})
    after = fingerprints(model.layers, model.opt)
    ok["extra_state_moved"] = all(
        bool((tags[l][s] == e).all())
        for l, mod in enumerate(model.layers)
        for s, e in enumerate(mod.local_experts().tolist())
        if e >= 0
    )
    ok["bit_identical"] = set(before) == set(after) and all(
        after[k] == before[k] and len(before[k]) == 1 for k in before
    )
    ok["placement_is_plan"] = all(
        np.array_equal(mod.phy2log, plan1.placement.phy2log[l]) for l, mod in enumerate(model.layers)
    )
    ok["moved_rows"] = int(plan1.migration.size)
    figs["clean"] = ok

    got = broadcast_plan(plan1 if rank == 0 else None, 0)
    figs["broadcast_same"] = bool(got.same_as(plan1) and plan_digest(got) == plan_digest(plan1))
    return figs


def check_peer_death(rank: int, world: int, device: Any, case: Case = Case(), dead: int = -1) -> Dict[str, Any]:
    """Rank ``dead`` exits (``os._exit``) after staging its transfers; the survivors must raise
    `MigrationError` within the timeout with their state intact."""
    model, plan1, window1 = _trained_model(case, device)
    model.runner.timeout = datetime.timedelta(seconds=10)
    snap = snapshot(model)
    dead = dead % world

    def fault(p: str) -> None:
        if p == "staged" and rank == dead:
            os._exit(3)

    t0 = time.perf_counter()
    try:
        model.runner.begin_window(plan1, window1, model.opt, fault=fault)
        raised = None
    except Exception as e:  # noqa: BLE001
        raised = type(e).__name__
    return {"raised": raised, "intact": snapshot(model) == snap, "seconds": time.perf_counter() - t0}


def _refused(model: EPModel, snap: Any, fn: Any) -> Dict[str, Any]:
    """Runs ``fn``; what it raised (type, message), transfers started, state intact, seconds."""
    t0 = time.perf_counter()
    raised = message = None
    with count_transfers() as seen:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (the figures are the type and the message)
            raised, message = type(e).__name__, str(e)
    return {
        "raised": raised,
        "message": message,
        "transfers": seen[1],
        "intact": snapshot(model) == snap,
        "seconds": time.perf_counter() - t0,
    }


@contextlib.contextmanager
def damaged_broadcasts():
    """Inside, every byte tensor this rank receives by ``dist.broadcast`` (a plan's ``.npz``
    bytes) has 32 bytes in its middle inverted after it arrives."""
    orig = dist.broadcast

    def damaging(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
        work = orig(tensor, src, group=group, async_op=async_op)
        if tensor.dtype == torch.uint8 and tensor.numel() > 64 and dist.get_rank() != src:
            if work is not None:
                work.wait()
            mid = tensor.numel() // 2
            tensor[mid : mid + 32] = 255 - tensor[mid : mid + 32]
        return work

    dist.broadcast = damaging
    try:
        yield
    finally:
        dist.broadcast = orig


def check_agreement(rank: int, world: int, device: Any, case: Case = Case(), folder: str = "") -> Dict[str, Any]:
    """The plan agreement under faults (world >= 2), after window 0 trained:

    * rank 0 holds another plan than the others: `PlanRunner.begin_window`, `migrate` and
      `agree_on_plan` each refuse it on every rank before any transfer, naming both digests
      (this rank's is ``digest``);
    * plan files (rank 0 reads, `load_plan`): a good one arrives on every rank; a damaged one
      and a missing one fail every rank, naming the path; a plan whose bytes arrive damaged
      on rank ``world - 1`` (`broadcast_plan`) fails every rank;
    * last (the group is unusable after it): rank ``world - 1`` enters the agreement of
      `begin_window` after the others' timeout (3 s) ran out: every rank raises
      `AgreementError` with the same message, none hangs.

    ``folder``: a directory every rank can read, for the plan files."""
    model, plan1, window1 = _trained_model(case, device)
    model.runner.timeout = datetime.timedelta(seconds=3)
    timeout = model.runner.timeout
    snap = snapshot(model)
    plan, window = _diverged(case, plan1, window1, rank)
    figs: Dict[str, Any] = {"digest": f"{digest_int(plan):016x}"}
    figs["runner"] = _refused(model, snap, lambda: model.runner.begin_window(plan, window, model.opt))
    figs["migrate"] = _refused(model, snap, lambda: migrate(model.layers, plan, model.opt, timeout=timeout))
    figs["agree_on_plan"] = _refused(model, snap, lambda: agree_on_plan(plan, device=device, timeout=timeout))

    good, damaged = os.path.join(folder, "plan.npz"), os.path.join(folder, "damaged.npz")
    if rank == 0:
        plan1.save(good)
        with open(good, "rb") as f:
            raw = f.read()
        with open(damaged, "wb") as f:
            f.write(raw[: len(raw) // 2])
    figs["load_good"] = bool(load_plan(good, 0, timeout=timeout).same_as(plan1))
    figs["load_damaged"] = _refused(model, snap, lambda: load_plan(damaged, 0, timeout=timeout))
    figs["load_missing"] = _refused(model, snap, lambda: load_plan(damaged + ".gone", 0, timeout=timeout))
    with damaged_broadcasts() if rank == world - 1 else contextlib.nullcontext():
        figs["sent_damaged"] = _refused(
            model, snap, lambda: broadcast_plan(plan1 if rank == 0 else None, 0, timeout=timeout)
        )

    late, flag = world - 1, os.path.join(folder, "late_done")
    if rank == late:
        time.sleep(3 * timeout.total_seconds() + 1)
    figs["timeout"] = _refused(model, snap, lambda: model.runner.begin_window(plan1, window1, model.opt))
    if rank == late:
        open(flag, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:  # stay alive, in no collective
        time.sleep(0.2)
    return figs
