#!/usr/bin/env python
"""A long fuzz campaign over routepack's whole public API (issue 13's acceptance numbers).

    python tools/fuzz_campaign.py --minutes 5 --seed 0 --json out.json
    python tools/fuzz_campaign.py --list                      # the targets
    python tools/fuzz_campaign.py --only plan_window --minutes 1
    python tools/fuzz_campaign.py --replay 'Window.load:17' --seed 0   # one case, in process

Every public function and constructor is a target (`fuzzlib.t_*`); each gets a few cases per
round, round after round, until the time is up: valid random inputs (whose results are
checked: plans through `Plan.validate` and an independent numpy check), odd but valid edge
cases, malformed arguments, tampered plans and damaged files. Each call ends in one of:
``valid``, ``clean(named)`` / ``clean(unnamed)`` (a RoutepackError whose message does / does
not name an argument) or ``other`` (see `fuzzlib.engine` and tools/README.md).

The cases run in a worker process, under an address-space limit (``--memory-limit-gib``,
``RLIMIT_AS``, 8 GiB by default, as containers set it), with its stdout/stderr captured: an
interpreter abort (an allocation failure, a segfault), a kill or a call over
``--call-timeout`` counts as ``other`` for that case, and a fresh worker resumes at the next
case. Under a limit the memory-limit family (``memory.*``, `fuzzlib.t_memory`) runs too:
calls that would allocate more than the limit, which must be refused naming the argument and
the bytes. The cases and their order are a function of ``--seed`` (and the limit) alone.

Prints a table (function, cases, valid, clean(named), clean(unnamed), other) and writes the
same numbers to ``--json``, with up to 5 reproducers per ``other`` and ``clean(unnamed)``
bucket (the call as repr, and the ``name:index`` that ``--replay`` runs again).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (HERE, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

#: how many reproducers a bucket keeps
KEEP = 5


def load_targets(only: Optional[str] = None, torch: bool = True, memory_limit: int = 0, world: int = 1) -> List[Any]:
    """Every target, in table order (``only``: comma-separated name prefixes). With a
    ``memory_limit`` (bytes of address space the worker may hold), the memory-limit family
    sized from it (`fuzzlib.t_memory`); without one it is left out, since its cases would then
    allocate for real. ``world=2``: the ``glue.*`` targets alone (`fuzzlib.t_glue`: a gloo
    group of the worker and a peer process; the other torch targets hold a group of one)."""
    from fuzzlib import t_analysis, t_bound, t_cli, t_integrations, t_model, t_plan, t_planner, t_stages, t_window

    if world == 2:
        from fuzzlib import t_glue

        return _select(t_glue.targets(), only)

    targets = (
        t_model.TARGETS
        + t_window.TARGETS
        + t_plan.TARGETS
        + t_planner.TARGETS
        + t_stages.TARGETS
        + t_analysis.TARGETS
        + t_cli.TARGETS
        + t_bound.TARGETS
        + t_integrations.TARGETS
    )
    if memory_limit > 0:
        from fuzzlib import t_memory

        targets += t_memory.targets(memory_limit)
    if torch:
        from fuzzlib import t_hf, t_torch

        targets += t_torch.targets() + t_hf.targets()
    if os.environ.get("ROUTEPACK_FUZZ_SELFTEST"):
        targets.append(selftest_target())
    return _select(targets, only)


def _select(targets: List[Any], only: Optional[str]) -> List[Any]:
    """The targets ``only`` names (every one without it), checked for duplicate names."""
    if only:
        # a name prefix, or with a trailing '$' a whole name (tools/fuzz_each.py runs one target so)
        prefixes = [s.strip() for s in only.split(",") if s.strip()]
        targets = [
            t for t in targets if any(t.name == p[:-1] if p.endswith("$") else t.name.startswith(p) for p in prefixes)
        ]
    names = [t.name for t in targets]
    assert len(set(names)) == len(names), "duplicate target names"
    return targets


#: what the self-test target's cases do, in turn
SELFTEST = ("return", "abort", "hang", "stderr", "kill", "memory")


def selftest_target() -> Any:
    """The campaign's own test (tests/test_fuzz_campaign.py): a case that returns, one that
    aborts the interpreter (as a failed Rust allocation does), one that hangs, one that prints
    to stderr, one killed (as the kernel kills a process over its memory), one that raises a
    bare MemoryError, in turn."""
    from fuzzlib.engine import Case, Target

    def behave(what: str) -> str:
        if what == "abort":
            os.abort()
        elif what == "hang":
            time.sleep(3600)
        elif what == "stderr":
            os.write(2, b"thread 'main' panicked at src/x.rs:1:1\n")
        elif what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif what == "memory":
            raise MemoryError("Unable to allocate 12.0 GiB")
        return what

    def gen(seed: int, n: int) -> List[Any]:
        return [Case("valid", behave, (w,)) for w in SELFTEST] * max(1, n // len(SELFTEST))

    return Target("selftest", behave, gen, weight=1, batch=len(SELFTEST))


# ------------------------------------------------------------------ the worker
def memory_limit(args: argparse.Namespace) -> int:
    """The worker's address-space limit in bytes (0: none)."""
    return int(args.memory_limit_gib * 2**30) if args.memory_limit_gib > 0 else 0


