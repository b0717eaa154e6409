"""The command line, run as a user runs it: a subprocess, its exit status, stdout and stderr.

Most runs use a small profile (registered in the child process before `routepack.cli.main`)
so the suite stays short; one runs ``routepack bench --profile tiny --windows 2`` itself,
the issue's acceptance command (about 7 s on the 2-core reference machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import List

import numpy as np
import pytest

import routepack as rp
from routepack import compare as rp_compare
from routepack.compare import available_presets

PYTHON_DIR = str(Path(rp.__file__).resolve().parent.parent)

#: A child that registers the small profile, optionally hides matplotlib, and runs the CLI.
CHILD = """
import sys
from dataclasses import replace
if {hide_matplotlib!r}:
    class _Hide:
        def find_spec(self, name, path=None, target=None):
            if name == "matplotlib" or name.startswith("matplotlib."):
                raise ImportError("No module named 'matplotlib' (hidden by the test)")
    sys.meta_path.insert(0, _Hide())
import routepack as rp
import numpy as np

from routepack import compare as rp_compare
from routepack.compare import available_presets
from routepack import cli
rp.traces.PROFILES["small-test"] = replace(
    rp.traces.profile("tiny"), name="small-test", num_layers=4, attention=("linear",) * 3 + ("full",),
    num_experts=32, dp=8, ep=4, gpus_per_node=2, slots_per_rank=9, samples=96, group_size=4,
    token_cap=16384, max_response=8192)
