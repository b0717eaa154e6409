"""The verdict ``routepack demo`` and ``routepack bench`` end with (`routepack.verdict`), the
line that points to it first, and the refusal of window counts no run can finish."""

from __future__ import annotations

import pytest

from routepack.cli import MAX_WINDOWS
from routepack.compare import BEST
from routepack.verdict import WORTH_IT, threshold_note, verdict
from test_cli import FAST, run


def ratio(against: str, median: float, lo: float, hi: float, windows: int = 4) -> dict:
    return {"policy": "routepack", "against": against, "windows": windows, "median": median, "min": lo, "max": hi}


@pytest.mark.parametrize(
    "median, lo, worth",
    [
        (1.10, 1.02, True),
        (WORTH_IT, 1.0, True),  # the threshold itself counts
        (1.049, 1.01, False),  # below the threshold
        (1.20, 0.99, False),  # slower in one window
    ],
)
def test_the_verdict_applies_its_threshold(median, lo, worth):
    line = verdict([ratio(BEST, median, lo, 1.3), ratio("static", 1.5, 1.4, 1.6)], ["static", "routepack"])
    assert line.startswith(f"verdict: routepack is {median:.3f}x the best baseline over 4 windows ")
    assert line.endswith("not worth turning on" if not worth else ": worth turning on")
    assert "\n" not in line and len(line) <= 100
    assert f"at least {WORTH_IT:.2f}x the best baseline's throughput and no window below 1x" in threshold_note()


def test_the_verdict_without_routepack_or_without_a_baseline_says_why():
    assert verdict([], ["static"]) == "verdict: none (routepack did not run: add --policy routepack)"
    for rows in ([], [ratio("routepack_placement", 1.1, 1.0, 1.2)]):
        line = verdict(rows, ["routepack", "routepack_placement"])
        assert line.startswith("verdict: none (no baseline ran") and "--policy static" in line
    assert "over this window" in verdict([ratio(BEST, 1.1, 1.1, 1.1, windows=1)], ["routepack", "eplb"])


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_demo_and_bench_point_to_the_verdict_and_end_with_it(command, tmp_path):
    args = [command, "--profile", "small-test", "--windows", "1", *FAST, "--quiet"]
    if command == "bench":
        args += ["--json", "out.json"]  # what it wrote is said before the verdict
    proc = run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.rstrip("\n").splitlines()
    assert lines[0] == f"routepack {command}: the last line is the verdict (routepack against the best baseline)"
    assert lines[-1].startswith("verdict: routepack is ") and "x the best baseline over this window" in lines[-1]
    assert lines[-2].startswith("worth turning on: a median of at least") or "worth turning on: a median" in lines[-3]
    assert sum(line.startswith("verdict:") for line in lines) == 1


def test_the_verdict_without_a_baseline_in_the_run(tmp_path):
    proc = run(["demo", "--profile", "small-test", "--windows", "1", "--policy", "routepack", "--quiet"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n").splitlines()[-1].startswith("verdict: none (no baseline ran")


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_absurd_window_counts_are_refused_naming_the_maximum(command, tmp_path):
    proc = run([command, "--windows", "100000000000"], tmp_path, small=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"--windows 100000000000: at most {MAX_WINDOWS} (" in proc.stderr, proc.stderr
    assert "MB a window of tiny" in proc.stderr and "ETA" not in proc.stderr
    ok = run([command, "--windows", str(MAX_WINDOWS), "--npz", "a.npz", "b.npz"], tmp_path, small=False)
    assert "at most" not in ok.stderr  # the maximum itself passes this check (--npz refuses it instead)


def test_the_sweep_ends_with_the_verdict_too(tmp_path):
    args = ["bench", "--sweep", "--profile", "small-test", "--windows", "1", "--quiet"]
    proc = run(
        args + ["--placements", "eplb", "routepack", "--packings", "routepack", "--replications", "none"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.rstrip("\n").splitlines()
    assert lines[0] == "routepack bench --sweep: the last line is the verdict (routepack against the best baseline)"
    assert lines[-1].startswith("verdict: routepack is ") and " the best baseline over this window (" in lines[-1]
