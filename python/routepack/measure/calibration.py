"""The measured run's cost model: calibrated on this machine for the workload's shapes
(`calibrated`), or read back from a file an earlier run of the same shapes wrote
(`load_or_calibrate`), so that a series of runs predicts with one calibration."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np

from routepack.errors import RoutepackError
from routepack.model import CostModel
from routepack.measure.workload import Workload

#: The workload fields a calibration depends on (the shapes it measured at); the others
#: (samples, popularity, seed, windows, ...) change the plans, not the kernels.
SHAPE_FIELDS = ("ranks", "layers", "experts", "top_k", "hidden", "ffn", "slots_per_rank")


def calibrated(
    work: Workload, quick: bool, progress: bool, device: str = "cpu", ranks: Optional[int] = None
) -> Tuple[CostModel, Dict[str, Any]]:
    """Calibrates the cost model for ``work``'s shapes on ``ranks`` (default ``work.ranks``)
    local processes (see `routepack.measure`); returns it and a summary of each kind's fit."""
    from routepack.calibrate import ALL_KERNELS, calibrate

    windows = [work.window(w)[0] for w in range(work.windows)]
    # the most tokens one expert gets in a layer, over the windows
    most = max(int(w.counts.sum(axis=0, dtype=np.int64).max()) for w in windows)
    # the longest sample a rank's microbatch holds bounds the origin sweep
    longest = max(max(work.token_cap(w) for w in windows), 128)
    cal = calibrate(
        model=work.model(),
        kernels=ALL_KERNELS,
        ranks=ranks or work.ranks,
        quick=quick,
        max_tokens_per_expert=max(8, most),
        expert_stack=work.slots_per_rank,
        progress=progress,
        threads=1 if device == "cpu" else None,
        device=device,
        dtype="float32",
        max_length=longest,
        attention_dense=False,
        links_clock="cpu" if device == "cpu" else "wall",
    )
    # the form committed and what bounds it (the expert fit's `call_curve_bound`), beside the error
    summary = {
        kind: {
            "max_rel_error": fit.max_rel_error,
            "coefficients": fit.coefficients,
            "formula": fit.formula,
            **{k: fit.extra[k] for k in ("curve_bound", "call_curve_bound", "cross_validation") if k in fit.extra},
            **({"expert_table": fit.cost_fields["expert_table"]} if fit.cost_fields.get("expert_table") else {}),
        }
        for kind, fit in cal.fits.items()
    }
    return cal.cost, summary


def load_or_calibrate(
    path: str | Path, work: Workload, quick: bool, progress: bool, device: str = "cpu"
) -> Tuple[CostModel, Dict[str, Any], bool]:
    """The calibration stored at ``path`` (written by an earlier run: the cost model, the fits'
    summary and the shapes it was measured at), or a new one written there when the file does
    not exist. Returns (cost, summary, whether it was read). Refuses a file of other shapes
    (`SHAPE_FIELDS`) or device, naming the field."""
    path = Path(path)
    shapes = {k: getattr(work, k) for k in SHAPE_FIELDS}
    if path.exists():
        try:
            doc = json.loads(path.read_text())
            cost = CostModel.from_json(json.dumps(doc["cost_model"]))
            summary, got, dev = doc["calibration"], doc["shapes"], doc["device"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RoutepackError(f"calibration: {path} is not a measured run's calibration ({e})") from None
        for k, v in shapes.items():
            if got.get(k) != v:
                raise RoutepackError(f"calibration: {path} was measured with {k}={got.get(k)}, this run has {k}={v}")
        if dev != device:
            raise RoutepackError(f"calibration: {path} was measured on {dev}, this run is on {device}")
        return cost, summary, True
    if not path.parent.is_dir():
        raise RoutepackError(f"calibration: directory {path.parent} does not exist")
    cost, summary = calibrated(work, quick, progress, device)
    doc = {"shapes": shapes, "device": device, "quick": quick, "cost_model": asdict(cost), "calibration": summary}
    path.write_text(json.dumps(doc, indent=2, default=str))
    return cost, summary, False