def apply_memory_limit(args: argparse.Namespace) -> None:
    """Sets ``RLIMIT_AS`` to ``--memory-limit-gib`` for this process (the worker, or a replay):
    every case runs under it, as a container or scheduler would run the caller."""
    limit = memory_limit(args)
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def worker(args: argparse.Namespace) -> None:
    """Runs cases from position ``--start`` on, reporting on fd ``--proto`` (JSON lines)."""
    proto = os.dup2(args.proto, 255)
    os.close(args.proto)
    apply_memory_limit(args)
    # fds 1 and 2 go to one capture file: whatever a call prints there is seen (engine)
    cap = os.open(args.capture, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(cap, 1)
    os.dup2(cap, 2)
    os.close(cap)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")
    import faulthandler

    faulthandler.enable(file=sys.stderr)

    def send(rec: Dict[str, Any]) -> None:
        data = (json.dumps(rec) + "\n").encode()
        while data:
            data = data[os.write(proto, data) :]

    from fuzzlib.engine import Schedule, Streams, capture_offset, describe, run_case

    targets = load_targets(args.only, torch=not args.no_torch, memory_limit=memory_limit(args), world=args.world)
    schedule, streams = Schedule(targets), Streams(args.seed)
    pos = args.start
    while args.stop is None or pos < args.stop:
        target, k = schedule.at(pos)
        try:
            case = streams.case(target, k)
        except Exception as e:  # noqa: BLE001 (a generator bug: reported, the case skipped)
            import traceback

            send(
                {
                    "pos": pos,
                    "t": target.name,
                    "k": k,
                    "harness": f"{type(e).__name__}: {e}",
                    "detail": traceback.format_exc()[-2000:],
                }
            )
            pos += 1
            continue
        send(
            {
                "pos": pos,
                "t": target.name,
                "k": k,
                "start": True,
                "kind": case.kind,
                "repro": describe(case),
                "offset": capture_offset(),
            }
        )
        rec = run_case(target, case)
        rec.update(pos=pos, t=target.name, k=k, kind=case.kind)
        send(rec)
        pos += 1
        if args.world == 2 and sys.modules["fuzzlib.t_glue"].BROKEN:
            send({"restart": True})  # the pair's group may be unusable: the parent starts a fresh one
            return
    send({"end": True})


# ------------------------------------------------------------------ the parent
class Stats:
    def __init__(self) -> None:
        self.counts: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.kinds: Dict[str, Dict[str, Dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
        self.buckets: Dict[str, Dict[str, Dict[str, Dict[str, Any]]]] = {
            "other": defaultdict(dict),
            "clean_unnamed": defaultdict(dict),
        }
        self.slowest: Dict[str, List[Any]] = defaultdict(list)
        self.harness: List[Dict[str, Any]] = []
        self.cases = 0

    def add(self, t: str, k: int, kind: str, outcome: str, bucket: str, repro: str, detail: str, secs: float) -> None:
        self.cases += 1
        self.counts[t][outcome] += 1
        self.kinds[t][kind][outcome] += 1
        if outcome in self.buckets:
            b = self.buckets[outcome][t].setdefault(bucket, {"count": 0, "reproducers": []})
            b["count"] += 1
            if len(b["reproducers"]) < KEEP:
                b["reproducers"].append({"case": f"{t}:{k}", "kind": kind, "repro": repro, "detail": detail})
        slow = self.slowest[t]
        slow.append([round(secs, 3), f"{t}:{k}"])
        slow.sort(key=lambda x: -x[0])
        del slow[3:]


def start_worker(args: argparse.Namespace, start: int, capture: str):
    r, w = os.pipe()
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--proto",
        str(w),
        "--start",
        str(start),
        "--capture",
        capture,
        "--seed",
        str(args.seed),
        "--memory-limit-gib",
        str(args.memory_limit_gib),
    ]
    if args.stop is not None:
        cmd += ["--stop", str(args.stop)]
    if args.world != 1:
        cmd += ["--world", str(args.world)]
    if args.only:
        cmd += ["--only", args.only]
    if args.no_torch:
        cmd.append("--no-torch")
    env = {
        **os.environ,
        "RAYON_NUM_THREADS": str(args.threads),
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.Popen(cmd, pass_fds=(w,), stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    os.close(w)
    return proc, r


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def tail(path: str, since: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(since, os.path.getsize(path) - 3000))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def campaign(args: argparse.Namespace) -> Stats:
    from fuzzlib.engine import normalise
    from tqdm import tqdm

    stats = Stats()
    t_end = time.monotonic() + args.minutes * 60
    pos = 0
    total = args.stop if args.stop is not None else int(args.minutes * 60)
    bar = tqdm(
        total=total,
        unit="case" if args.stop is not None else "s",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 15,
    )
    t0 = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="rp_fuzz_worker_")
    finished = False
    while not finished and time.monotonic() < t_end and (args.stop is None or pos < args.stop):
        capture = os.path.join(workdir, f"capture_{pos}.txt")
        proc, rfd = start_worker(args, pos, capture)
        buf, pending, heard = b"", None, time.monotonic()
        while True:
            now = time.monotonic()
            if now >= t_end:
                break
            limit = args.call_timeout if pending else max(args.call_timeout, 180)
            # between cases the worker generates the next batch: silent for `limit` since its
            # last record (not since it started, which retired every worker after 180 s)
            since = pending["at"] if pending else heard
            wait = min(t_end - now, since + limit - now)
            if wait <= 0:
                if pending:
                    stats.add(
                        pending["t"],
                        pending["k"],
                        pending["kind"],
                        "other",
                        f"hang: no return within {args.call_timeout:g} s",
                        pending["repro"],
                        tail(capture, pending["offset"]),
                        args.call_timeout,
                    )
                    pos = pending["pos"] + 1
                else:
                    stats.harness.append({"pos": pos, "error": "worker silent (generation or start-up hang)"})
                    pos += 1
                break
            ready, _, _ = select.select([rfd], [], [], wait)
            if not ready:
                continue
            chunk = os.read(rfd, 1 << 16)
            if not chunk:  # the worker died
                proc.wait()
                rc = proc.returncode
                why = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
                if pending:
                    out = tail(capture, pending["offset"])
                    # the first line the call printed: "memory allocation of N bytes failed",
                    # "thread panicked at ...", or faulthandler's "Fatal Python error: ..."
                    last = next((ln for ln in out.splitlines() if ln.strip()), "")
                    stats.add(
                        pending["t"],
                        pending["k"],
                        pending["kind"],
                        "other",
                        f"abort: {why}: {normalise(last, 80)}",
                        pending["repro"],
                        out[-1500:],
                        0.0,
                    )
                    pos = pending["pos"] + 1
                else:
                    stats.harness.append(
                        {"pos": pos, "error": f"worker died outside a case ({why})", "detail": tail(capture, 0)[-2000:]}
                    )
                    pos += 1
                break
            buf += chunk
            heard = time.monotonic()
            *lines, buf = buf.split(b"\n")
            restart = False
            for line in lines:
                rec = json.loads(line)
                if rec.get("restart"):
                    restart = True
                elif rec.get("end"):
                    finished = True
                elif "harness" in rec:
                    stats.harness.append(rec)
                    pos = rec["pos"] + 1
                elif rec.get("start"):
                    pending = {**rec, "at": time.monotonic()}
                else:
                    stats.add(
                        rec["t"],
                        rec["k"],
                        rec["kind"],
                        rec["outcome"],
                        rec["bucket"],
                        pending["repro"] if pending else "",
                        rec.get("detail", ""),
                        rec["secs"],
                    )
                    pos = rec["pos"] + 1
                    pending = None
                    if args.stop is not None:
                        bar.update(1)
            other = sum(c.get("other", 0) for c in stats.counts.values())
            bar.set_postfix_str(f"cases={stats.cases} other={other}", refresh=False)
            if args.stop is None:  # the bar counts seconds; update() redraws at mininterval
                bar.update(max(0, min(total, int(time.monotonic() - t0)) - bar.n))
            if finished or restart:
                break
        kill(proc)
        os.close(rfd)
    bar.close()
    stats.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
    stats.positions = pos  # type: ignore[attr-defined]
    return stats


def table(targets: List[Any], stats: Stats) -> str:
    cols = ("cases", "valid", "clean_named", "clean_unnamed", "other")
    heads = ("cases", "valid", "clean(named)", "clean(unnamed)", "other")
    width = max([len(t.name) for t in targets] + [8])
    lines = [f"{'function':<{width}} " + " ".join(f"{h:>14}" for h in heads)]
    lines.append("-" * len(lines[0]))
    totals = defaultdict(int)
    for t in targets:
        c = stats.counts.get(t.name, {})
        row = {"cases": sum(c.values()), **{k: c.get(k, 0) for k in cols[1:]}}
        for k, v in row.items():
            totals[k] += v
        lines.append(f"{t.name:<{width}} " + " ".join(f"{row[k]:>14}" for k in cols))
    lines.append("-" * len(lines[0]))
    lines.append(f"{'total':<{width}} " + " ".join(f"{totals[k]:>14}" for k in cols))
    return "\n".join(lines)


def report(args: argparse.Namespace, targets: List[Any], stats: Stats) -> Dict[str, Any]:
    import numpy as np
    import routepack as rp

    per = {}
    for t in targets:
        c = stats.counts.get(t.name, {})
        per[t.name] = {
            "cases": sum(c.values()),
            "valid": c.get("valid", 0),
            "clean_named": c.get("clean_named", 0),
            "clean_unnamed": c.get("clean_unnamed", 0),
            "other": c.get("other", 0),
            "by_kind": {k: dict(v) for k, v in stats.kinds.get(t.name, {}).items()},
            "slowest_s": stats.slowest.get(t.name, []),
        }
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "seed": args.seed,
        "minutes": args.minutes,
        "elapsed_s": round(getattr(stats, "elapsed", 0.0), 1),
        "call_timeout_s": args.call_timeout,
        "memory_limit_gib": args.memory_limit_gib,
        "cases": stats.cases,
        "positions": getattr(stats, "positions", 0),
        "targets": per,
        "other": {t: b for t, b in stats.buckets["other"].items()},
        "clean_unnamed": {t: b for t, b in stats.buckets["clean_unnamed"].items()},
        "harness_errors": stats.harness,
        "environment": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "routepack": rp.__version__,
            "routepack_path": str(Path(rp.__file__).parent),
            "torch": torch_version,
            "rayon_threads": args.threads,
        },
    }


def replay(args: argparse.Namespace) -> int:
    """Runs one case (``name:index``) in this process, with its traceback."""
    import traceback

    from fuzzlib.engine import Schedule, Streams, describe, run_case

    name, _, k = args.replay.rpartition(":")
    targets = {
        t.name: t
        for t in load_targets(None, torch=not args.no_torch, memory_limit=memory_limit(args), world=args.world)
    }
    # the case runs under the limit it ran under in the campaign (the memory-limit family is
    # sized from it; without it those cases would allocate for real)
    apply_memory_limit(args)
    if name not in targets:
        print(f"unknown target {name!r}; --list shows them", file=sys.stderr)
        return 2
    case = Streams(args.seed).case(targets[name], int(k))
    print(describe(case, limit=100000))
    rec = run_case(targets[name], case, capture=False)
    print(json.dumps(rec, indent=2))
    if rec["outcome"] == "other":
        try:
            a, kw = case.setup() if case.setup else (case.args, case.kwargs)
            r = case.fn(*a, **kw)
            if case.check:
                case.check(r)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
    del Schedule
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="how long to run (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="campaign seed: the same seed runs the same cases")
    ap.add_argument("--json", help="write the numbers and reproducers here")
    ap.add_argument("--only", help="comma-separated target name prefixes ('name$': that name alone)")
    ap.add_argument("--stop", type=int, default=None, help="stop after this many cases (positions)")
    ap.add_argument("--call-timeout", type=float, default=60.0, help="seconds one call may take (default %(default)s)")
    ap.add_argument(
        "--memory-limit-gib",
        "--mem-gb",
        dest="memory_limit_gib",
        type=float,
        default=8.0,
        help="address-space limit (RLIMIT_AS) of every case, GiB, as containers set; the memory-limit family "
        "(memory.*) is sized from it (default %(default)s; 0: none, and no memory.* targets)",
    )
    ap.add_argument("--threads", type=int, default=2, help="RAYON_NUM_THREADS of the worker")
    ap.add_argument("--no-torch", action="store_true", help="leave out routepack.torch")
    ap.add_argument(
        "--world",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: the glue.* targets in a gloo group of 2 processes (fuzzlib.t_glue), nothing else (default %(default)s)",
    )
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--list", action="store_true", help="list the targets and exit")
    ap.add_argument("--replay", help="run case NAME:INDEX in this process and show its outcome")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--proto", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--capture", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer:
        from fuzzlib import t_glue

        t_glue.peer_main(args.peer)
        return 0
    if args.worker:
        worker(args)
        return 0
    if args.replay:
        return replay(args)
    targets = load_targets(args.only, torch=not args.no_torch, memory_limit=memory_limit(args), world=args.world)
    if args.list:
        for t in targets:
            print(f"{t.name:<40} weight {t.weight}")
        return 0
    stats = campaign(args)
    print(table(targets, stats))
    rep = report(args, targets, stats)
    if stats.harness:
        print(f"\n{len(stats.harness)} harness error(s) (bugs of the campaign, not of routepack): see the JSON")
    for outcome in ("other", "clean_unnamed"):
        for t, buckets in rep[outcome].items():
            for b, v in sorted(buckets.items(), key=lambda x: -x[1]["count"]):
                print(f"[{outcome}] {t}: {v['count']} x {b}\n    e.g. {v['reproducers'][0]['repro'][:300]}")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
