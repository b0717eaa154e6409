"""The command line, one target per subcommand (issue 40: every subcommand at least 10^4 cases).

Each case is an argv given to `routepack.cli.main` in this process (`run_cli`): it must either
exit 0 (``valid``) or refuse the way the CLI promises, exit status 2 and one ``error:`` line
on stderr, no traceback (``clean``; named when the line names a flag, a path or an option).

* ``cli[top]``: ``--version``, ``--help``, no command, an unknown command, stray arguments;
* ``cli[demo]`` / ``cli[bench]``: a valid argv (two small windows of the ``tiny`` profile's shape
  written with ``Window.save`` and given as ``--npz``, one to three cheap presets, no layout
  search; now and then the profile's own synthetic windows), else that argv with one flaw: a
  count below its minimum or not an int, a seed or a budget past int64, an unknown preset or
  choice, ``--npz`` of one file, a missing, damaged or foreign file, ``--windows`` with
  ``--npz``, a cost file that is missing, damaged or of another layer count, an output path
  in a folder that does not exist or that is a folder (bench), ``--oversize split`` without
  ``--cp``, ``--cp`` without it or not dividing ep, a token cap below a sample (bench), sweep
  options without ``--sweep``, an unknown option, a flag without its value;
* ``cli[bench --sweep]``: the sweep narrowed to a few cheap combinations, and its flaws
  (``--policy`` or ``--figure`` with it, unknown names);
* ``cli[calibrate]`` / ``cli[measure]``: ``--help``, and argvs whose flaw the CLI must catch
  before it measures anything (a full run takes minutes: their own tests run those): counts,
  floats and choices, output paths, options that do not go together, a workload that cannot
  exist, a cost file that is missing or damaged. A flaw found only after the work starts
  shows as a hang (over ``--call-timeout``), counted ``other``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any, Callable, List

import numpy as np
import routepack as rp
from routepack import cli, traces

from random_plans import random_window
from fuzzlib.engine import Case, Target, mixed
from fuzzlib.inputs import damage, damage_text
from fuzzlib.t_model import tmp_path

TINY = traces.profile("tiny")
#: presets a valid case picks from: planned in well under a second on two small windows
CHEAP = ["static", "eplb", "eplb_oracle", "hot_n", "relibra", "routepack_no_replication", "routepack_packing"]
BAD_COUNTS = ["0", "-1", "x", "", "1.5", "1e3", "0x10", "nan", " 2", "٣"]
HUGE = [str(2**63), str(2**64), str(10**30)]


class CliRefusal(rp.RoutepackError):
    """The CLI refused its arguments the way it promises: status 2 and one line on stderr."""


def run_cli(argv: List[str]) -> Any:
    """`routepack.cli.main(argv)`: its stdout on exit 0, `CliRefusal` on exit 2 with one
    ``error:`` line; anything else (a traceback, another status, several lines) fails."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    errors = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
    assert "Traceback" not in err.getvalue(), "a traceback on stderr: " + err.getvalue()[-300:]
    if code == 0:
        return out.getvalue()
    assert code == 2 and len(errors) == 1, f"exit {code} with stderr {err.getvalue().splitlines()[-3:]!r}"
    raise CliRefusal(errors[0])


def _windows(rng: np.random.Generator, n: int = 2) -> List[str]:
    """``n`` small windows of the tiny profile's shape (L, E), saved; their paths."""
    paths = []
    for _ in range(n):
        # at least one sample a DP rank (the tiny profile's dp): fewer is a refusal, not a valid case
        w = random_window(
            rng, int(rng.integers(TINY.dp, 2 * TINY.dp + 9)), TINY.num_layers, TINY.num_experts, max_len=24
        )
        p = tmp_path("cliw")
        w.save(p)
        paths.append(p)
    return paths


def _cost(rng: np.random.Generator, layers: int = TINY.num_layers) -> str:
    p = tmp_path("clic")
    cost = TINY.cost()
    if layers != cost.num_layers:
        cost = rp.CostModel.from_json(json.dumps({**json.loads(cost.to_json()), "a_quad": [0.0] * layers}))
    cost.save(p)
    return p


