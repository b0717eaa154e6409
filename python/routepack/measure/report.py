"""What `routepack measure` prints: per window and policy the measured and predicted step and
microbatches (`format_table`), the speed-ups, and the per-part profile beside the cost-model
terms that price each part (`parts_table`), and each part averaged over the ranks
(`rank_mean_table`)."""

from __future__ import annotations

from typing import Any, Dict, List

from routepack.parts import PARTS, PRICED_BY

#: The table's rows: each cost-model term, then the parts it prices; the parts no term prices last.
TERM_ROWS = (
    ("attention", "a_lin: the origin's gather and combine, the received rows' sort"),
    ("all_to_all", "dispatch and combine with their fixed cost (a2a_latency, bw_intra)"),
    ("expert", "the grouped expert kernels (c_call, c_exp, c_tok, the table)"),
    ("replication", "replica weights out, their gradients back"),
    ("redundant_grads", "the step's sum of redundant experts' gradients"),
)


def format_table(result: Any) -> List[str]:
    """Per window and policy: measured and predicted step (migration + microbatches + finish),
    each microbatch's relative error; then the run's totals and the speed-ups over every
    other policy of the run."""
    lines = []
    names = list(result.policies)
    wins = len(result.policies[names[0]]["windows"])
    for w in range(wins):
        lines.append(f"window {w}:")
        for name in names:
            rec = result.policies[name]["windows"][w]
            errs = " ".join(f"{e:+.1%}" for e in rec["micro_rel_error"])
            lines.append(
                f"  {name:<12} step measured {rec['step_s'] * 1e3:8.1f} ms  predicted {rec['predicted_step_s'] * 1e3:8.1f}"
                f" ms  ({rec['num_micro']} micro, {rec['replicas']} replicas, {rec['redundant_slots']} redundant "
                f"slots, {rec['migration_rows']} moves: migration {rec['migration_s'] * 1e3:.1f} / "
                f"{rec['predicted_migration_s'] * 1e3:.1f} ms, finish {rec['finish_s'] * 1e3:.1f} ms); "
                f"micro errors {errs}"
            )
        first = result.policies[names[0]]["windows"][w]
        if "opening_s" in first:
            lines.append(
                "  (not in the steps: the window's checks and agreement "
                + ", ".join(f"{n} {result.policies[n]['windows'][w]['opening_s'] * 1e3:.1f}" for n in names)
                + " ms; its routes from the replayed ids "
                + ", ".join(f"{n} {result.policies[n]['windows'][w]['routes_s'] * 1e3:.1f}" for n in names)
                + " ms)"
            )
    lines.append(f"run ({wins} window{'s' if wins > 1 else ''}):")
    for name in names:
        rec = result.policies[name]
        err = rec["predicted_step_s"] / rec["step_s"] - 1
        lines.append(
            f"  {name:<12} measured {rec['step_s'] * 1e3:8.1f} ms  predicted {rec['predicted_step_s'] * 1e3:8.1f} ms"
            f"  ({err:+.1%})"
        )
    for name in names:
        for ref, s in result.policies[name]["speedups"].items():
            if name == "static" or ref == name or (ref != "static" and ref not in REFERENCES):
                continue
            lines.append(
                f"speed-up {name} over {ref}: measured {s['measured']:.3f}x  predicted {s['predicted']:.3f}x  "
                f"(predicted/measured - 1 = {s['rel_error']:+.1%})"
            )
    return lines


#: Policies the speed-ups are printed over besides static (the JSON has every pair).
REFERENCES = ("eplb_oracle", "eplb")


def part_totals(rec: Dict[str, Any]) -> Dict[str, Any]:
    """One policy's run summed over its windows and microbatches: measured seconds per part
    (slowest rank per part), their spread (the largest of any microbatch, relative), and the
    predicted seconds per term; plus finish and migration."""
    parts = {p: 0.0 for p in PARTS}
    spread = {p: 0.0 for p in PARTS}
    terms: Dict[str, float] = {}
    finish = migration = pmig = 0.0
    for w in rec["windows"]:
        for m, mp in enumerate(w.get("parts", [])):
            for p in PARTS:
                parts[p] += mp.get(p, 0.0)
                spread[p] = max(spread[p], w["parts_spread"][m].get(p, 0.0))
        for t in w["predicted_terms"]:
            for k, v in t.items():
                terms[k] = terms.get(k, 0.0) + v
        finish += w["finish_s"]
        migration += w["migration_s"]
        pmig += w["predicted_migration_s"]
    return {
        "parts": parts,
        "spread": spread,
        "terms": terms,
        "finish": finish,
        "migration": migration,
        "predicted_migration": pmig,
    }


