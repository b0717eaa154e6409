#!/usr/bin/env python
"""GPU check of routepack.torch: the self-checks of tests/torch, on NCCL.

    python tools/gpu_check.py                 # NCCL, one process per GPU (at most 4)
    python tools/gpu_check.py --shared-gpu    # also try 4 NCCL ranks on one GPU (reported only)
    python tools/gpu_check.py --backend gloo --world 4   # the same script on CPU (dry run)

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

import torch

from routepack.torch import selfcheck as sc
from routepack.torch.migrate import checksum

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
        for key in ("out", "x_grad", "expert_grad", "router_grad", "static_out", "static_expert_grad",
                    "trained_vs_static", "trained_vs_dense", "router_vs_dense"):
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--world", type=int, default=None, help="processes (default: GPUs, at most 4)")
    ap.add_argument("--shared-gpu", action="store_true", help="also try 4 NCCL ranks on one GPU")
    args = ap.parse_args()
    if args.backend == "nccl" and not torch.cuda.is_available():
        print("no CUDA device: use --backend gloo for a dry run")
        return 2
    world = args.world or min(4, max(1, torch.cuda.device_count()))
    case = case_for(world)
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, devices {torch.cuda.device_count()}, "
          f"backend {args.backend}, world {world}, case {case}")
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
        out = sc.run_ranks(sc.check_peer_death, world, case, backend=args.backend, join_timeout_s=300,
                           may_die=[world - 1])
        for r, f in sorted(out.items()):
            print("peer_death", r, json.dumps(f))
            if f["raised"] != "MigrationError" or not f["intact"]:
                failures.append(f"rank {r}: peer death: {f}")
    if args.shared_gpu and args.backend == "nccl":
        try:
            sc.run_ranks(sc.check_windows, 4, sc.Case(), backend="nccl_shared", join_timeout_s=300)
            print("shared-gpu: 4 NCCL ranks on one GPU ran")
        except Exception as e:  # noqa: BLE001 (reported, not failed: NCCL normally refuses)
            print(f"shared-gpu: not possible here: {str(e).splitlines()[0][:300]}")
    print(f"seconds {time.time() - t0:.1f}")
    for f in failures:
        print("FAIL", f)
    print("PASS" if not failures else f"{len(failures)} FAILURES")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
