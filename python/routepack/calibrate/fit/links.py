"""The links' fit (`fit_links`): latency + bytes / bandwidth per collective op."""

from __future__ import annotations

from typing import Any, Dict, Mapping

import numpy as np

from routepack.calibrate.fit.common import KernelFit, linear_fit, points
from routepack.errors import RoutepackError
from routepack.model import ModelShape

LINK_OPS = ("p2p", "all_to_all", "all_reduce")


def fit_links(measurement: Mapping[str, Any], holdout_every: int, model: ModelShape) -> KernelFit:
    """One-way time of a message of ``bytes`` per rank, per op (``p2p``: half a ping-pong
    between two ranks; ``all_to_all``: every rank sends ``bytes`` to the others in all;
    ``all_reduce``: every rank sums ``bytes`` over the ranks): latency + bytes / bandwidth,
    fitted per op. ``bw_intra`` is the all-to-all's bandwidth and ``a2a_latency`` its latency,
    since the cost model prices exchanges (all-to-alls) with them; ``bw_reduce`` is the
    all-reduce's, in the bytes a ring sends from each rank (``2·(ranks−1)/ranks`` of the
    buffer), and ``reduce_latency`` its latency, where it was measured (reports before it have no
    ``all_reduce`` points)."""
    sweep, measured = points(measurement, "links")
    ops = np.array([p["op"] for p in sweep])
    nbytes = np.array([p["bytes"] for p in sweep], dtype=np.float64)
    pred = np.zeros_like(measured)
    held = np.zeros(len(sweep), dtype=bool)
    coef: Dict[str, float] = {}
    for op in LINK_OPS:
        idx = np.flatnonzero(ops == op)
        if idx.size == 0:
            continue
        sub = {"sweep": [sweep[i] for i in idx], "measured_s": measured[idx]}
        c, p, h = linear_fit(
            f"links.{op}",
            sub,
            holdout_every,
            ("latency_s", "s_per_byte"),
            np.stack([np.ones(idx.size), nbytes[idx]], axis=1),
        )
        if c["s_per_byte"] <= 0:
            raise RoutepackError(f"links.{op}: time does not grow with message size; cannot fit a bandwidth")
        coef[f"latency_{op}_s"] = c["latency_s"]
        coef[f"bw_{op}"] = 1.0 / c["s_per_byte"]
        pred[idx], held[idx] = p, h
    if "bw_all_to_all" not in coef:
        raise RoutepackError("links: no all_to_all points measured; cannot fit bw_intra")
    fields = {"bw_intra": coef["bw_all_to_all"], "a2a_latency": coef["latency_all_to_all_s"]}
    notes = [
        f"bw_intra = the all-to-all's bandwidth between {measurement.get('ranks', '?')} local processes "
        f"({measurement.get('backend', '?')}); a2a_latency = its latency "
        f"({coef['latency_all_to_all_s']:.3g} s per all-to-all); the p2p figures are reported only"
    ]
    if "bw_all_reduce" in coef:
        ranks = int(measurement.get("ranks", 2))
        fields["bw_reduce"] = 2.0 * (ranks - 1) / ranks * coef["bw_all_reduce"]
        fields["reduce_latency"] = coef["latency_all_reduce_s"]
        notes.append(
            f"bw_reduce = the all-reduce's bandwidth in a ring's bytes sent per rank "
            f"(2·({ranks}−1)/{ranks} of the buffer): {fields['bw_reduce']:.3g} B/s; reduce_latency = its "
            f"latency ({fields['reduce_latency']:.3g} s per all-reduce)"
        )
    return KernelFit(
        "links",
        "latency_<op> + bytes / bw_<op>",
        sweep,
        measured.tolist(),
        pred.tolist(),
        held.tolist(),
        coef,
        fields,
        notes,
        extra={k: measurement[k] for k in ("ranks", "backend", "clock") if k in measurement},
    )
