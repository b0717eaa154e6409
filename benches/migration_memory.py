"""Peak extra memory of a migration on the `tiny` profile, one wave against several (issue 16).

    PYTHONPATH=python python3 benches/migration_memory.py [--seed 0] [--ceiling-gib 1 2 4]

Plans window 0 from the static placement and window 1 from window 0's placement with the
routepack policy, then counts, per EP rank, what `routepack.torch.migrate` holds besides the
live tensors (`routepack.torch.waves.rank_bytes`: a received copy and a backup per received
row, a packed buffer per sent row) at 14 bytes per expert parameter (bf16 weight + fp32
master + Adam's two fp32 moments), for one wave and for each ceiling. Arithmetic on the
plan's rows, not a measurement of an allocator.
"""

from __future__ import annotations

import argparse

import numpy as np

import routepack as rp
from routepack.torch.waves import plan_waves, rank_bytes

GIB = float(1 << 30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ceiling-gib", type=float, nargs="*", default=[1.0, 2.0, 4.0])
    args = ap.parse_args()
    prof = rp.traces.profile("tiny")
    topo, cost = prof.topology(), prof.cost()
    w0, w1 = list(rp.traces.synthetic("tiny", 2, args.seed))
    p0 = rp.plan_window(
        w0, topo, cost, prof.token_cap, previous=rp.Placement.static(prof.num_layers, prof.num_experts, topo)
    )
    p1 = rp.plan_window(w1, topo, cost, prof.token_cap, previous=p0.placement, previous_window=w0)
    rows = p1.migration
    slot = 14 * 3 * prof.hidden * prof.expert_ffn
    sizes = [slot] * prof.num_layers
    per = rank_bytes(rows, sizes, topo.ep)
    into = np.bincount(rows["dst_rank"], minlength=topo.ep)
    print(
        f"tiny: {rows.size} migration rows ({int((rows['src_rank'] != rows['dst_rank']).sum())} cross-rank), "
        f"most into one rank {int(into.max())}; slot {slot / 2**20:.1f} MiB at 14 B/param"
    )
    _, peak = plan_waves(rows, sizes, topo.ep, None)
    print(
        f"one wave (max_bytes_in_flight=None): peak extra {peak / GIB:.2f} GiB on one rank; "
        f"largest single layer {int(per.max()) / GIB:.2f} GiB"
    )
    for c in args.ceiling_gib:
        try:
            waves, peak = plan_waves(rows, sizes, topo.ep, int(c * GIB))
            print(f"max_bytes_in_flight={c:g} GiB: {len(waves)} waves, peak extra {peak / GIB:.2f} GiB")
        except rp.RoutepackError as e:
            print(f"max_bytes_in_flight={c:g} GiB: refused ({e})")


if __name__ == "__main__":
    main()