def _missing() -> str:
    return "/nonexistent/routepack/" + Path(tmp_path("x")).name


def _flag_names(argv: List[str]) -> tuple:
    """What a refusal may name: every flag of the argv (and its value's name, ``--top-k`` as
    ``top_k``), every path, the subcommand's words."""
    flags = tuple(a.split("=")[0] for a in argv if a.startswith("--") and len(a) > 2)
    dests = tuple(f[2:].replace("-", "_") for f in flags)
    # `measure` checks its workload as `Workload` fields: "workload.top_k: 5 > experts 4"
    fields = tuple(f"workload.{d}" for d in dests) if argv[:1] == ["measure"] else ()
    # argparse names a stray word as "unrecognized arguments: <word>"
    stray = tuple(f"arguments: {a}" for a in argv if a and not a.startswith("-"))
    return flags + dests + fields + stray + tuple(a for a in argv if "/" in a) + ("command", "argv")


# ------------------------------------------------------------------ demo, bench
def _bench_valid(rng: np.random.Generator, command: str) -> List[str]:
    argv = [command, "--quiet", "--anneal-moves", str(int(rng.choice([0, 0, 50])))]
    if rng.random() < 0.03:  # the profile's own synthetic windows (slower: a second or two)
        argv += ["--windows", "1"]
    else:
        argv += ["--npz", *_windows(rng, int(rng.integers(2, 4)))]
    for p in rng.choice(CHEAP, size=int(rng.integers(1, 4)), replace=False):
        argv += ["--policy", str(p)]
    if rng.random() < 0.3:
        argv += ["--seed", str(int(rng.integers(0, 2**31)))]
    if rng.random() < 0.2:
        argv += ["--overlap", str(rng.choice(["none", "dispatch_combine"]))]
    if rng.random() < 0.2:
        argv += ["--cost", _cost(rng)]
    if command == "bench":
        if rng.random() < 0.3:
            argv += ["--json", tmp_path("clij")]
        if rng.random() < 0.2:
            argv += ["--token-cap", str(int(rng.integers(48, 4096)))]
        if rng.random() < 0.15:
            mode = str(rng.choice(["refuse", "alone", "split"]))
            argv += ["--oversize", mode] + (["--cp", str(int(rng.choice([2, 4, 8])))] if mode == "split" else [])
        if rng.random() < 0.1:
            argv += ["--results", tmp_path("clir") + ".md"]
        if rng.random() < 0.05:
            argv += ["--figure", ""]
    return argv


def _sweep_valid(rng: np.random.Generator) -> List[str]:
    argv = ["bench", "--sweep", "--quiet", "--anneal-moves", "0", "--npz", *_windows(rng)]
    argv += ["--placements", *rng.choice(["static", "eplb", "relibra"], size=int(rng.integers(1, 3)), replace=False)]
    argv += ["--packings", *rng.choice(["sequential", "kk"], size=int(rng.integers(1, 3)), replace=False)]
    argv += ["--replications", *rng.choice(["none", "hot_n"], size=int(rng.integers(1, 3)), replace=False)]
    if rng.random() < 0.3:
        argv += ["--loads", str(rng.choice(["window", "previous"]))]
    if rng.random() < 0.2:
        argv += ["--json", tmp_path("clij")]
    return argv


def _set(argv: List[str], flag: str, value: Any) -> List[str]:
    """``argv`` with ``flag``'s value replaced (or the pair added); None drops the flag."""
    out = list(argv)
    if flag in out:
        i = out.index(flag)
        end = i + 1
        while end < len(out) and not out[end].startswith("--"):
            end += 1
        del out[i:end]
    if value is None:
        return out
    return out + [flag] + (value if isinstance(value, list) else [str(value)])