def parts_table(result: Any) -> List[str]:
    """The per-part profile: for every policy, milliseconds of the run (all windows' steps) per
    cost-model term, measured (the sum of the parts it prices, each its slowest rank's) and
    predicted, and the parts under it with their spread (``±``: the median absolute deviation
    over the timed steps, relative, the largest of any microbatch; a difference well above it
    is the model's bias, not noise)."""
    names = list(result.policies)
    if not all("parts" in w for n in names for w in result.policies[n]["windows"]):
        return []
    tot = {n: part_totals(result.policies[n]) for n in names}
    width = 22
    head = f"{'term / part (ms)':<{width}}" + "".join(f"{n[:20]:>21} {'pred':>8}" for n in names)
    lines = ["per-part profile, ms over the run (measured: slowest rank per part; ± its spread):", head]

    def row(label: str, measured: List[float], predicted: List[Any], spreads: List[Any]) -> str:
        cells = ""
        for v, p, s in zip(measured, predicted, spreads):
            sp = f" ±{s:.0%}" if s is not None else "     "
            cells += f"{v * 1e3:>15.1f}{sp:>6} {'' if p is None else f'{p * 1e3:8.1f}':>8}"
        return f"{label:<{width}}" + cells

    for term, _ in TERM_ROWS:
        members = [p for p in PARTS if PRICED_BY[p] == term]
        lines.append(
            row(
                term,
                [sum(tot[n]["parts"][p] for p in members) for n in names],
                [tot[n]["terms"].get(term, 0.0) for n in names],
                [None] * len(names),
            )
        )
        for p in members:
            lines.append(
                row(
                    "  " + p,
                    [tot[n]["parts"][p] for n in names],
                    [None] * len(names),
                    [tot[n]["spread"][p] for n in names],
                )
            )
    lines.append(
        row(
            "not priced",
            [sum(tot[n]["parts"][p] for p in PARTS if PRICED_BY[p] is None) for n in names],
            [None] * len(names),
            [None] * len(names),
        )
    )
    for p in PARTS:
        if PRICED_BY[p] is None:
            lines.append(
                row(
                    "  " + p,
                    [tot[n]["parts"][p] for n in names],
                    [None] * len(names),
                    [tot[n]["spread"][p] for n in names],
                )
            )
    lines.append(row("  finish_step", [tot[n]["finish"] for n in names], [None] * len(names), [None] * len(names)))
    lines.append(
        row(
            "migration",
            [tot[n]["migration"] for n in names],
            [tot[n]["predicted_migration"] for n in names],
            [None] * len(names),
        )
    )
    lines.append(
        row(
            "step (all windows)",
            [result.policies[n]["step_s"] for n in names],
            [result.policies[n]["predicted_step_s"] for n in names],
            [None] * len(names),
        )
    )
    return lines


def rank_mean_parts(rec: Dict[str, Any]) -> Dict[str, float]:
    """One policy's run: seconds per part over all windows and microbatches, averaged over
    the ranks (each rank's own median parts). Where the slowest-rank table shows which rank
    waits, this shows the work a plan adds to every rank: on the CPU ranks of
    docs/measure_series.md a replica's fill and gradient return cost every rank about 3×
    their price, where the expert term is off by the same share for every policy."""
    acc: Dict[str, float] = {}
    for w in rec["windows"]:
        ranks = w.get("per_rank_parts") or []
        for parts in ranks:
            for micro in parts:
                for p, v in micro.items():
                    acc[p] = acc.get(p, 0.0) + v / len(ranks)
    return acc


def rank_mean_table(result: Any) -> List[str]:
    """`rank_mean_parts` of every policy, ms, one row a part and a total (empty without the
    profile)."""
    names = list(result.policies)
    if not all(w.get("per_rank_parts") for n in names for w in result.policies[n]["windows"]):
        return []
    means = {n: rank_mean_parts(result.policies[n]) for n in names}
    width = 22
    lines = [
        "per-part work, ms over the run, mean over the ranks:",
        f"{'part (ms)':<{width}}" + "".join(f"{n[:20]:>21}" for n in names),
    ]
    for p in PARTS:
        lines.append(f"{'  ' + p:<{width}}" + "".join(f"{means[n].get(p, 0.0) * 1e3:>21.1f}" for n in names))
    lines.append(f"{'total':<{width}}" + "".join(f"{sum(means[n].values()) * 1e3:>21.1f}" for n in names))
    return lines
