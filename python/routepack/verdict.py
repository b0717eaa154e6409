"""The one line ``routepack demo`` and ``routepack bench`` end with: routepack against the best
baseline on the windows just scored, and whether it is worth turning on there.

*Worth turning on* means: routepack's predicted throughput over the best baseline (per window
the fastest baseline preset that ran, `routepack.compare.best_baseline`) is at least
`WORTH_IT` in the median over the windows, and at least 1 in every window. The threshold is
above 1 because the figures are predictions of the cost model: the committed measured run
(docs/results/measure_cpu.md) found a speed-up of 1.059x where 1.130x was predicted, so a
predicted gain under 5% may not survive on hardware. Calibrate the cost model on yours
(``routepack calibrate``, then ``--cost``) before reading the verdict as a decision.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Sequence

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


__all__ = ["WORTH_IT", "threshold_note", "verdict"]