def _bench_flaw(rng: np.random.Generator, argv: List[str], command: str) -> List[str]:
    flaws: List[Callable[[], List[str]]] = [
        lambda: _set(argv, "--anneal-moves", str(rng.choice(BAD_COUNTS[1:] + HUGE[1:]))),
        lambda: _set(argv, "--seed", str(rng.choice(BAD_COUNTS[1:] + HUGE))),
        lambda: _set(_set(argv, "--npz", None), "--windows", str(rng.choice(BAD_COUNTS))),
        lambda: argv + ["--windows", "1"] if "--npz" in argv else _set(argv, "--windows", "0"),
        lambda: _set(argv, "--policy", "nope") + ["--policy", "static"],
        lambda: _set(argv, "--overlap", str(rng.choice(["nope", "", "None"]))),
        lambda: _set(argv, "--profile", str(rng.choice(["nope", "", "TINY"]))),
        lambda: _set(argv, "--npz", _windows(rng, 1)),
        lambda: _set(argv, "--npz", [_missing(), *_windows(rng, 1)]),
        lambda: _set(argv, "--npz", [str(Path(tmp_path("d")).parent), *_windows(rng, 1)]),
        lambda: _set(argv, "--npz", _damaged_window(rng)),
        lambda: _set(argv, "--npz", _foreign_window(rng)),
        lambda: _set(argv, "--cost", _missing()),
        lambda: _set(argv, "--cost", _damaged_cost(rng)),
        lambda: _set(argv, "--cost", _cost(rng, int(rng.choice([1, TINY.num_layers + 1])))),
        lambda: argv + ["--nope"],
        lambda: argv + [str(rng.choice(["--seed", "--cost", "--npz", "--policy"]))],
        lambda: argv + ["stray"],
    ]
    if command == "bench":
        flaws += [
            lambda: _set(argv, str(rng.choice(["--json", "--results", "--figure"])), _missing()),
            lambda: _set(argv, str(rng.choice(["--json", "--results"])), str(Path(tmp_path("d")).parent)),
            lambda: _set(_set(argv, "--cp", None), "--oversize", "split"),
            lambda: _set(_set(argv, "--oversize", None), "--cp", str(rng.choice([2, 4]))),
            lambda: _set(_set(argv, "--oversize", "split"), "--cp", str(rng.choice(["3", "5", "16", "1", "x"]))),
            lambda: _set(_set(argv, "--oversize", "refuse"), "--token-cap", str(rng.choice(["1", "2", "0", "x"]))),
            lambda: argv + [str(rng.choice(["--placements", "--packings", "--replications"])), "static"],
            lambda: argv + ["--loads", "window"],
        ]
    return flaws[int(rng.integers(len(flaws)))]()


def _sweep_flaw(rng: np.random.Generator, argv: List[str]) -> List[str]:
    flaws: List[Callable[[], List[str]]] = [
        lambda: argv + ["--policy", "static"],
        lambda: argv + ["--figure", tmp_path("f") + ".png"],
        lambda: _set(argv, "--placements", ["nope"]),
        lambda: _set(argv, "--packings", ["static"]),
        lambda: _set(argv, "--replications", []),
        lambda: _set(argv, "--loads", str(rng.choice(["nope", ""]))),
        lambda: _bench_flaw(rng, argv, "bench"),
    ]
    return flaws[int(rng.integers(len(flaws)))]()


def _damaged_window(rng: np.random.Generator) -> List[str]:
    paths = _windows(rng)
    label, raw, _ = damage(rng, Path(paths[1]).read_bytes())
    Path(paths[1]).write_bytes(raw)
    return paths


def _foreign_window(rng: np.random.Generator) -> List[str]:
    """A window of another layer or expert count, or a plan file, as the second window."""
    paths = _windows(rng)
    if rng.random() < 0.5:
        L, E = (TINY.num_layers + 1, TINY.num_experts) if rng.random() < 0.5 else (TINY.num_layers, 64)
        random_window(rng, 8, L, E, max_len=12).save(paths[1])
    else:
        w = rp.Window.load(paths[0])
        topo = rp.Topology(1, 1, 1, TINY.num_experts)
        rp.plan_window(w, topo, TINY.cost(), token_cap=1 << 20, policy="static").save(paths[1])
    return paths