sys.exit(cli.main(sys.argv[1:]))
"""

FAST = ["--policy", "static", "--policy", "eplb", "--policy", "routepack", "--anneal-moves", "2000"]


def run(
    args: List[str], cwd: Path, hide_matplotlib: bool = False, small: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if small:
        cmd = [sys.executable, "-c", CHILD.format(hide_matplotlib=hide_matplotlib), *args]
    else:
        cmd = [sys.executable, "-m", "routepack", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, nothing but one line on stderr (no traceback), holding every fragment."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def test_bench_tiny_two_windows(tmp_path):
    """The acceptance command: every preset, the table with its legend, the ratios against
    the best baseline, JSON and figure."""
    proc = run(
        ["bench", "--profile", "tiny", "--windows", "2", "--json", "b.json", "--figure", "b.png"], tmp_path, small=False
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for text in (
        "of balanced",
        "thr/best",
        "best baseline",
        "balanced (reference)",
        "columns (medians over windows):",
        "repl s",
        "routepack's throughput over each policy",
        "eplb_hierarchical",
    ):
        assert text in out, text
    assert "of ideal" not in out
    # the tables fit 100 columns (they were 167 wide)
    assert max(len(line) for line in out.splitlines()) <= 100, max(out.splitlines(), key=len)
    # tiny's EP group is one node: EPLB's hierarchical configuration is its global one, and says so
    assert "the eplb_hierarchical rows equal the eplb rows" in out
    hier = {r["policy"]: r["step_time"] for r in json.loads((tmp_path / "b.json").read_text())["rows"]}
    assert hier["eplb_hierarchical"] == hier["eplb"]
    assert "generating 3 synthetic tiny windows" in proc.stderr
    # stderr is a pipe, not a terminal: plain progress lines, first and last
    assert "bench: 0/26 plans" in proc.stderr and "bench: 26/26 plans" in proc.stderr
    data = json.loads((tmp_path / "b.json").read_text())
    assert {r["policy"] for r in data["rows"]} == set(available_presets())
    best = next(r for r in data["ratios"] if r["against"] == "best baseline")
    assert best["windows"] == 2 and best["min"] <= best["median"] <= best["max"]
    assert set(data["best_of"]) == {"1", "2"}
    if _has_matplotlib():
        assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == (["b.json", "b.png"] if _has_matplotlib() else ["b.json"])


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_bench_without_matplotlib_prints_the_table_and_says_how_to_get_the_figure(tmp_path):
    args = ["bench", "--profile", "small-test", "--windows", "1", *FAST, "--figure", "f.png"]
    proc = run(args, tmp_path, hide_matplotlib=True)
    assert proc.returncode == 0, proc.stderr
    assert "best baseline" in proc.stdout
    assert 'pip install ".[bench]"' in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_demo_and_the_baseline_column_without_static(tmp_path):
    proc = run(
        [
            "demo",
            "--profile",
            "small-test",
            "--windows",
            "1",
            "--policy",
            "eplb",
            "--policy",
            "routepack",
            "--anneal-moves",
            "2000",
            "--quiet",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # --quiet: no progress
    assert "thr/eplb" in proc.stdout and "thr/static" not in proc.stdout
    assert " nan" not in proc.stdout


def test_bench_writes_no_file_unless_asked(tmp_path):
    proc = run(["bench", "--profile", "small-test", "--windows", "1", *FAST, "--quiet"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.iterdir()) == []  # it wrote routepack_bench.png here by default


def test_help_promises_what_it_does():
    top = run(["--help"], Path.cwd())
    bench = run(["bench", "--help"], Path.cwd())
    assert top.returncode == bench.returncode == 0
    assert "JSON dump" not in top.stdout + bench.stdout
    assert "--json FILE" in top.stdout and "No file is written unless" in " ".join(top.stdout.split())
    flat = " ".join(bench.stdout.split())
    for flag in (
        "--json JSON also write the results as JSON to this file (default: none)",
        "--figure FIGURE also draw",
    ):
        assert flag in flat, flag
    assert "--results RESULTS also write a Markdown results page" in flat


def test_a_lone_policy_names_its_column_in_full(tmp_path):
    """``--policy routepack`` alone: the baseline column is routepack's own (it was cut to
    ``thr/routepac``)."""
    proc = run(["demo", "--profile", "small-test", "--windows", "1", "--policy", "routepack", "--quiet"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "thr/routepack " in proc.stdout and "thr/routepac " not in proc.stdout


def test_no_note_where_hierarchical_eplb_differs(tmp_path):
    """small-test's EP group spans 2 nodes: one group per node is 2 groups, the model has 1."""
    args = ["demo", "--profile", "small-test", "--windows", "1", "--quiet", "--policy", "eplb"]
    proc = run(args + ["--policy", "eplb_hierarchical"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "note:" not in proc.stdout


def test_the_sweep_fits_100_columns(tmp_path):
    proc = run(["bench", "--sweep", "--profile", "small-test", "--windows", "1", "--quiet"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    assert sum(line.startswith("* routepack ") for line in lines) == 2  # marked in both tables


def test_progress_off_a_terminal_is_plain_lines():
    import io

    from routepack import progress

    out = io.StringIO()
    bar = progress.bar(5, "plan", "bench", file=out)
    for _ in range(5):
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("bench: 0/5 plans") and lines[-1].startswith("bench: 5/5 plans")
    assert "\r" not in out.getvalue() and len(lines) == 2  # the interval (10 s) holds the middle back
    assert isinstance(progress.bar(3, "plan", "x", show=False, file=out), progress._Off)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    from tqdm import tqdm

    assert isinstance(progress.bar(3, "plan", "x", file=Terminal()), tqdm)


def test_verl_example_without_verl_says_what_to_install(tmp_path):
    example = Path(__file__).resolve().parent.parent / "examples" / "verl_balance.py"
    child = (
        "import runpy, sys\n"
        "sys.modules['verl'] = None  # as if verl were not installed\n"
        f"sys.argv = [{str(example)!r}, '--verl']\n"
        f"runpy.run_path({str(example)!r}, run_name='__main__')\n"
    )
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "pip install" in proc.stderr and "verl" in proc.stderr and proc.stdout == ""


def test_version():
    proc = run(["--version"], Path.cwd(), small=False)
    assert proc.returncode == 0 and proc.stdout.strip() == f"routepack {rp.__version__}"


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["bench", "--policy", "nope"], ["--policy", "'nope'", "static", "routepack", "eplb_oracle"]),
        (["bench", "--profile", "huge"], ["--profile", "'huge'", "tiny", "flash"]),
        (["bench", "--seed", "-1"], ["--seed", ">= 0"]),
        (["bench", "--windows", "0"], ["--windows", ">= 1"]),
        (["bench", "--anneal-moves", "-5"], ["--anneal-moves", ">= 0"]),
        (["bench", "--anneal-moves", "many"], ["--anneal-moves", "integer"]),
        (["bench", "--npz", "only_one.npz"], ["--npz", "at least 2"]),
        (["bench", "--json", "no/such/dir/out.json"], ["--json", "does not exist"]),
        (["bench", "--figure", "."], ["--figure", "directory"]),
        (["frobnicate"], ["frobnicate"]),
        ([], ["command"]),
    ],
)
def test_user_errors_are_one_line_and_exit_2(tmp_path, args, fragments):
    proc = run(args, tmp_path)
    one_line_error(proc, *fragments)
    assert "profile" not in proc.stdout  # refused before any window is generated


@pytest.mark.parametrize("content", [None, b"not a zip file", "wrong arrays"])
def test_bad_npz_files_are_one_line_errors(tmp_path, content):
    import numpy as np

    good = tmp_path / "good.npz"
    next(rp.traces.synthetic(replace(rp.traces.profile("tiny"), samples=16, group_size=4), 1, 0)).save(good)
    bad = tmp_path / "bad.npz"
    if content == "wrong arrays":
        np.savez(bad, x=np.zeros(3))
    elif content is not None:
        bad.write_bytes(content)
    proc = run(["bench", "--profile", "tiny", "--npz", str(good), str(bad), "--quiet"], tmp_path)
    one_line_error(proc, "--npz", str(bad))


def test_an_input_the_planner_refuses_is_a_one_line_error(tmp_path):
    """Windows of another model (4 layers) against the tiny profile's cost model (20)."""
    files: List[str] = []
    small = replace(rp.traces.profile("tiny"), num_layers=4, attention=("full",) * 4, samples=16, group_size=4)
    for i, w in enumerate(rp.traces.synthetic(small, 2, 0)):
        files.append(str(tmp_path / f"w{i}.npz"))
        w.save(files[-1])
    proc = run(["bench", "--profile", "tiny", "--npz", *files, "--quiet", "--policy", "static"], tmp_path)
    one_line_error(proc, "routepack bench: error:", "layers")


def _row(policy: str, window: int, step: float, bound: float = float("nan")) -> rp_compare.Row:
    return rp_compare.Row(
        policy=policy,
        window=window,
        step_time=step,
        throughput=1000.0 / step,
        fraction_of_balanced=1.0 / step,
        attention=0.1,
        expert=0.2,
        all_to_all=0.3,
        replication=0.0,
        migration=0.0,
        imbalance=1.1,
        num_micro=3,
        micro_lower_bound=3,
        plan_seconds=0.01,
        ideal_time=1.0,
        fraction_of_bound=bound / step,
        lower_bound_time=bound,
    )


def test_the_bound_column_appears_exactly_when_simulate_reports_it():
    """`of bound` and the `lower bound` row come from SimResult's fraction_of_bound /
    lower_bound_time; without them (NaN) neither is shown."""

    def rows(bound: float):
        return [_row("static", w, 4.0, bound) for w in (1, 2)] + [
            _row("eplb", 1, 2.0, bound),
            _row("eplb", 2, 2.5, bound),
            _row("relibra", 1, 2.2, bound),
            _row("relibra", 2, 2.0, bound),
            _row("routepack", 1, 1.6, bound),
            _row("routepack", 2, 1.8, bound),
        ]

    without = rp_compare.summarise(rows(float("nan")))
    text = rp_compare.format_table(without)
    assert "of bound" not in text and "lower bound" not in [s["policy"] for s in without]
    with_bound = rp_compare.summarise(rows(0.8))
    text = rp_compare.format_table(with_bound)
    assert "of bound" in text and with_bound[-1]["policy"] == "lower bound"
    ours = next(s for s in with_bound if s["policy"] == "routepack")
    assert ours["of_bound"] == pytest.approx(np.median([0.8 / 1.6, 0.8 / 1.8]))
    best = next(s for s in with_bound if s["policy"] == "best baseline")
    assert best["best_of"] == {"1": "eplb", "2": "relibra"} and best["step_s"] == pytest.approx(2.0)
    (vs_best,) = [r for r in rp_compare.ratios(rows(0.8)) if r["against"] == "best baseline"]
    assert (vs_best["min"], vs_best["max"]) == pytest.approx((2.0 / 1.8, 2.0 / 1.6))
