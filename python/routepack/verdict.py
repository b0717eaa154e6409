"""The one line ``routepack demo`` and ``routepack bench`` end with: routepack against the best
baseline on the windows just scored, and whether it is worth turning on there; and the one
``routepack calibrate`` and ``routepack measure`` end with: whether the fit is good enough to
plan with (`FIT_THRESHOLD`) and whether the plan paid off, predicted within
`PREDICTION_THRESHOLD` (either verdict exits 0: a poor fit or a plan that did not pay off on
this machine is a result to act on, not an error).

*Worth turning on* means: routepack's predicted throughput over the best baseline (per window
the fastest baseline preset that ran, `routepack.compare.best_baseline`) is at least
`WORTH_IT` in the median over the windows, and at least 1 in every window. The threshold is
above 1 because the figures are predictions of the cost model: the committed measured run
(docs/results/measure_cpu.md) found a speed-up of 1.059x where 1.130x was predicted, so a
predicted gain under 5% may not survive on hardware. Calibrate the cost model on yours
(``routepack calibrate``, then ``--cost``) before reading the verdict as a decision.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

from routepack.compare import BEST

#: The least median throughput over the best baseline that the verdict calls worth turning on.
WORTH_IT = 1.05


def verdict(ratio_rows: Sequence[Dict[str, Any]], ran: Iterable[str], name: str = "routepack") -> str:
    """One line from `routepack.compare.ratios` output (the target's throughput over every
    policy per window): ``verdict: ...``, starting with the word a script can find it by.
    ``ran``: the policies the run planned; ``name`` is what the line calls the target (a
    sweep's rows name it by its stages)."""
    best = next((r for r in ratio_rows if r["against"] == BEST), None)
    if not ratio_rows and name not in set(ran):
        return f"verdict: none ({name} did not run: add --policy {name})"
    if best is None:
        return f"verdict: none (no baseline ran to compare {name} with: add --policy static or another baseline)"
    where = "this window" if best["windows"] == 1 else f"{best['windows']} windows"
    worth = best["median"] >= WORTH_IT and best["min"] >= 1.0
    return (
        f"verdict: {name} is {best['median']:.3f}x the best baseline over {where} "
        f"({best['min']:.3f}-{best['max']:.3f}x): " + ("worth turning on" if worth else "not worth turning on")
    )


def threshold_note() -> str:
    """What the verdict's words mean, printed above it (the verdict itself fits 100 columns)."""
    return (
        f"worth turning on: a median of at least {WORTH_IT:.2f}x the best baseline's throughput and no window "
        "below 1x, as the cost model predicts (calibrate it on your hardware: routepack calibrate, then --cost)"
    )


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


__all__ = [
    "FIT_THRESHOLD",
    "PREDICTION_THRESHOLD",
    "WORTH_IT",
    "calibrate_verdict",
    "fit_verdict",
    "measure_verdict",
    "threshold_note",
    "verdict",
]