def _damaged_cost(rng: np.random.Generator) -> str:
    """A cost file damaged so that it no longer loads (a damage that leaves a loadable model,
    a flipped space, is cut in half instead)."""
    p = _cost(rng)
    text = Path(p).read_text()
    label, raw = damage_text(rng, text)
    try:
        rp.CostModel.from_json(raw)
        raw = text[: len(text) // 2].encode()
    except (rp.RoutepackError, ValueError):
        pass
    Path(p).write_bytes(raw)
    return p


def bench_case(command: str):
    def make(rng: np.random.Generator) -> Case:
        argv = _bench_valid(rng, command)
        kind = "valid" if rng.random() < 0.15 else "malformed"
        if kind == "malformed":
            argv = _bench_flaw(rng, argv, command)
        return Case(kind, run_cli, (argv,), names=_flag_names(argv), note=" ".join(argv)[:200])

    return make


def sweep_case(rng: np.random.Generator) -> Case:
    argv = _sweep_valid(rng)
    kind = "valid" if rng.random() < 0.15 else "malformed"
    if kind == "malformed":
        argv = _sweep_flaw(rng, argv)
    return Case(kind, run_cli, (argv,), names=_flag_names(argv), note=" ".join(argv)[:200])


# ------------------------------------------------------------------ top level
def top_case(rng: np.random.Generator) -> Case:
    good = [["--version"], ["--help"], ["demo", "--help"], ["bench", "--help"], ["calibrate", "-h"], ["measure", "-h"]]
    bad = [[], ["nope"], ["--nope"], ["Demo"], [""], ["demo", "bench"], ["-"], ["--"], ["--help=x"]]
    valid = rng.random() < 0.4
    argv = list((good if valid else bad)[int(rng.integers(len(good if valid else bad)))])
    # argparse names what is wrong at the top as "required: command" / "arguments: <stray>"
    names = _flag_names(argv) + ("arguments are required: command",) + tuple(f"arguments: {a}" for a in argv if a)
    return Case("valid" if valid else "malformed", run_cli, (argv,), expect="ok" if valid else "error", names=names)


# ------------------------------------------------------------------ calibrate, measure
CAL_COUNTS = {
    "--hidden": 1,
    "--expert-ffn": 1,
    "--threads": 1,
    "--warmup": 0,
    "--repeats": 1,
    "--holdout-every": 2,
    "--ranks": 2,
    "--max-tokens-per-expert": 1,
    "--max-length": 1,
}
CAL_CHOICES = {"--profile": "nope", "--device": "tpu", "--dtype": "float64", "--kernels": "nope"}


def calibrate_case(rng: np.random.Generator) -> Case:
    """``--help``, or one flaw the CLI catches before measuring (a valid argv measures for minutes)."""
    if rng.random() < 0.05:
        return Case("valid", run_cli, (["calibrate", "--help"],), expect="ok")
    argv = ["calibrate", "--quiet", "--quick", "--out", tmp_path("calo")]
    flaws: List[Callable[[], List[str]]] = [
        lambda: _bad_count(rng, argv, CAL_COUNTS),
        lambda: _bad_choice(rng, argv, CAL_CHOICES),
        lambda: argv + ["--bw-inter", str(rng.choice(["x", "", "1e", "--1", "one"]))],
        lambda: _set(argv, str(rng.choice(["--out", "--report", "--plot", "--results"])), _missing()),
        lambda: _set(argv, str(rng.choice(["--out", "--report"])), str(Path(tmp_path("d")).parent)),
        lambda: argv + ["--kernels", "expert_gemm", "attention", "--ranks", "2"],
        lambda: argv + ["--kernels", str(rng.choice(["links", "exchange"])), "--max-tokens-per-expert", "8"],
        lambda: argv + ["--kernels", str(rng.choice(["expert_gemm", "links"])), "--max-length", "64"],
        lambda: argv + ["--nope"],
        lambda: argv + [str(rng.choice(["--hidden", "--out", "--kernels", "--ranks"]))],
    ]
    argv = flaws[int(rng.integers(len(flaws)))]()
    return Case("malformed", run_cli, (argv,), expect="error", names=_flag_names(argv), note=" ".join(argv)[:200])


MEASURE_COUNTS = {
    "--ranks": 2,
    "--layers": 1,
    "--experts": 1,
    "--top-k": 1,
    "--hidden": 1,
    "--ffn": 1,
    "--slots-per-rank": 1,
    "--samples": 1,
    "--micro": 1,
    "--seed": 0,
    "--windows": 1,
    "--nodes": 1,
    "--warmup": 0,
    "--repeats": 1,
}


def _bad_count(rng: np.random.Generator, argv: List[str], counts: dict) -> List[str]:
    flag = str(rng.choice(list(counts)))
    lo = counts[flag]
    return argv + [flag, str(rng.choice([str(lo - 1), str(lo - 2), "x", "", "1.5", "nan"]))]


def _bad_choice(rng: np.random.Generator, argv: List[str], choices: dict) -> List[str]:
    flag = str(rng.choice(list(choices)))
    return argv + [flag, choices[flag]]


def _more_top_k_than_experts(rng: np.random.Generator, argv: List[str]) -> List[str]:
    experts = int(rng.integers(1, 5))
    return argv + ["--experts", str(experts), "--top-k", str(experts + int(rng.integers(1, 4)))]


def _nodes_not_dividing_ranks(rng: np.random.Generator, argv: List[str]) -> List[str]:
    ranks = int(rng.choice([2, 3, 5]))
    return argv + ["--ranks", str(ranks), "--nodes", str(ranks + 1)]


def measure_case(rng: np.random.Generator) -> Case:
    """``--help``, or one flaw the CLI catches before measuring."""
    if rng.random() < 0.05:
        return Case("valid", run_cli, (["measure", "--help"],), expect="ok")
    argv = ["measure", "--quiet"]
    if rng.random() < 0.5:
        argv += ["--cost", _cost(rng, int(rng.integers(1, 4)))]
    flaws: List[Callable[[], List[str]]] = [
        lambda: _bad_count(rng, argv, MEASURE_COUNTS),
        lambda: argv + ["--popularity", str(rng.choice(["nan", "-1", "0", "inf", "x", "-inf", ""]))],
        lambda: argv + ["--policy", str(rng.choice(["nope", "static,nope", "STATIC", "routepack;static"]))],
        lambda: argv + ["--overlap", str(rng.choice(["nope", ""]))],
        lambda: _set(argv, "--cost", _cost(rng)) + ["--quick"],
        lambda: _set(argv, "--cost", _cost(rng)) + ["--calibration", tmp_path("calm")],
        lambda: _set(argv, "--cost", _missing()),
        lambda: _set(argv, "--cost", _damaged_cost(rng)),
        lambda: argv + ["--json", _missing()],
        lambda: argv + ["--json", str(Path(tmp_path("d")).parent)],
        lambda: _more_top_k_than_experts(rng, argv),
        lambda: _nodes_not_dividing_ranks(rng, argv),
        lambda: argv + ["--ranks", "2", "--slots-per-rank", "1", "--experts", str(int(rng.integers(3, 40)))],
        lambda: argv + ["--nope"],
        lambda: argv + [str(rng.choice(["--ranks", "--cost", "--policy", "--json"]))],
    ]
    argv = flaws[int(rng.integers(len(flaws)))]()
    return Case("malformed", run_cli, (argv,), expect="error", names=_flag_names(argv), note=" ".join(argv)[:200])


TARGETS = [
    Target("cli[top]", cli.main, mixed((1, top_case)), weight=1, names=("argv",)),
    Target("cli[demo]", cli.main, mixed((1, bench_case("demo"))), weight=1, batch=8, names=("argv",)),
    Target("cli[bench]", cli.main, mixed((1, bench_case("bench"))), weight=1, batch=8, names=("argv",)),
    Target("cli[bench --sweep]", cli.main, mixed((1, sweep_case)), weight=1, batch=8, names=("argv",)),
    Target("cli[calibrate]", cli.main, mixed((1, calibrate_case)), weight=1, names=("argv",)),
    Target("cli[measure]", cli.main, mixed((1, measure_case)), weight=1, names=("argv",)),
]
