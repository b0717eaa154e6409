#!/usr/bin/env python
"""The fuzz campaign target by target, each to a number of cases (issue 40's acceptance: every
public function at least 10^4 cases, 0 bad outcomes, under an 8 GiB address-space limit).

    python tools/fuzz_each.py --cases 10000 --out fuzz40 'Window.from_routed_experts' 'cli[' ...
    python tools/fuzz_each.py --merge fuzz40                   # the table of what ran

Each name selects the targets whose name starts with it (`fuzz_campaign.py --list`; ``glue.``:
the torch glue in a gloo group of 2, `fuzzlib.t_glue`); each
selected target runs as its own campaign (``fuzz_campaign.py --only NAME$ --stop N``: the
cases are the same function of ``--seed`` as in a mixed campaign), ``--jobs`` at a time, its
JSON written to ``OUT/NAME.json``; a target whose JSON already holds N cases is not run again.
Then the merged table: cases, valid, clean(named), clean(unnamed), other per function, with
every ``other`` and ``clean(unnamed)`` bucket and one reproducer (``--replay NAME:INDEX``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
COLS = ("cases", "valid", "clean_named", "clean_unnamed", "other")


def _file(out: Path, name: str) -> Path:
    return out / (re.sub(r"[^\w.\[\]-]+", "_", name) + ".json")


def _done(path: Path, cases: int) -> bool:
    try:
        return json.loads(path.read_text())["cases"] >= cases
    except (OSError, ValueError, KeyError):
        return False


def run(names: List[str], args: argparse.Namespace) -> None:
    from fuzz_campaign import load_targets

    only = ",".join(names)
    chosen = [t.name for t in load_targets(only, torch=not args.no_torch, memory_limit=8 << 30)]
    if not args.no_torch and any(n.startswith("glue") or "glue.".startswith(n) for n in names):
        chosen += [t.name for t in load_targets(only, world=2)]  # a gloo group of 2 (fuzzlib.t_glue)
    todo = [n for n in chosen if not _done(_file(args.out, n), args.cases)]
    print(f"{len(chosen)} target(s), {len(todo)} to run to {args.cases} cases each", flush=True)
    running: List[Any] = []
    while todo or running:
        while todo and len(running) < args.jobs:
            name = todo.pop(0)
            cmd = [sys.executable, str(HERE / "fuzz_campaign.py"), "--only", name + "$", "--stop", str(args.cases)]
            cmd += ["--seed", str(args.seed), "--minutes", str(args.minutes), "--json", str(_file(args.out, name))]
            cmd += ["--memory-limit-gib", str(args.memory_limit_gib)]
            if name.startswith("glue."):
                cmd += ["--world", "2"]
            log = open(_file(args.out, name).with_suffix(".log"), "w")
            running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), time.monotonic()))
        for item in list(running):
            name, proc, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                print(f"  {name}: exit {proc.returncode} after {time.monotonic() - t0:.0f} s", flush=True)
        time.sleep(1.0)


def merge(out: Path) -> Dict[str, Any]:
    per: Dict[str, Dict[str, Any]] = {}
    buckets: Dict[str, Dict[str, Any]] = {"other": {}, "clean_unnamed": {}}
    meta: Dict[str, Any] = {}
    for path in sorted(out.glob("*.json")):
        try:
            rep = json.loads(path.read_text())
        except ValueError:
            continue
        if "targets" not in rep:
            continue
        meta.setdefault("memory_limit_gib", rep.get("memory_limit_gib"))
        meta.setdefault("seed", rep.get("seed"))
        meta["elapsed_s"] = meta.get("elapsed_s", 0.0) + rep.get("elapsed_s", 0.0)
        meta.setdefault("harness_errors", []).extend(rep.get("harness_errors", []))
        for name, row in rep["targets"].items():
            per[name] = row
        for kind in buckets:
            for name, b in rep.get(kind, {}).items():
                buckets[kind][name] = b
    return {"targets": per, **buckets, **meta}


def table(rep: Dict[str, Any]) -> str:
    heads = ("cases", "valid", "clean(named)", "clean(unnamed)", "other")
    width = max([len(n) for n in rep["targets"]] + [8])
    lines = [f"{'function':<{width}} " + " ".join(f"{h:>14}" for h in heads), "-" * (width + 75)]
    totals = dict.fromkeys(COLS, 0)
    for name, row in rep["targets"].items():
        for k in COLS:
            totals[k] += row.get(k, 0)
        lines.append(f"{name:<{width}} " + " ".join(f"{row.get(k, 0):>14}" for k in COLS))
    lines.append("-" * (width + 75))
    lines.append(f"{'total':<{width}} " + " ".join(f"{totals[k]:>14}" for k in COLS))
    fewest = min((r["cases"] for r in rep["targets"].values()), default=0)
    lines.append(
        f"{len(rep['targets'])} functions, fewest cases {fewest}, other {totals['other']}, "
        f"clean(unnamed) {totals['clean_unnamed']}, harness errors {len(rep.get('harness_errors', []))}, "
        f"memory limit {rep.get('memory_limit_gib')} GiB, {rep.get('elapsed_s', 0.0) / 3600:.2f} h of campaigns"
    )
    for kind in ("other", "clean_unnamed"):
        for name, bs in rep[kind].items():
            for b, v in sorted(bs.items(), key=lambda x: -x[1]["count"]):
                lines.append(f"[{kind}] {name}: {v['count']} x {b}\n    e.g. {v['reproducers'][0]['repro'][:300]}")
    return "\n".join(lines)


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="target name prefixes (fuzz_campaign.py --list)")
    ap.add_argument("--cases", type=int, default=10000, help="cases per target (default %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("fuzz_each"), help="folder of the JSON results")
    ap.add_argument("--jobs", type=int, default=1, help="targets run at once (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=600.0, help="the most one target may run (default %(default)s)")
    ap.add_argument("--memory-limit-gib", type=float, default=8.0)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--merge", type=Path, help="print the table of the JSON results in this folder and exit")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.merge is None:
        args.out.mkdir(parents=True, exist_ok=True)
        run(args.names, args)
    rep = merge(args.merge or args.out)
    print(table(rep))
    (Path(args.merge or args.out) / "table.txt").write_text(table(rep) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
