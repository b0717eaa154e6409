"""Self-checks of `routepack.torch`, shared by ``tests/torch`` (gloo, 4 CPU processes) and
``tools/gpu_check.py`` (NCCL on GPUs). A test harness, not part of the package: imported as
``selfcheck`` with ``tests/torch`` on ``sys.path`` (pytest puts it there for the tests in that
folder; ``tools/gpu_check.py`` adds it).

Each ``check_*`` function runs on every rank of an initialised process group and returns a
dict of measured figures (errors, equalities, counts); the callers assert on them. Everything
is generated from ``Case.seed``, so every rank builds the same windows and plans, and every
plan passes `Plan.validate` before use.

* `check_windows`: several windows in sequence, each with a plan that migrates experts
  (weights + Adam state), replicates hot experts (ReLibra rows in odd cells, MindSpeed rows in
  even ones) and holds redundant slots; forward outputs, input/router/expert gradients against
  a single-process dense reference; a static-placement twin trained on the same data; the load
  each rank received against ``_core.rank_tokens`` and ``simulate``'s imbalance.
* `check_faults`: bad plans refused before any transfer; a fault raised on one rank at each
  protocol point leaves every rank intact; the migration then succeeds bit for bit;
  `broadcast_plan`.
* `check_peer_death`: a rank exits in the middle of a migration; the others raise within the
  timeout with their state intact.
* `check_agreement`: plans that differ between ranks refused naming both digests; damaged
  and missing plan files fail every rank; a rank late to the plan agreement fails every
  rank with one message.
* `kills.check_kill` / `kills.check_restart`: a rank SIGKILLed at each point of a migration,
  then a fresh group restarted from the last complete checkpoint, compared byte for byte
  with a run without the fault (docs/faults.md).
* `check_zero_tokens`: steps where some (or all) ranks have no tokens match the dense
  reference forward and backward; a bad argument on one rank makes every rank raise.

The parts: `case` (sizes, data and plans from the seed), `model` (the test model and the
figures compared across ranks), `windows` (`check_windows`), `faults` (`check_faults`,
`check_peer_death`, `check_agreement`), `kills` (killed ranks, checkpoints, restarts), `zero`
(`check_zero_tokens`); `run_ranks` is `routepack.torch.spawn`'s.
"""

from routepack.torch.spawn import run_ranks
from selfcheck.case import (
    Case,
    cell_origin,
    make_layout,
    make_placement,
    make_plans,
    make_replicas,
    make_window,
    migration_rows,
)
from selfcheck.faults import check_agreement, check_faults, check_peer_death, count_transfers
from selfcheck.model import (
    EPModel,
    Weights,
    fingerprints,
    forward,
    logical_weights,
    make_groups,
    rel_err,
)
from selfcheck.windows import check_windows
from selfcheck.zero import check_zero_tokens, expected_messages

__all__ = [
    "Case",
    "EPModel",
    "Weights",
    "cell_origin",
    "check_agreement",
    "check_faults",
    "check_peer_death",
    "check_windows",
    "check_zero_tokens",
    "count_transfers",
    "expected_messages",
    "fingerprints",
    "forward",
    "logical_weights",
    "make_groups",
    "make_layout",
    "make_placement",
    "make_plans",
    "make_replicas",
    "make_window",
    "migration_rows",
    "rel_err",
    "run_ranks",
]
