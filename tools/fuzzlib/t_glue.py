"""`routepack.torch` in a gloo world of 2 ranks (issue 40: the torch glue in small gloo worlds),
targets ``glue.*``, run with ``fuzz_campaign.py --world 2``.

The campaign's worker is rank 0; on its first case it starts a peer process, rank 1 (a child
in its session: killed with it), and the two join one gloo group over a file store. Before
each case the worker sends the peer the case's place in its target's stream (`Both`); the
peer builds the same case from the same seed and runs the rank-1 side of it. Each case's
function takes the rank and does what that rank of a job does; inputs may differ between the
ranks as the glue promises to handle (a plan refused on one rank, different plans, a bad value
on one rank, a rank fed other ids). The worker classifies rank 0's outcome as usual and adds
rank 1's: both returned (rank 0's result checked), or both refused with a `RoutepackError`;
anything else, one rank returning while the other raises, a peer that does not answer within
``ANSWER_S`` or that raised something else, counts ``other``. After a case whose collectives
may have failed the group is unusable: the worker asks for a restart (`BROKEN`) and the next
case runs in a fresh pair.

* ``glue.broadcast_plan``, ``glue.load_plan``, ``glue.agree_on_plan``, ``glue.gather_ints``:
  the agreements, with a non-plan or a damaged, missing file on the source rank, plans that
  differ, values bad on one rank or of different counts;
* ``glue.plan_window_distributed``: plans equal to `plan_window`'s byte for byte; an argument
  bad on both ranks, or different on one (refused naming it);
* ``glue.gather_window``: each rank's own samples, the whole window back;
* ``glue.migrate``: EP 2, Adam stepped once; every slot holds its expert's weights and Adam
  moments after it; a plan tampered on one rank, or no optimizer while one holds state;
* ``glue.PlanRunner``: a window end to end on EP 2 (plans of `plan_window`'s presets with
  migration, redundant experts and replicas; routes precomputed or not): the step's audit
  clean and every rank's received tokens the plan's; faults on one rank or both: another plan,
  a microbatch not run, ids other than the replay, no optimizer, a cap below a sample.
"""

from __future__ import annotations

import datetime
import json
import os
import select
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import routepack as rp

from fuzzlib.engine import Case, Target
from fuzzlib.t_glue_limits import ANSWER_S

#: set when a case may have left the group unusable: the worker restarts (fuzz_campaign.worker)
BROKEN = False
_PEER: Dict[str, Any] = {}
_BUILT: Dict[str, Any] = {}


def targets() -> List[Target]:
    names = [
        ("broadcast_plan", 1),
        ("load_plan", 1),
        ("agree_on_plan", 1),
        ("gather_ints", 1),
        ("plan_window_distributed", 1),
        ("gather_window", 1),
        ("migrate", 1),
        ("PlanRunner", 1),
    ]
    return [Target(f"glue.{n}", f"routepack.torch:{n}", _stream(f"glue.{n}", n), weight=w, batch=8) for n, w in names]


def _stream(target: str, name: str) -> Callable[[int, int], List[Case]]:
    """The cases of ``name`` with each function wrapped in `Both` (its place in the stream)."""

    def gen(seed: int, n: int) -> List[Case]:
        if not _BUILT:
            from fuzzlib import t_glue_cases

            _BUILT.update(t_glue_cases.makers())
        rng = np.random.default_rng(seed)
        cases = [_BUILT[name](rng) for _ in range(n)]
        for i, c in enumerate(cases):
            c.fn = Both(c.fn, target, seed, i, n)
        return cases

    return gen


# ------------------------------------------------------------------ the two ranks
def _group(rank: int, store: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
        )


def _peer() -> Any:
    """The peer process (rank 1), started on first use, the group joined."""
    if "proc" not in _PEER:
        store = os.path.join(tempfile.mkdtemp(prefix="rp_fuzz_world_"), "store")
        cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "fuzz_campaign.py"), "--peer", store]
        cmd += ["--seed", "0"]
        _PEER["proc"] = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=dict(os.environ)
        )
        _group(0, store)
    return _PEER["proc"]


class Both:
    """A case's function run by both ranks: here (rank 0) ``fn(0, *args)`` while the peer runs
    ``fn(1, ...)`` of the same case (`peer_main`); see the module docstring."""

    def __init__(self, fn: Callable[..., Any], target: str, seed: int, index: int, batch: int) -> None:
        self.fn, self.target, self.seed, self.index, self.batch = fn, target, seed, index, batch
        self.__qualname__ = getattr(fn, "__qualname__", target)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global BROKEN
        proc = _peer()
        proc.stdin.write((json.dumps([self.target, self.seed, self.index, self.batch]) + "\n").encode())
        proc.stdin.flush()
        mine: Any = None
        err: Optional[BaseException] = None
        try:
            mine = self.fn(0, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 (rank 1's outcome is read first, then re-raised)
            err = e
        ready, _, _ = select.select([proc.stdout], [], [], ANSWER_S)
        line = proc.stdout.readline() if ready else b""
        if not line:
            BROKEN = True
            raise AssertionError(f"rank 1 did not answer within {ANSWER_S:g} s (rank 0: {_said(err)})")
        theirs = json.loads(line)
        agree = (err is None) == (theirs[0] == "ok")
        if (err is not None and not isinstance(err, rp.RoutepackError)) or theirs[0] == "other" or not agree:
            BROKEN = True  # a collective may have been left half-way: the next case runs in a fresh pair
        if theirs[0] == "other":
            raise AssertionError(f"rank 1 raised {theirs[1]} (rank 0: {_said(err)})")
        if not agree:
            raise AssertionError(f"the ranks disagree: rank 0 {_said(err)}, rank 1 {theirs[0]} {theirs[1]}")
        if err is not None:
            raise err
        return mine


def _said(err: Optional[BaseException]) -> str:
    return "returned" if err is None else f"raised {type(err).__name__}: {str(err)[:200]}"


def peer_main(store: str) -> None:
    """Rank 1: joins the group, then runs the rank-1 side of each case the worker names (one
    JSON line each on stdin), answering ``["ok" | "clean" | "other", text]`` on stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # what the cases print must not mix with the answers
    _group(1, store)
    by_name = {t.name: t for t in targets()}
    cache: Dict[Tuple[str, int], List[Case]] = {}
    for line in sys.stdin:
        target, seed, index, batch = json.loads(line)
        try:
            cases = cache.get((target, seed))
            if cases is None:
                cache.clear()
                cases = cache[(target, seed)] = by_name[target].gen(seed, batch)
            case = cases[index]
            args, kwargs = case.setup() if case.setup is not None else (case.args, case.kwargs)
            case.fn.fn(1, *args, **kwargs)
            answer = ["ok", ""]
        except rp.RoutepackError as e:
            answer = ["clean", f"{type(e).__name__}: {str(e)[:300]}"]
        except BaseException as e:  # noqa: BLE001
            answer = ["other", f"{type(e).__name__}: {str(e)[:300]} {traceback.format_exc()[-600:]}"]
        out.write(json.dumps(answer) + "\n")


__all__ = ["BROKEN", "Both", "peer_main", "targets"]
