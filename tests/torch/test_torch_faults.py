"""Faults in the glue (docs/faults.md), gloo, 4 processes, the self-checks' case (2 nodes x 2
ranks, 8 experts in 12 slots, 2 MoE layers, Adam):

* a rank SIGKILLed at points of window 1's migration and step (`selfcheck.kills`): the
  survivors raise (none hangs: every run is bounded by its join timeout), keep their state
  when the kill came before the commit, and no checkpoint of the faulted window is marked
  complete; a fresh group restarted from the last complete checkpoint ends window 1 with the
  very bytes of a run without the fault (step counter, placement, slots, logical weights,
  every logical expert's Adam moments, routers, every optimizer tensor);
* plans that differ between ranks are refused before any transfer, naming both digests;
  damaged and missing plan files, and plan bytes damaged on the way, fail every rank; a rank
  late to the plan agreement makes every rank raise `AgreementError` with one message.

The default run kills at one point of each phase (before the weights move, during it,
during the optimizer state's copy, after the migration); ``ROUTEPACK_FAULTS_ALL=1`` runs
every point of `kills.KILL_POINTS` (one 4-process job each, about 20 s of CPU apiece)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import selfcheck as sc  # noqa: E402
from selfcheck import kills  # noqa: E402
from selfcheck.faults import check_agreement  # noqa: E402

WORLD = 4
#: one point per phase: before the weights move, during it, during the optimizer state's copy, after
PHASES = ("checked", "exchange", "optimizer", "after")
POINTS = tuple(kills.KILL_POINTS) if os.environ.get("ROUTEPACK_FAULTS_ALL") == "1" else PHASES


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """point -> (dead rank, checkpoint folder, survivors' figures)."""
    root = tmp_path_factory.mktemp("kills")
    out = {}
    for point in POINTS:
        dead = kills.dying_rank(point)
        folder = str(root / point)
        figs = sc.run_ranks(
            kills.check_kill,
            WORLD,
            sc.Case(),
            folder,
            point,
            dead,
            join_timeout_s=240,
            pg_timeout_s=30,
            may_die=[dead],
        )
        out[point] = (dead, folder, figs)
    return str(root), out


@pytest.fixture(scope="module")
def restarted(killed):
    root, runs = killed
    folders = [folder for _, folder, _ in runs.values()]
    return sc.run_ranks(kills.check_restart, WORLD, sc.Case(), root, folders, join_timeout_s=300)


@pytest.fixture(scope="module")
def agreement(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("plans"))
    return sc.run_ranks(check_agreement, WORLD, sc.Case(), folder, join_timeout_s=240, pg_timeout_s=30)


@pytest.mark.parametrize("point", POINTS)
def test_a_killed_rank_fails_every_survivor(killed, point):
    dead, _, figs = killed[1][point]
    assert sorted(figs) == sorted(set(range(WORLD)) - {dead}), f"rank {dead} was to die at {point}"
    for rank, f in figs.items():
        assert f["raised"] is not None, (rank, f)
        if point in kills.BEFORE_COMMIT:
            # nothing committed anywhere: each survivor holds its state from before the window
            assert f["raised"] in ("AgreementError", "MigrationError"), (rank, f)
            assert f["intact"], (rank, f)
        assert f["complete_steps"] == [1], (rank, f)  # the faulted window's checkpoint is not complete


@pytest.mark.parametrize("point", POINTS)
def test_restart_from_checkpoint_equals_the_run_without_the_fault(killed, restarted, point):
    folder = killed[1][point][1]
    for rank, f in restarted.items():
        r = f["restarts"][folder]
        assert r["loaded_step"] == 1, (rank, r["loaded_step"])
        for key, want in f["reference_step1"].items():
            assert r["loaded"][key] == want, (rank, "loaded", key)
        for key, want in f["reference_step2"].items():
            assert r["final"][key] == want, (rank, "final", key)


def test_restart_from_the_reference_checkpoint_equals_the_reference(restarted):
    for rank, f in restarted.items():
        for key, want in f["reference_step2"].items():
            assert f["reference_restarted"][key] == want, (rank, key)


def test_a_checkpoint_mixing_two_steps_is_refused_before_anything_moves(restarted):
    """Rank 0 on step 2's checkpoint, the others on step 1's (a step only some ranks saved,
    loaded without the COMPLETE mark): window 1's plan differs on rank 0, refused on every rank."""
    for rank, f in restarted.items():
        m = f["mixed"]
        assert m["raised"] == "InvalidPlanError" and m["intact"], (rank, m)
        assert "different plans" in m["message"], (rank, m)


def test_the_reference_run_changes_every_part_of_the_state(restarted):
    """Window 1 changes the placement, the slots, the weights, the moments and the step, so the
    restart's equality with the reference is not equality with the checkpoint it loaded."""
    for f in restarted.values():
        one, two = f["reference_step1"], f["reference_step2"]
        for key in ("step", "placement", "slots", "logical_weights", "logical_optimizer", "routers", "optimizer"):
            assert one[key] != two[key], key


@pytest.mark.parametrize("via", ["runner", "migrate", "agree_on_plan"])
def test_different_plans_are_refused_naming_both_digests(agreement, via):
    digests = {f["digest"] for f in agreement.values()}
    assert len(digests) == 2  # rank 0's and the others'
    for rank, f in agreement.items():
        r = f[via]
        assert r["raised"] == "InvalidPlanError", (rank, r)
        assert r["transfers"] == 0 and r["intact"], (rank, r)
        for d in digests:
            assert d in r["message"], (rank, d, r["message"])


def test_plan_files_damaged_or_missing_fail_every_rank(agreement):
    for rank, f in agreement.items():
        assert f["load_good"], rank
        for case, mine in (("load_damaged", "RoutepackFileError"), ("load_missing", "FileNotFoundError")):
            r = f[case]
            assert r["raised"] == (mine if rank == 0 else "RoutepackFileError"), (rank, case, r)
            assert "damaged.npz" in r["message"], (rank, case, r)  # the path, on every rank
            assert r["transfers"] == 0 and r["intact"], (rank, case, r)
        r = f["sent_damaged"]
        assert r["raised"] == "RoutepackFileError", (rank, r)
        assert ("<BytesIO>" if rank == WORLD - 1 else f"rank(s) [{WORLD - 1}] could not read") in r["message"], (
            rank,
            r,
        )


def test_a_rank_late_to_the_agreement_fails_every_rank_with_one_message(agreement):
    raised = {f["timeout"]["raised"] for f in agreement.values()}
    messages = {f["timeout"]["message"] for f in agreement.values()}
    assert raised == {"AgreementError"}, raised
    assert len(messages) == 1, messages
    assert all(f["timeout"]["intact"] and f["timeout"]["transfers"] == 0 for f in agreement.values())


def test_gpu_faults_runs_from_a_clone_on_one_cpu_rank():
    """tools/gpu_faults.py's one-rank path (what a one-GPU machine runs): the reference, a
    restart from its step 1, the same bytes."""
    import routepack as rp

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(Path(rp.__file__).resolve().parent.parent)}
    r = subprocess.run(
        [sys.executable, str(root / "tools" / "gpu_faults.py"), "--backend", "gloo", "--world", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restart from the reference's step 1 differs in []" in r.stdout and "PASS" in r.stdout
