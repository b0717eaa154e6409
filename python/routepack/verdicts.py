"""The one line `routepack calibrate` and `routepack measure` end with: whether the fit is good
enough to plan with and whether the plan paid off, against thresholds stated here once.

Neither is a failure of the command (it exits 0 with either verdict): a poor fit or a plan that
did not pay off on this machine is a result the user acts on, not an error.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

#: a fit is good enough to plan with when every held-out relative error is at most this
FIT_THRESHOLD = 0.25
#: a measured speed-up is predicted well when predicted / measured - 1 is at most this
PREDICTION_THRESHOLD = 0.10


def fit_verdict(errors: Mapping[str, Optional[float]]) -> str:
    """``errors``: kernel → held-out max relative error (None: none held out). The fit's verdict
    against `FIT_THRESHOLD`, naming the worst kernel, or the kernels over it."""
    held = {k: float(v) for k, v in errors.items() if v is not None}
    if not held:
        return "no kernel had held-out points, so nothing tells whether the fit can be trusted"
    bad = {k: v for k, v in held.items() if v > FIT_THRESHOLD}
    if not bad:
        worst = max(held, key=lambda k: held[k])
        return (
            f"the fit is good enough to plan with: every held-out error is within {FIT_THRESHOLD:.0%} "
            f"(worst {worst} {held[worst]:.1%})"
        )
    listed = ", ".join(f"{k} {v:.1%}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1]))
    return (
        f"the fit is NOT good enough to plan with: {listed} held out, over {FIT_THRESHOLD:.0%}; rerun on a quiet "
        "machine without --quick (more repeats), or keep the hardware preset for those terms"
    )


def calibrate_verdict(report: Mapping[str, Any]) -> str:
    """`routepack calibrate`'s last line, from its report (``kernels``: each one's ``max_rel_error``)."""
    return "verdict: " + fit_verdict({k: v.get("max_rel_error") for k, v in report["kernels"].items()})


def measure_verdict(policies: Mapping[str, Any], calibration: Optional[Mapping[str, Any]] = None) -> str:
    """`routepack measure`'s last line: whether routepack (else the first policy besides static)
    paid off over static as measured, how well the cost model predicted the speed-up
    (`PREDICTION_THRESHOLD`) and, when the run calibrated, the fit's verdict."""
    name = "routepack" if "routepack" in policies else next((n for n in policies if n != "static"), None)
    if name is None or "static" not in policies[name].get("speedups", {}):
        return "verdict: only static ran, nothing to compare (add --policy routepack)"
    s = policies[name]["speedups"]["static"]
    paid = s["measured"] > 1.0
    err = s["predicted"] / s["measured"] - 1.0
    line = (
        f"verdict: {name} {'paid off' if paid else 'did NOT pay off'} here: {s['measured']:.3f}x static measured, "
        f"{s['predicted']:.3f}x predicted ({err:+.1%}: "
        f"{'within' if abs(err) <= PREDICTION_THRESHOLD else 'outside'} {PREDICTION_THRESHOLD:.0%})"
    )
    if calibration:
        line += "; " + fit_verdict({k: v.get("max_rel_error") for k, v in calibration.items()})
    return line
