#!/usr/bin/env python
"""Faults in routepack.torch's glue on GPUs (NCCL), and the fault table of docs/faults.md on
any machine.

    python tools/gpu_faults.py                      # NCCL, one process per GPU (2 to 4 GPUs)
    python tools/gpu_faults.py --backend gloo       # the same on CPU: prints docs/faults.md's table
    python tools/gpu_faults.py --points checked,after --backend gloo
    python tools/gpu_faults.py --try-shared         # also try 2 NCCL ranks on one GPU (reported only)
    python tools/gpu_faults.py --backend nccl_shared --world 2   # every rank on GPU 0, where NCCL allows it

What runs, W ranks (W = 4: the tests' case, 2 nodes x 2 ranks; W = 2 or 3:
Topology(dp=W, ep=W, gpus_per_node=1), 5 slots per rank):

1. Per kill point of ``selfcheck.kills.KILL_POINTS``: W processes train window 0 and save a
   checkpoint; in window 1 one rank SIGKILLs itself at that point (`kills.check_kill`). Each
   survivor must raise (never hang), keep its bytes when the kill came before the commit,
   and no checkpoint of window 1 may be marked complete. Under NCCL a survivor blocked where
   routepack sets no bound of its own (the layer's collectives after the migration) is
   aborted by the NCCL watchdog at the process group's timeout (40 s here): it is reported
   as "torn down", a failure a job launcher sees; it never hangs.
2. One fresh group (`kills.check_restart`): the reference run without fault, a restart from
   its step 1, a checkpoint mixing steps (refused), and one restart per killed run from its
   last complete checkpoint; every part of the training state must equal the reference's,
   byte for byte (CUDA: torch's deterministic kernels on).
3. `faults.check_agreement`: plans differing between ranks refused naming both digests,
   damaged and missing plan files, plan bytes damaged on the way, a rank late to the plan
   agreement (every rank raises `AgreementError` with one message).

With one GPU (W = 1) NCCL cannot hold two ranks of one communicator on it ("Duplicate GPU
detected"; ``--try-shared`` tries), so nothing can be killed under NCCL: step 2 runs at W = 1
(checkpoint, restart and migration on CUDA tensors) and the sweep is reported as not run.

`run` is what tools/gpu_check.py calls (it returns the failures). Exit status 0 iff every
check passed; prints the fault table (Markdown) and one line per failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

# the self-checks are the tests' harness (tests/torch/selfcheck), not part of the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "torch"))

import selfcheck as sc  # noqa: E402
from selfcheck import kills  # noqa: E402

#: process-group timeout of the killed runs: NCCL's watchdog tears a blocked survivor down after it
PG_TIMEOUT_S = 40
#: the parts of `kills.state_figures`, as the table names them
PARTS = ("step", "placement", "slots", "logical_weights", "logical_optimizer", "routers", "optimizer")


def case_of(world: int) -> sc.Case:
    """The tests' case at 4 ranks; 5 slots a rank at 2 or 3 (room for every expert and some
    redundant copies); 12 on a single rank."""
    if world >= 4:
        return sc.Case()
    return sc.Case(dp=world, ep=world, gpus_per_node=1, slots_per_rank=5 if world > 1 else 12)


def _differing(got: Dict[str, Any], want: Dict[str, Any]) -> List[str]:
    return [k for k in PARTS if got.get(k) != want.get(k)]


def kill_sweep(
    backend: str, world: int, case: sc.Case, points: Sequence[str], root: str, say: Callable[[str], None]
) -> Dict[str, Dict[str, Any]]:
    """`kills.check_kill` per point: point -> {dead, folder, survivors (rank -> figures), torn_down}."""
    runs = {}
    for point in points:
        dead = kills.dying_rank(point, case)
        folder = os.path.join(root, point)
        t0 = time.time()
        # under NCCL a survivor may be torn down by the watchdog: every rank may go unreported
        may_die = [dead] if backend == "gloo" else list(range(world))
        figs = sc.run_ranks(
            kills.check_kill,
            world,
            case,
            folder,
            point,
            dead,
            backend=backend,
            join_timeout_s=PG_TIMEOUT_S + 200,
            pg_timeout_s=PG_TIMEOUT_S,
            may_die=may_die,
        )
        torn = sorted(set(range(world)) - set(figs) - {dead})
        runs[point] = {"dead": dead, "folder": folder, "survivors": figs, "torn_down": torn}
        say(f"kill {point}: rank {dead} killed, survivors {figs}, torn down {torn}, {time.time() - t0:.1f} s")
    return runs


def judge(runs: Dict[str, Dict[str, Any]], restart: Optional[Dict[int, Any]], world: int) -> List[str]:
    bad = []
    for point, r in runs.items():
        if r["dead"] in r["survivors"]:
            bad.append(f"{point}: rank {r['dead']} was to die and did not")
        for rank, f in r["survivors"].items():
            if rank == r["dead"]:
                continue
            if f["raised"] is None:
                bad.append(f"{point}: survivor {rank} raised nothing")
            if point in kills.BEFORE_COMMIT and not f["intact"]:
                bad.append(f"{point}: survivor {rank} changed its state before any commit")
            if f["complete_steps"] != [1]:
                bad.append(f"{point}: survivor {rank} sees complete checkpoints {f['complete_steps']}")
    if restart is None:
        return bad
    for rank, f in restart.items():
        diff = _differing(f["reference_restarted"], f["reference_step2"])
        if diff:
            bad.append(f"rank {rank}: restart from the reference's step 1 differs in {diff}")
        if world > 1 and not (f["mixed"]["raised"] == "InvalidPlanError" and f["mixed"]["intact"]):
            bad.append(f"rank {rank}: a checkpoint mixing steps was not refused: {f['mixed']}")
        for point, r in runs.items():
            got = f["restarts"][r["folder"]]
            if got["loaded_step"] != 1:
                bad.append(f"{point}: rank {rank} restarted from step {got['loaded_step']}, not 1")
            diff = _differing(got["final"], f["reference_step2"])
            if diff:
                bad.append(f"{point}: rank {rank}'s restart differs from the run without fault in {diff}")
    return bad


def judge_agreement(out: Dict[int, Any], world: int) -> List[str]:
    bad = []
    digests = {f["digest"] for f in out.values()}
    for rank, f in out.items():
        for via in ("runner", "migrate", "agree_on_plan"):
            r = f[via]
            if r["raised"] != "InvalidPlanError" or r["transfers"] or not r["intact"]:
                bad.append(f"rank {rank}: different plans via {via}: {r}")
            elif not all(d in r["message"] for d in digests):
                bad.append(f"rank {rank}: different plans via {via}: digests {digests} not all named: {r['message']}")
        for key in ("load_damaged", "load_missing", "sent_damaged"):
            if f[key]["raised"] is None or not f[key]["intact"]:
                bad.append(f"rank {rank}: {key} not refused: {f[key]}")
        if not f["load_good"]:
            bad.append(f"rank {rank}: a good plan file did not arrive")
    timeouts = {(f["timeout"]["raised"], f["timeout"]["message"]) for f in out.values()}
    if len(timeouts) != 1 or next(iter(timeouts))[0] != "AgreementError":
        bad.append(f"a rank late to the agreement: not one AgreementError message on every rank: {timeouts}")
    return bad


def table(runs: Dict[str, Dict[str, Any]], restart: Optional[Dict[int, Any]]) -> str:
    """The fault table (Markdown): one row per kill point."""
    lines = [
        "| kill point | what had happened when the rank died | killed | survivors raised | survivors' state "
        "| failed after (max s) | complete checkpoints | restart loaded | restart vs run without fault |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for point, r in runs.items():
        surv = {k: v for k, v in r["survivors"].items() if k != r["dead"]}
        raised = sorted({f["raised"] or "nothing" for f in surv.values()})
        if r["torn_down"]:
            raised.append(f"torn down: ranks {r['torn_down']}")
        state = (
            "unchanged"
            if all(f["intact"] for f in surv.values())
            else ("changed (committed)" if point not in kills.BEFORE_COMMIT else "CHANGED")
        )
        secs = max((f["seconds"] for f in surv.values()), default=float("nan"))
        steps = sorted({tuple(f["complete_steps"]) for f in surv.values()})
        loaded = equal = "-"
        if restart is not None:
            got = [f["restarts"][r["folder"]] for f in restart.values()]
            loaded = f"step {sorted({g['loaded_step'] for g in got})}"
            diffs = sorted(
                {k for g, f in zip(got, restart.values()) for k in _differing(g["final"], f["reference_step2"])}
            )
            equal = "byte-equal (all 7 parts)" if not diffs else f"DIFFERS: {diffs}"
        lines.append(
            f"| {point} | {kills.KILL_POINTS[point]} | {r['dead']} | {', '.join(raised)} | {state} | {secs:.1f} "
            f"| {', '.join(str(list(s)) for s in steps)} | {loaded} | {equal} |"
        )
    return "\n".join(lines)


def run(
    backend: str,
    world: int,
    case: sc.Case,
    points: Sequence[str] = tuple(kills.KILL_POINTS),
    say: Callable[[str], None] = print,
) -> List[str]:
    """The whole fault check (module docstring); returns the failures (empty: passed)."""
    old = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS in the children
    root = tempfile.mkdtemp(prefix="routepack-faults-")
    try:
        return _run(backend, world, case, points, root, say)
    finally:  # the caller's later runs (tools/gpu_check.py's timings) keep their own setting
        if old is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        shutil.rmtree(root, ignore_errors=True)


def _run(
    backend: str, world: int, case: sc.Case, points: Sequence[str], root: str, say: Callable[[str], None]
) -> List[str]:
    failures: List[str] = []
    runs: Dict[str, Dict[str, Any]] = {}
    if world >= 2:
        runs = kill_sweep(backend, world, case, points, root, say)
    else:
        say("kill sweep: not run (one rank: nobody survives a kill; NCCL needs one GPU per rank)")
    folders = [r["folder"] for r in runs.values()]
    restart = sc.run_ranks(kills.check_restart, world, case, root, folders, backend=backend, join_timeout_s=600)
    failures += judge(runs, restart, world)
    say("fault table:\n" + table(runs, restart))
    for rank, f in sorted(restart.items()):
        diff = _differing(f["reference_restarted"], f["reference_step2"])
        say(f"rank {rank}: restart from the reference's step 1 differs in {diff}; mixed checkpoint: {f.get('mixed')}")
    if world >= 2:
        out = sc.run_ranks(
            sc.check_agreement, world, case, root, backend=backend, join_timeout_s=300, pg_timeout_s=PG_TIMEOUT_S
        )
        for rank, f in sorted(out.items()):
            say(f"agreement rank {rank}: digest {f['digest']}")
            for key in (
                "runner",
                "migrate",
                "agree_on_plan",
                "load_damaged",
                "load_missing",
                "sent_damaged",
                "timeout",
            ):
                say(f"  {key}: {f[key]['raised']}: {(f[key]['message'] or '')[:300]}")
        failures += judge_agreement(out, world)
    return failures


def _wait_probe(rank: int, world: int, device: Any, seconds: float) -> Dict[str, Any]:
    """A collective that cannot complete within ``seconds`` (queued behind a kernel spinning
    for ``3 * seconds`` on the stream it waits for: a peer that never answers, on one GPU),
    waited for with a timeout as routepack waits; then whether the process still runs CUDA
    work ``8 * seconds`` later (or the watchdog took it down first: no report)."""
    import datetime

    buf = torch.ones(4, device=device)
    torch.distributed.all_reduce(buf)  # the communicator is made now (its set-up would wait for the spin)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3 * seconds * 2e9))  # cycles: 3 * seconds at 2 GHz, longer at lower clocks
    t0 = time.time()
    try:
        torch.distributed.all_reduce(buf, async_op=True).wait(datetime.timedelta(seconds=seconds))
        raised = "nothing (completed)"
    except Exception as e:  # noqa: BLE001 (the figure is what was raised)
        raised = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    waited = time.time() - t0
    time.sleep(8 * seconds)  # the watchdog's turn: does it take the process down?
    alive = float((torch.ones(3, device=device) * 2).sum().item())
    return {"raised": raised, "waited_s": round(waited, 1), "alive_s": round(time.time() - t0, 1), "cuda_after": alive}


def wait_probe(say: Callable[[str], None]) -> None:
    """How a bounded wait ends under NCCL on this torch, under TORCH_NCCL_ASYNC_ERROR_HANDLING
    left unset (torch's default), 2 (clean up only) and 0 (no handling)."""
    old = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    for mode in (None, "2", "0"):
        if mode is None:
            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = mode
        try:
            out = sc.run_ranks(_wait_probe, 1, 2.0, backend="nccl", join_timeout_s=90, pg_timeout_s=60, may_die=[0])
            got = out.get(0, "the process died before reporting (torn down)")
        except Exception as e:  # noqa: BLE001 (reported)
            got = f"run failed: {str(e).splitlines()[0][:200]}"
        say(f"bounded wait, TORCH_NCCL_ASYNC_ERROR_HANDLING={mode or 'unset'}: {got}")
    if old is None:
        os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    else:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = old


def _one_sum(rank: int, world: int, device: Any) -> float:
    t = torch.ones(1, device=device)
    torch.distributed.all_reduce(t)
    return float(t.item())


def try_shared(say: Callable[[str], None]) -> None:
    """Reports whether NCCL runs 2 ranks of one communicator on GPU 0 (it normally refuses)."""
    try:
        out = sc.run_ranks(_one_sum, 2, backend="nccl_shared", join_timeout_s=120, pg_timeout_s=30)
        say(f"shared GPU: 2 NCCL ranks on one GPU ran: {out}")
    except Exception as e:  # noqa: BLE001 (reported: NCCL normally refuses)
        lines = [ln for ln in str(e).splitlines() if "rror" in ln]
        say(f"shared GPU: not possible here: {(lines[-1] if lines else str(e).splitlines()[0])[:300]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo", "nccl_shared"])
    ap.add_argument("--world", type=int, default=None, help="processes (default: GPUs, at most 4; gloo: 4; shared: 2)")
    ap.add_argument("--points", default=",".join(kills.KILL_POINTS), help="kill points, comma-separated")
    ap.add_argument("--try-shared", action="store_true", help="also try 2 NCCL ranks on one GPU")
    ap.add_argument("--wait-probe", action="store_true", help="also probe how a bounded NCCL wait ends (1 GPU)")
    args = ap.parse_args()
    points = [p for p in args.points.split(",") if p]
    unknown = [p for p in points if p not in kills.KILL_POINTS]
    if unknown:
        print(f"--points: unknown {unknown}; known: {list(kills.KILL_POINTS)}")
        return 2
    if args.backend != "gloo" and not torch.cuda.is_available():
        print("no CUDA device: use --backend gloo for a dry run")
        return 2
    world = args.world or {"gloo": 4, "nccl_shared": 2}.get(args.backend, min(4, torch.cuda.device_count()))
    print(
        f"torch {torch.__version__}, cuda {torch.version.cuda}, nccl "
        f"{torch.cuda.nccl.version() if args.backend != 'gloo' else '-'}, backend {args.backend}, world {world}"
    )
    if args.try_shared and args.backend != "gloo":
        try_shared(print)
    if args.wait_probe and args.backend != "gloo":
        wait_probe(print)
    t0 = time.time()
    failures = run(args.backend, world, case_of(world), points)
    print(f"seconds {time.time() - t0:.1f}")
    for f in failures:
        print("FAIL", f)
    print("PASS" if not failures else f"{len(failures)} FAILURES")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
