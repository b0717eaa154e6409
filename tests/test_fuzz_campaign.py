"""Smoke test of ``tools/fuzz_campaign.py`` (the long fuzz campaign, tools/README.md): a few
seconds of it, and the structure of its JSON. The campaign's findings are its output, not this
test's business; here only the tool itself must work: the table, the JSON, its reproducers,
determinism for a seed, and that a crashing case is counted, not fatal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "fuzz_campaign.py"
OUTCOMES = ("valid", "clean_named", "clean_unnamed", "other")


def run(tmp_path: Path, *args: str, name: str = "out.json") -> dict:
    out = tmp_path / name
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__import__("routepack").__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--seed", "3", "--json", str(out), "--no-torch", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "function" in proc.stdout and "clean(named)" in proc.stdout and "total" in proc.stdout
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    only = "ModelShape,Window.load,Plan.validate,CostModel.from_json,placement.rebalance_experts"
    return run(tmp_path_factory.mktemp("fuzz"), "--only", only, "--stop", "25", "--minutes", "3")


def test_json_holds_the_table_per_function(report: dict) -> None:
    assert report["seed"] == 3 and report["cases"] == 25 and not report["harness_errors"]
    assert set(report["targets"]) == {
        "ModelShape",
        "Window.load",
        "Plan.validate",
        "CostModel.from_json",
        "placement.rebalance_experts",
    }
    for name, row in report["targets"].items():
        assert row["cases"] == sum(row[o] for o in OUTCOMES) > 0, name
        assert sum(sum(v.values()) for v in row["by_kind"].values()) == row["cases"]
    assert sum(r["cases"] for r in report["targets"].values()) == report["cases"]


def test_buckets_keep_at_most_five_reproducers(report: dict) -> None:
    for outcome in ("other", "clean_unnamed"):
        for name, buckets in report[outcome].items():
            assert sum(b["count"] for b in buckets.values()) == report["targets"][name][outcome]
            for b in buckets.values():
                assert 1 <= len(b["reproducers"]) <= 5
                assert all(r["repro"] and r["case"].startswith(name + ":") for r in b["reproducers"])


def test_same_seed_same_cases(tmp_path: Path) -> None:
    a = run(
        tmp_path,
        "--only",
        "ModelShape,Placement.static,Topology.check",
        "--stop",
        "16",
        "--minutes",
        "2",
        name="a.json",
    )
    b = run(
        tmp_path,
        "--only",
        "ModelShape,Placement.static,Topology.check",
        "--stop",
        "16",
        "--minutes",
        "2",
        name="b.json",
    )
    strip = lambda r: {k: {o: v[o] for o in OUTCOMES} for k, v in r["targets"].items()}  # noqa: E731
    assert strip(a) == strip(b)
    assert {k: sorted(v) for k, v in a["other"].items()} == {k: sorted(v) for k, v in b["other"].items()}


def test_aborts_kills_hangs_memory_errors_and_stderr_are_other_and_the_campaign_goes_on(
    tmp_path: Path, monkeypatch
) -> None:
    """The self-test target returns, aborts, hangs, prints to stderr, is killed and raises a
    bare MemoryError, in turn: each of the last five is one `other` case, and the worker
    restarted after each goes on."""
    monkeypatch.setenv("ROUTEPACK_FUZZ_SELFTEST", "1")
    r = run(tmp_path, "--only", "selftest", "--stop", "6", "--minutes", "2", "--call-timeout", "3")
    row = r["targets"]["selftest"]
    assert (row["cases"], row["valid"], row["other"]) == (6, 1, 5) and not r["harness_errors"]
    buckets = r["other"]["selftest"]
    assert any(b.startswith("abort: signal SIGABRT") for b in buckets), buckets
    assert any(b.startswith("abort: signal SIGKILL") for b in buckets), buckets
    assert any(b.startswith("hang: no return within 3 s") for b in buckets), buckets
    assert any(b.startswith("output on stderr/stdout: thread 'main' panicked") for b in buckets), buckets
    assert any(b.startswith("MemoryError: Unable to allocate") for b in buckets), buckets


def test_the_memory_limit_mode(tmp_path: Path) -> None:
    """Every case runs under ``--memory-limit-gib`` (8 GiB by default), and the memory-limit
    family sized from it runs: calls that would allocate more than the limit, each refused
    naming the argument that sized it and the bytes (issue 33's acceptance: no abort, no
    other, nothing unnamed); without a limit the family is left out."""
    r = run(tmp_path, "--only", "memory.", "--stop", "14", "--minutes", "5")
    assert r["memory_limit_gib"] == 8.0 and not r["harness_errors"]
    assert {n for n, row in r["targets"].items() if row["cases"]} >= {
        "memory.Placement.static",
        "memory.Window.from_routed_experts",
        "memory.placement.rebalance_experts",
        "memory.plan_window",
        "memory.held",
    }
    for name, row in r["targets"].items():
        assert row["clean_named"] == row["cases"], (name, r["other"].get(name), r["clean_unnamed"].get(name))
    env = {**os.environ, "PYTHONPATH": str(Path(__import__("routepack").__file__).parents[1])}
    listed = subprocess.run(
        [sys.executable, str(TOOL), "--list", "--no-torch", "--memory-limit-gib", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert listed.returncode == 0 and "memory." not in listed.stdout and "plan_window" in listed.stdout


def test_replay_runs_one_case(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__import__("routepack").__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--replay", "Topology:5", "--seed", "3", "--no-torch"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert "Topology(" in proc.stdout and '"outcome"' in proc.stdout
