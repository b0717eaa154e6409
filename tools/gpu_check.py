#!/usr/bin/env python
"""GPU check of routepack.torch: the self-checks of tests/torch, on NCCL; and the cost model:
`routepack calibrate` and (with >= 2 GPUs) the measured run of `routepack measure` on CUDA.

    python tools/gpu_check.py                 # NCCL, one process per GPU (at most 4)
    python tools/gpu_check.py --shared-gpu    # also try 4 NCCL ranks on one GPU (reported only)
    python tools/gpu_check.py --backend gloo --world 4   # the same script on CPU (dry run)
    python tools/gpu_check.py --cost-only --out DIR      # calibrate (+ measure with >= 2 GPUs) only
    python tools/gpu_check.py --cost-only --device cpu --quick --hidden 64 --expert-ffn 32  # dry run

The cost part (`cost_check`) calibrates the ``--profile`` shapes (default ``flash``: what a
user with an H200 would see) on the device, prints every kernel's held-out
``max_rel_error``, the fitted coefficients and their ratio to the H200 preset, and writes
the cost model, the report and the figure to ``--out``; with two GPUs or more it then runs
the measured run of `routepack measure` on NCCL (one GPU per rank, up to 4 as 2 "nodes" of
2; ``--windows`` windows whose plans migrate experts, hold redundant ones and fill replicas;
static, routepack and eplb_oracle) and prints measured vs predicted steps, the speed-ups and
the per-part profile beside the cost-model terms. On one GPU the measured run is skipped
(NCCL refuses two ranks on one device), as are the links, exchange and migration sweeps.
Its figures are printed, not judged (no pass/fail threshold). Without CUDA the script exits
2 at once (``--backend gloo`` / ``--device cpu`` run its dry forms).

What runs, by world size W (processes, one GPU each):

* W >= 4: exactly the CI checks (2 "nodes" × 2 ranks, Topology(dp=4, ep=4,
  gpus_per_node=2, slots_per_rank=3)): migration + replication + redundant slots over
  several windows against a dense reference, bad plans, faults, a dying rank.
* W = 2: Topology(dp=2, ep=2, gpus_per_node=1): MindSpeed-style replicas only (a
  ReLibra row needs a node mate).
* W = 1 (a one-GPU machine): Topology(dp=1, ep=1, slots_per_rank=12): NCCL collectives of
  world size 1, migration as local slot copies, no replicas (a replica needs another rank);
  it checks the device path: the layer, autograd, Adam state moving with its expert,
  checksums computed on the GPU, bounded waits.

Then the fault sweep of tools/gpu_faults.py (a rank killed at each point of the glue,
restarts from checkpoints, plan agreement; docs/faults.md); ``--no-faults`` skips it.

NCCL does not accept two ranks of one communicator on the same GPU ("Duplicate GPU
detected"); ``--shared-gpu`` tries it anyway and reports the outcome without failing.
The distributed logic (p2p ordering, agreement, rollback between ranks) is covered on any
machine by the gloo tests in tests/torch.

Exit status 0 iff every check passed. Prints one line per figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# the self-checks are the tests' harness (tests/torch/selfcheck), not part of the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "torch"))

import selfcheck as sc  # noqa: E402
from routepack.torch.migrate import checksum  # noqa: E402

TOL = 1e-5


def case_for(world: int) -> sc.Case:
    if world >= 4:
        return sc.Case()
    if world == 2:
        return sc.Case(dp=2, ep=2, gpus_per_node=1, slots_per_rank=5)
    return sc.Case(dp=1, ep=1, gpus_per_node=1, slots_per_rank=12)


def judge_windows(out: dict) -> list:
    bad = []
    for r, f in out.items():
        for key in (
            "out",
            "x_grad",
            "expert_grad",
            "router_grad",
            "static_out",
            "static_expert_grad",
            "trained_vs_static",
            "trained_vs_dense",
            "router_vs_dense",
        ):
            if not f[key] <= TOL:
                bad.append(f"rank {r}: {key} = {f[key]:.3g} > {TOL}")
        for key in ("migration_identical", "copies_identical", "loads_equal", "imbalance_equal"):
            if not f[key]:
                bad.append(f"rank {r}: {key} is False")
    return bad


def judge_faults(out: dict) -> list:
    bad = []
    for r, f in out.items():
        for name, res in f["bad_plans"].items():
            if res["raised"] != "InvalidPlanError" or not res["intact"] or res["transfers"]:
                bad.append(f"rank {r}: bad plan {name}: {res}")
        for point, res in f["faults"].items():
            if res["raised"] != "MigrationError" or not res["intact"]:
                bad.append(f"rank {r}: fault at {point}: {res}")
        c = f["clean"]
        if c["raised"] is not None or not (c["bit_identical"] and c["placement_is_plan"] and c["extra_state_moved"]):
            bad.append(f"rank {r}: clean migration: {c}")
        if not f["broadcast_same"]:
            bad.append(f"rank {r}: broadcast_plan differs")
    return bad


def device_checksum_matches_host() -> list:
    if not torch.cuda.is_available():
        return []
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (3 * 2**20 + 5,), generator=g, dtype=torch.uint8)
    host, dev = checksum(buf), checksum(buf.cuda())
    print(f"checksum host={host} device={dev}")
    return [] if host == dev else [f"checksum differs: host {host}, device {dev}"]


def cost_check(args: argparse.Namespace) -> list:
    """Calibrates on ``args.device`` and, where two devices (GPUs, or a CPU dry run) exist,
    runs the measured comparison; prints the figures, writes them under ``args.out``. Returns
    failures (a step that raised), not judgements of the figures."""
    from pathlib import Path

    from routepack.calibrate import calibrate
    from routepack.measure import Workload, format_table, measure, parts_table

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failures = []
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    # the exchange (an EPMoE layer on every rank) where two GPUs can run it; the CPU dry run skips it
    kernels = (
        ["expert_gemm", "attention"]
        + (["links"] if args.device == "cpu" or gpus >= 2 else [])
        + (["exchange", "migration"] if gpus >= 2 else [])
    )
    t0 = time.time()
    try:
        cal = calibrate(
            args.profile,
            hidden=args.hidden,
            expert_ffn=args.expert_ffn,
            device=args.device,
            quick=args.quick,
            kernels=kernels,
            progress=False,
        )
    except Exception as e:  # noqa: BLE001 (reported)
        return [f"calibrate: {type(e).__name__}: {e}"]
    rep = cal.report
    print(
        f"calibrate {args.profile} on {rep['device'].get('gpu') or rep['device'].get('cpu')} "
        f"({args.device}) in {time.time() - t0:.0f} s"
    )
    for kind, k in rep["kernels"].items():
        err = k["max_rel_error"]
        print(
            f"  {kind}: held-out max_rel_error {'n/a' if err is None else f'{100 * err:.1f}%'}; "
            + ", ".join(f"{n}={v:.3g}" for n, v in k["coefficients"].items())
        )
    print("  vs the h200 preset: " + ", ".join(f"{n} x{v:.3g}" for n, v in rep["preset"]["ratio"].items() if v))
    written = cal.save(out / "cost.json", out / "calibration.json")
    try:
        written.append(cal.plot(out / "calibration.png"))
    except ImportError:
        pass
    print("  wrote " + ", ".join(map(str, written)))
    if args.no_measure:
        print("measure: skipped (--no-measure)")
    elif args.device == "cpu" or gpus >= 2:
        # the measured run of `routepack measure` (README): windows whose plans migrate experts,
        # hold redundant ones and fill replicas, against static and eplb_oracle
        ranks = 2 if args.device == "cpu" else min(gpus, 4)
        work = Workload(
            ranks=ranks,
            nodes=2 if ranks == 4 else 1,
            slots_per_rank=10 if ranks == 2 else 5,
            hidden=args.hidden or 256,
            ffn=args.expert_ffn or 256,
            samples=args.samples,
            windows=args.windows,
        )
        try:
            res = measure(
                work,
                policies=("static", "routepack", "eplb_oracle"),
                quick=args.quick,
                repeats=args.repeats,
                progress=False,
                device=args.device,
            )
        except Exception as e:  # noqa: BLE001 (reported)
            return failures + [f"measure: {type(e).__name__}: {e}"]
        print("\n".join(format_table(res) + parts_table(res)))
        (out / "measure.json").write_text(json.dumps(res.to_dict(), indent=2, default=str))
    else:
        print(f"measure: skipped ({gpus} GPU; the measured run needs one GPU per rank, 2 ranks)")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--world", type=int, default=None, help="processes (default: GPUs, at most 4)")
    ap.add_argument("--shared-gpu", action="store_true", help="also try 4 NCCL ranks on one GPU")
    ap.add_argument("--cost-only", action="store_true", help="only the cost-model part (calibrate, measure)")
    ap.add_argument("--no-cost", action="store_true", help="skip the cost-model part")
    ap.add_argument("--no-faults", action="store_true", help="skip the fault sweep (tools/gpu_faults.py)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the cost part's device")
    ap.add_argument("--profile", default="flash", help="profile whose shapes calibrate measures")
    ap.add_argument("--hidden", type=int, default=None, help="override the profile's hidden size")
    ap.add_argument("--expert-ffn", type=int, default=None, dest="expert_ffn", help="override its expert FFN")
    ap.add_argument("--quick", action="store_true", help="the smoke sweeps (a dry run)")
    ap.add_argument("--samples", type=int, default=48, help="samples of each window of the measured run")
    ap.add_argument("--windows", type=int, default=3, help="windows of the measured run (default 3)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per plan in the measured run")
    ap.add_argument("--out", default="gpu_check_out", help="folder for the cost model, report, figure")
    ap.add_argument("--no-measure", action="store_true", help="calibrate only, no measured run")
    args = ap.parse_args()
    if args.cost_only:
        if args.device == "cuda" and not torch.cuda.is_available():
            print("no CUDA device: use --device cpu for a dry run")
            return 2
        failures = cost_check(args)
        for f in failures:
            print("FAIL", f)
        print("PASS" if not failures else f"{len(failures)} FAILURES")
        return 0 if not failures else 1
    if args.backend == "nccl" and not torch.cuda.is_available():
        print("no CUDA device: use --backend gloo for a dry run")
        return 2
    world = args.world or min(4, max(1, torch.cuda.device_count()))
    case = case_for(world)
    print(
        f"torch {torch.__version__}, cuda {torch.version.cuda}, devices {torch.cuda.device_count()}, "
        f"backend {args.backend}, world {world}, case {case}"
    )
    failures = device_checksum_matches_host()
    t0 = time.time()
    out = sc.run_ranks(sc.check_windows, world, case, backend=args.backend, join_timeout_s=420)
    for r, f in sorted(out.items()):
        print("windows", r, json.dumps({k: v for k, v in f.items() if k not in ("received", "predicted")}))
    failures += judge_windows(out)
    out = sc.run_ranks(sc.check_faults, world, case, backend=args.backend, join_timeout_s=300)
    for r, f in sorted(out.items()):
        print("faults", r, json.dumps(f))
    failures += judge_faults(out)
    if world >= 2:
        out = sc.run_ranks(
            sc.check_peer_death, world, case, backend=args.backend, join_timeout_s=300, may_die=[world - 1]
        )
        for r, f in sorted(out.items()):
            print("peer_death", r, json.dumps(f))
            if f["raised"] != "MigrationError" or not f["intact"]:
                failures.append(f"rank {r}: peer death: {f}")
    # a rank killed at each point of the glue, restarts from checkpoints, plan agreement
    # (tools/gpu_faults.py, docs/faults.md); --no-faults skips it
    if not args.no_faults:
        import gpu_faults

        failures += gpu_faults.run(args.backend, world, case)
    if args.shared_gpu and args.backend == "nccl":
        try:
            sc.run_ranks(sc.check_windows, 4, sc.Case(), backend="nccl_shared", join_timeout_s=300)
            print("shared-gpu: 4 NCCL ranks on one GPU ran")
        except Exception as e:  # noqa: BLE001 (reported, not failed: NCCL normally refuses)
            print(f"shared-gpu: not possible here: {str(e).splitlines()[0][:300]}")
    if not args.no_cost and torch.cuda.is_available():
        failures += cost_check(args)
    print(f"seconds {time.time() - t0:.1f}")
    for f in failures:
        print("FAIL", f)
    print("PASS" if not failures else f"{len(failures)} FAILURES")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
