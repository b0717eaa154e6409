"""`plan_window_distributed` on gloo processes vs `plan_window` in one (issue 18, item 3).

On `flash` (synthetic window 0, seed 0; generated once and cached as ``.npz``, ~50 s), with
1, 2 and 4 gloo processes (spawned; each loads the window from the cache): the wall time of
``plan_window_distributed`` (the slowest rank, from a barrier) against ``plan_window`` in
this process, whether every rank's plan is byte-identical to it (`Plan.digest`), the
replication stage's seconds (spread over the ranks) and the rest (placement and packing,
run on every rank). Then the window assembly: rank r holds a contiguous share of the samples
and `gather_window` rebuilds the whole window on every rank; printed per rank: the bytes it
put on the wire (its compact histograms + lengths), what its raw routed ids would take
(``T_r · L · k`` int16 ids + int64 offsets; counted, not materialised: flash's ids are
~10 GB), and the wall time of the gather.

    python benches/plan_distributed.py                  # flash, 1 2 4 processes
    python benches/plan_distributed.py --profile tiny --ranks 1 2

Every process runs the core's rayon pool on every core, so more processes than cores
oversubscribe the machine (on 2 cores, 2 and 4 processes compete for them): the wall times
then show the cost of the redundant stages more than the gain of the spread one.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Dict

import numpy as np

import routepack as rp


def window_path(profile: str, cache: str) -> str:
    """The cached window of ``profile`` (generated and saved on first use)."""
    path = os.path.join(cache, f"routepack_{profile}_seed0_window0.npz")
    if not os.path.exists(path):
        t = time.perf_counter()
        w = next(rp.traces.synthetic(rp.traces.profile(profile), 1, seed=0))
        w.save(path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"generated {w} in {time.perf_counter() - t:.1f} s -> {path}", flush=True)
    return path


def bench_rank(rank: int, world: int, device: Any, profile: str, path: str, repeats: int) -> Dict[str, Any]:
    """One rank: plan_window_distributed ``repeats`` times, then gather_window of its share."""
    import torch.distributed as dist

    from routepack.torch import gather_window, plan_window_distributed

    prof, w = rp.traces.profile(profile), rp.Window.load(path)
    best, plan = float("inf"), None
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        plan = plan_window_distributed(w, prof.topology(), prof.cost(), token_cap=prof.token_cap)
        best = min(best, time.perf_counter() - t)
    assert plan is not None
    lo, hi = w.num_samples * rank // world, w.num_samples * (rank + 1) // world
    local = rp.Window(w.seq_lens[lo:hi], w.counts[lo:hi], prof.top_k)
    dist.barrier()
    t = time.perf_counter()
    got = gather_window(local)
    gather_s = time.perf_counter() - t
    return {
        "wall": best,
        "digest": plan.digest(),
        "stages": plan.report["stage_seconds"],
        "agree": plan.report["distributed"]["agree_seconds"],
        "gather_s": gather_s,
        "same_window": got.window == w,
        "encoding": got.encodings[rank],
        "payload": int(got.payload_bytes[rank]),
        "raw": int(got.raw_id_bytes[rank]),
        "sent": got.sent_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="flash", choices=sorted(rp.traces.PROFILES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=2, help="plans per measurement (the best is printed)")
    ap.add_argument("--cache", default="/tmp", help="folder of the cached window")
    args = ap.parse_args()
    from routepack.torch.spawn import run_ranks

    path = window_path(args.profile, args.cache)
    prof, w = rp.traces.profile(args.profile), rp.Window.load(path)
    best, ref = float("inf"), None
    for _ in range(args.repeats):
        t = time.perf_counter()
        ref = rp.plan_window(w, prof.topology(), prof.cost(), token_cap=prof.token_cap)
        best = min(best, time.perf_counter() - t)
    assert ref is not None
    ref.validate(w, prof.topology(), prof.token_cap)
    st = ref.report["stage_seconds"]
    print(
        f"{args.profile}: {w}, {os.cpu_count()} cores; plan_window (routepack, one process): {best:.2f} s "
        f"(placement {st['placement']:.2f}, packing {st['packing']:.2f}, replication {st['replication']:.2f}), "
        f"{len(ref.replicas)} replicas, digest {ref.digest()[:16]}"
    )
    print(
        f"{'ranks':>5} {'wall s':>7} {'vs 1-proc':>9} {'identical':>9} {'repl s':>7} {'place+pack s':>12} "
        f"{'agree s':>7} | {'gather s':>8} {'wire B/rank (mean)':>18} {'raw ids B/rank':>15} {'ratio':>6} "
        f"{'encodings'}"
    )
    for n in args.ranks:
        out = run_ranks(bench_rank, n, args.profile, path, args.repeats, join_timeout_s=1800, pg_timeout_s=900)
        rows = [out[r] for r in range(n)]
        wall = max(r["wall"] for r in rows)
        same = all(r["digest"] == ref.digest() for r in rows) and all(r["same_window"] for r in rows)
        repl = max(r["stages"]["replication"] for r in rows)
        pp = max(r["stages"]["placement"] + r["stages"]["packing"] for r in rows)
        wire = np.mean([r["payload"] for r in rows])
        raw = np.mean([r["raw"] for r in rows])
        enc = ",".join(sorted({r["encoding"] for r in rows}))
        print(
            f"{n:5d} {wall:7.2f} {wall / best:8.2f}x {str(same):>9} {repl:7.2f} {pp:12.2f} "
            f"{max(r['agree'] for r in rows):7.2f} | {max(r['gather_s'] for r in rows):8.2f} {wire:18,.0f} "
            f"{raw:15,.0f} {raw / wire:5.0f}x {enc}",
            flush=True,
        )


if __name__ == "__main__":
    main()
