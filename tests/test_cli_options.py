"""Every option of every subcommand reaches what it configures, in every mode, or is refused
there with one line and exit status 2 (an option the CLI accepts and then ignores is a wrong
result the user cannot see).

* ``demo``, ``bench`` and ``bench --sweep`` run for real on a small profile: each option is
  changed and the output (the printed tables or the ``--json`` file) must change with it.
* ``calibrate`` and ``measure`` take minutes, so their work functions are replaced by fakes
  that record what they were called with and return the committed report / measured run
  (docs/calibrate_tiny_cpu.json, docs/measure_cpu.json): each option must arrive, and every
  file option must be written.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest

import routepack as rp
from routepack import cli, traces
from routepack.model import CostModel

ROOT = Path(__file__).resolve().parent.parent
SMALL = replace(
    traces.profile("tiny"),
    name="small-test",
    num_layers=4,
    attention=("linear",) * 3 + ("full",),
    num_experts=32,
    dp=8,
    ep=4,
    gpus_per_node=2,
    slots_per_rank=9,
    samples=96,
    group_size=4,
    token_cap=16384,
    max_response=8192,
)
#: A second small profile (other shapes), to see --profile reach the run.
OTHER = replace(SMALL, name="small-other", num_layers=2, attention=("linear", "full"), samples=64)
POLICIES = ["--policy", "static", "--policy", "eplb", "--policy", "routepack"]
#: a token cap some of SMALL's samples (up to 9.4k tokens at seed 0) are longer than
OVER_CAP = 6000
SWEEP = ["--placements", "static", "routepack", "--packings", "kk", "--replications", "none"]


@pytest.fixture(autouse=True)
def _frozen_clock(monkeypatch):
    """Every plan takes 0 s, so the tables differ only where the results do."""
    import routepack.compare

    monkeypatch.setattr(routepack.compare, "time", SimpleNamespace(perf_counter=lambda: 0.0))


@pytest.fixture(autouse=True)
def _profiles(monkeypatch):
    monkeypatch.setitem(traces.PROFILES, "small-test", SMALL)
    monkeypatch.setitem(traces.PROFILES, "small-other", OTHER)


def run(capsys, argv: List[str]) -> Dict[str, Any]:
    """``routepack ARGV`` in this process: its exit status, stdout and stderr."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's way out, and the option checks'
        rc = e.code
    out, err = capsys.readouterr()
    return {"rc": rc, "out": out, "err": err}


def replace_everywhere(monkeypatch, package: str, name: str, fake: Any) -> None:
    """``fake`` for the function ``package.name`` in every module of the package that holds it,
    so the CLI finds the fake wherever it imports the function from (a refactor that moves the
    function must not let the test run minutes of real measuring)."""
    real = getattr(importlib.import_module(package), name)
    holders = [m for n, m in list(sys.modules.items()) if n.startswith(package) and getattr(m, name, None) is real]
    assert holders, f"{package}.{name} not found"
    for module in holders:
        monkeypatch.setattr(module, name, fake)


def refused(capsys, argv: List[str], *fragments: str) -> str:
    got = run(capsys, argv)
    assert got["rc"] == 2, got
    lines = got["err"].strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in got["err"], got["err"]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert "profile" not in got["out"]  # refused before any window is generated
    return lines[0]


def tables(out: str) -> str:
    """The rows of the printed tables and the ratio lines: the results alone, not the headers or
    the lines that name the run's settings (which would change with an option that reaches
    nothing). Plan times are frozen by the `_frozen_clock` fixture."""
    keep, inside = [], False
    for line in out.splitlines():
        if set(line) == {"-"}:
            inside = True
        elif not line.strip():
            inside = False
        elif inside or line.rstrip().endswith(")") and "x  (" in line:
            keep.append(line)
    assert keep, out
    return "\n".join(keep)


def cost_file(tmp_path: Path, name: str = "cost.json", **changes: Any) -> str:
    path = tmp_path / name
    replace(SMALL.cost(), **changes).save(path)
    return str(path)


def npz_files(tmp_path: Path, seed: int = 5) -> List[str]:
    files = []
    for i, w in enumerate(traces.synthetic(SMALL, 2, seed)):
        files.append(str(tmp_path / f"w{seed}_{i}.npz"))
        w.save(files[-1])
    return files


# --- demo, bench, bench --sweep: each option changes what is printed --------------------------

MODES = {
    "demo": ["demo", "--profile", "small-test", "--windows", "1", "--quiet", *POLICIES],
    "bench": ["bench", "--profile", "small-test", "--windows", "1", "--quiet", *POLICIES],
    "sweep": ["bench", "--sweep", "--profile", "small-test", "--windows", "1", "--quiet", *SWEEP],
}


def hf_config(tmp_path: Path, **changes: Any) -> str:
    """A Hugging Face config.json of SMALL's model (Qwen3-MoE's keys), ``changes`` applied."""
    cfg = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": SMALL.num_layers,
        "num_experts": SMALL.num_experts,
        "num_experts_per_tok": SMALL.top_k,
        "hidden_size": SMALL.hidden,
        "moe_intermediate_size": SMALL.expert_ffn,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        **changes,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _with(base: List[str], flag: str, *values: str) -> List[str]:
    """``base`` with ``flag`` set to ``values`` (replacing the flag's values in ``base``, if any)."""
    out = list(base)
    if flag in out:
        i = out.index(flag)
        j = i + 1
        while j < len(out) and not out[j].startswith("--"):
            j += 1
        del out[i:j]
    return out + [flag, *values]


def _changes(tmp_path: Path, mode: str) -> Dict[str, List[str]]:
    """Per option, the arguments that change it from the mode's base run."""
    out = {
        "--profile": ["small-other"],
        "--windows": ["2"],
        "--seed": ["3"],
        "--anneal-moves": ["3000"],
        "--overlap": ["dispatch_combine"],
        "--cost": [cost_file(tmp_path, c_tok=SMALL.cost().c_tok * 3)],
        "--npz": npz_files(tmp_path),
    }
    if mode != "demo":
        out["--token-cap"] = ["12000"]  # over SMALL's samples (at most 9.4k tokens at seed 0): more microbatches
        # your own cluster, hardware, model (an HF config.json) and Megatron's workloads
        out["--topology"] = ["dp=8,ep=4,gpus_per_node=2,slots_per_rank=9,nvlink_domain=4"]
        out["--hardware"] = ["gb200_nvl72"]
        out["--model"] = [hf_config(tmp_path, hidden_size=4096)]
        out["--workload"] = ["W1"]
    if mode in ("demo", "bench"):
        out["--policy"] = ["static", "--policy", "relibra"]
    else:
        out["--placements"] = ["eplb", "routepack"]
        out["--packings"] = ["sequential"]
        out["--replications"] = ["hot_n"]
        out["--loads"] = ["previous"]
    return out


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_option_changes_the_output(capsys, tmp_path, mode):
    base = MODES[mode]
    if mode == "sweep":
        # --anneal-moves reaches the routepack packing, which the base sweep leaves out
        base = _with(base, "--packings", "kk", "routepack")
    ref = run(capsys, base)
    assert ref["rc"] == 0, ref["err"]
    for flag, values in _changes(tmp_path, mode).items():
        argv = _with(base, flag, *values)
        if flag == "--npz":
            argv = _with(argv[: argv.index("--windows")] + argv[argv.index("--windows") + 2 :], flag, *values)
        if flag == "--policy":
            argv = [a for a in base if a not in POLICIES[1::2] and a != "--policy"] + ["--policy", *values]
        got = run(capsys, argv)
        assert got["rc"] == 0, (flag, got["err"])
        assert tables(got["out"]) != tables(ref["out"]), f"{mode}: {flag} {values} changed nothing"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_quiet_reaches_the_progress(capsys, mode):
    loud = run(capsys, [a for a in MODES[mode] if a != "--quiet"])
    assert loud["rc"] == 0 and "plans," in loud["err"] and "generating" in loud["err"]
    quiet = run(capsys, MODES[mode])
    assert quiet["rc"] == 0 and quiet["err"] == ""


@pytest.mark.parametrize("mode", ["bench", "sweep"])
def test_file_options_write_their_file_and_only_then(capsys, tmp_path, monkeypatch, mode):
    monkeypatch.chdir(tmp_path)
    got = run(capsys, MODES[mode])
    assert got["rc"] == 0 and sorted(p.name for p in tmp_path.iterdir()) == []  # nothing unless asked
    extra = ["--json", "r.json", "--results", "r.md"] + (["--figure", "r.png"] if mode == "bench" else [])
    got = run(capsys, MODES[mode] + extra)
    assert got["rc"] == 0, got["err"]
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["command"].startswith("routepack bench") and data["windows"] == 1
    page = (tmp_path / "r.md").read_text()
    assert page.splitlines()[1].startswith("python -m routepack.results ")
    assert "prediction of routepack's cost model" in page
    if mode == "bench":
        pytest.importorskip("matplotlib")
        assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG" and "](r.png)" in page


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["bench", "--sweep", "--policy", "static"], ["--policy", "--sweep"]),
        (["bench", "--sweep", "--figure", "f.png"], ["--figure", "--sweep"]),
        (["bench", "--placements", "static"], ["--placements needs --sweep"]),
        (["bench", "--packings", "kk"], ["--packings needs --sweep"]),
        (["bench", "--replications", "none"], ["--replications needs --sweep"]),
        (["bench", "--loads", "window"], ["--loads needs --sweep"]),
        (["demo", "--npz", "a.npz", "b.npz", "--windows", "3"], ["--windows", "--npz"]),
        (["bench", "--sweep", "--npz", "a.npz", "b.npz", "--windows", "3"], ["--windows", "--npz"]),
        (["bench", "--cp", "2"], ["--cp needs --oversize split"]),
        (["bench", "--oversize", "alone", "--cp", "2"], ["--cp needs --oversize split"]),
        (["bench", "--sweep", "--oversize", "split"], ["--oversize split needs --cp"]),
        (["bench", "--profile", "small-test", "--oversize", "split", "--cp", "3"], ["--cp 3", "must divide ep = 4"]),
    ],
)
def test_options_the_mode_does_not_read_are_refused(capsys, argv, fragments):
    refused(capsys, argv, *fragments)


@pytest.mark.parametrize("mode", ["demo", "bench", "sweep", "measure"])
@pytest.mark.parametrize("kind", ["missing", "folder", "garbage", "partial", "not an object"])
def test_a_bad_cost_file_is_one_line_and_exit_2(capsys, tmp_path, mode, kind):
    path = {"missing": tmp_path / "nope.json", "folder": tmp_path}.get(kind, tmp_path / "c.json")
    if kind == "garbage":
        path.write_text("{ not json")
    elif kind == "partial":
        path.write_text(json.dumps({"a_lin": 1e-9, "c_tok": 2e-9}))
    elif kind == "not an object":
        path.write_text("[1, 2]")
    argv = ["measure"] if mode == "measure" else MODES[mode]
    line = refused(capsys, [*argv, "--cost", str(path)], "--cost", str(path))
    if kind == "missing":
        assert "No such file" in line
    if kind == "partial":
        assert "missing keys" in line


# --- calibrate: the work function replaced, each option must arrive ----------------------------


class FakeCalibration:
    """What `routepack.calibrate.calibrate` returns, from the committed report."""

    def __init__(self, report: Dict[str, Any]):
        self.report = report
        self.cost = CostModel.from_json(json.dumps(report["cost_model"]))

    def plot(self, path):
        Path(path).write_bytes(b"\x89PNG fake")
        return Path(path)


@pytest.fixture
def fake_calibrate(monkeypatch):
    calls: List[Dict[str, Any]] = []
    report = json.loads((ROOT / "docs" / "calibrate_tiny_cpu.json").read_text())

    def calibrate(profile, **kwargs):
        calls.append({"profile": profile, **kwargs})
        return FakeCalibration(json.loads(json.dumps(report)))

    replace_everywhere(monkeypatch, "routepack.calibrate", "calibrate", calibrate)
    return calls


CALIBRATE_OPTIONS = [
    (["--profile", "flash"], "profile", "flash"),
    (["--hidden", "96"], "hidden", 96),
    (["--expert-ffn", "48"], "expert_ffn", 48),
    (["--quick"], "quick", True),
    (["--device", "cuda"], "device", "cuda"),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--kernels", "links", "exchange"], "kernels", ["links", "exchange"]),
    (["--bw-inter", "2e10"], "bw_inter", 2e10),
    (["--ranks", "3"], "ranks", 3),
    (["--threads", "2"], "threads", 2),
    (["--warmup", "4"], "warmup", 4),
    (["--repeats", "11"], "repeats", 11),
    (["--holdout-every", "4"], "holdout_every", 4),
    (["--max-tokens-per-expert", "64"], "max_tokens_per_expert", 64),
    (["--max-length", "512"], "max_length", 512),
    (["--quiet"], "progress", False),
]


@pytest.mark.parametrize("args,key,value", CALIBRATE_OPTIONS, ids=[a[0] for a, _, _ in CALIBRATE_OPTIONS])
def test_calibrate_options_reach_calibrate(capsys, tmp_path, monkeypatch, fake_calibrate, args, key, value):
    monkeypatch.chdir(tmp_path)
    got = run(capsys, ["calibrate", "--report", "", "--plot", ""])
    assert got["rc"] == 0, got["err"]
    got = run(capsys, ["calibrate", "--report", "", "--plot", "", *args])
    assert got["rc"] == 0, got["err"]
    before, after = fake_calibrate
    assert after[key] == value and before[key] != value, (key, before[key], after[key])


def test_calibrate_files_are_written_where_asked(capsys, tmp_path, fake_calibrate):
    out, rep, plot, page = (tmp_path / n for n in ("c.json", "r.json", "p.png", "page.md"))
    argv = ["calibrate", "--out", str(out), "--report", str(rep), "--plot", str(plot), "--results", str(page)]
    got = run(capsys, argv)
    assert got["rc"] == 0, got["err"]
    assert rp.CostModel.load(out) == fake_calibrate_cost()
    assert json.loads(rep.read_text())["command"].startswith("routepack calibrate --out")
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert page.read_text().splitlines()[1].startswith("python -m routepack.results calibrate ")
    assert max(len(line) for line in got["out"].splitlines()) <= 100


def fake_calibrate_cost() -> CostModel:
    report = json.loads((ROOT / "docs" / "calibrate_tiny_cpu.json").read_text())
    return CostModel.from_json(json.dumps(report["cost_model"]))


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["--kernels", "expert_gemm", "attention", "--ranks", "3"], ["--ranks", "exchange or links"]),
        (["--kernels", "links", "--max-tokens-per-expert", "64"], ["--max-tokens-per-expert", "expert_gemm"]),
        (["--kernels", "links", "--max-length", "64"], ["--max-length", "attention"]),
        (["--results", "p.md", "--report", ""], ["--results needs --report"]),
    ],
)
def test_calibrate_refuses_options_its_kernels_do_not_read(capsys, tmp_path, fake_calibrate, args, fragments):
    refused(capsys, ["calibrate", "--out", str(tmp_path / "c.json"), "--plot", "", *args], *fragments)
    assert fake_calibrate == []


# --- measure: the work function replaced, each option must arrive ------------------------------


@pytest.fixture
def fake_measure(monkeypatch):
    m = importlib.import_module("routepack.measure")  # rp.measure is the function
    calls: List[Dict[str, Any]] = []
    data = json.loads((ROOT / "docs" / "measure_cpu.json").read_text())

    def measure(work, **kwargs):
        calls.append({"work": work, **kwargs})
        return m.Measurement(
            workload=m.Workload(**data["workload"]),
            cost=CostModel.from_json(json.dumps(data["cost_model"])),
            policies=data["policies"],
            calibration=data["calibration"],
        )

    replace_everywhere(monkeypatch, "routepack.measure", "measure", measure)
    return calls


MEASURE_OPTIONS = [
    (["--ranks", "3"], "work.ranks", 3),
    (["--layers", "3"], "work.layers", 3),
    (["--experts", "12"], "work.experts", 12),
    (["--top-k", "3"], "work.top_k", 3),
    (["--hidden", "128"], "work.hidden", 128),
    (["--ffn", "64"], "work.ffn", 64),
    (["--slots-per-rank", "9"], "work.slots_per_rank", 9),
    (["--samples", "40"], "work.samples", 40),
    (["--micro", "2"], "work.micro", 2),
    (["--seed", "4"], "work.seed", 4),
    (["--popularity", "0.7"], "work.popularity", 0.7),
    (["--policy", "routepack", "--policy", "eplb"], "policies", ["routepack", "eplb"]),
    (["--overlap", "dispatch_combine"], "overlap", "dispatch_combine"),
    (["--quick"], "quick", True),
    (["--warmup", "3"], "warmup", 3),
    (["--repeats", "9"], "repeats", 9),
    (["--quiet"], "progress", False),
]


def _get(call: Dict[str, Any], key: str) -> Any:
    if key.startswith("work."):
        return getattr(call["work"], key[5:])
    return list(call[key]) if key == "policies" else call[key]


@pytest.mark.parametrize("args,key,value", MEASURE_OPTIONS, ids=[a[0] for a, _, _ in MEASURE_OPTIONS])
def test_measure_options_reach_measure(capsys, fake_measure, args, key, value):
    assert run(capsys, ["measure"])["rc"] == 0
    got = run(capsys, ["measure", *args])
    assert got["rc"] == 0, got["err"]
    before, after = fake_measure
    assert _get(after, key) == value and _get(before, key) != value, (key, _get(before, key), _get(after, key))


def test_measure_cost_and_json(capsys, tmp_path, fake_measure):
    cost = cost_file(tmp_path, c_tok=1e-6)
    out = tmp_path / "m.json"
    got = run(capsys, ["measure", "--cost", cost, "--json", str(out)])
    assert got["rc"] == 0, got["err"]
    assert fake_measure[0]["cost"] == rp.CostModel.load(cost)
    assert json.loads(out.read_text())["policies"].keys() == {"static", "routepack"}


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["--quick", "--cost", "COST"], ["--quick", "--cost"]),
        (["--policy", "nope"], ["--policy", "'nope'", "routepack"]),
        (["--json", "no/such/dir/m.json"], ["--json", "does not exist"]),
    ],
)
def test_measure_refuses_before_measuring(capsys, tmp_path, fake_measure, args, fragments):
    args = [cost_file(tmp_path) if a == "COST" else a for a in args]
    refused(capsys, ["measure", *args], *fragments)
    assert fake_measure == []


@pytest.mark.parametrize("mode", ["bench", "sweep"])
def test_samples_over_the_cap_are_refused_or_planned_as_oversize_says(capsys, mode):
    """Under a cap some samples exceed, the run refuses naming both ways out; ``--oversize
    alone`` and ``--oversize split --cp 2`` plan them (each reaching the plans: their tables
    differ from each other), and the header and the JSON say so."""
    base = _with(MODES[mode], "--token-cap", str(OVER_CAP))
    got = run(capsys, base)
    assert got["rc"] == 2 and 'oversize="alone"' in got["err"] and "Traceback" not in got["err"], got["err"]
    outs = {}
    for extra in (["--oversize", "alone"], ["--oversize", "split", "--cp", "2"]):
        got = run(capsys, base + extra)
        assert got["rc"] == 0, (extra, got["err"])
        assert f"cap={OVER_CAP}, oversize={extra[1]}" in " ".join(got["out"].split()), got["out"]
        outs[extra[1]] = tables(got["out"])
    assert outs["alone"] != outs["split"]


def test_the_json_records_the_cap_and_the_oversize_mode(capsys, tmp_path):
    path = tmp_path / "r.json"
    argv = MODES["bench"] + ["--token-cap", str(OVER_CAP), "--oversize", "split", "--cp", "2", "--json", str(path)]
    got = run(capsys, argv)
    assert got["rc"] == 0, got["err"]
    data = json.loads(path.read_text())
    assert (data["token_cap"], data["oversize"], data["cp"]) == (OVER_CAP, "split", 2)
    base = tmp_path / "base.json"
    assert run(capsys, MODES["bench"] + ["--json", str(base)])["rc"] == 0
    assert not {"token_cap", "oversize", "cp"} & set(json.loads(base.read_text()))  # the profile's cap


# --- your own run, Megatron's workloads, the break-even sweep ---------------------------------


def test_hf_config_reads_dense_layers_and_mtp():
    from routepack.hf_config import model_from_config

    dsv3 = {
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "num_nextn_predict_layers": 1,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "hidden_size": 7168,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "n_group": 8,
    }
    m = model_from_config(dsv3)
    assert (m.num_layers, m.num_experts, m.top_k, m.expert_groups, m.shared_experts) == (59, 256, 8, 8, 1)
    qwen_next = {
        "num_hidden_layers": 4,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    }
    m = model_from_config(qwen_next)
    assert m.attention == ("linear", "linear", "linear", "full") and m.shared_experts == 1
    with pytest.raises(rp.RoutepackError, match="routed expert count"):
        model_from_config({"num_hidden_layers": 2, "hidden_size": 8})


def test_your_own_run_from_npz(capsys, tmp_path):
    """--npz windows of your model on your cluster: the run plans on both and records them."""
    model = hf_config(tmp_path)
    files = npz_files(tmp_path)
    out = tmp_path / "run.json"
    argv = ["bench", "--npz", *files, "--model", model, "--topology", "dp=8,ep=4,gpus_per_node=2,slots_per_rank=9"]
    got = run(capsys, argv + ["--quiet", "--policy", "static", "--policy", "moonep", "--json", str(out)])
    assert got["rc"] == 0, got["err"]
    data = json.loads(out.read_text())
    assert data["profile"] == "custom" and {r["policy"] for r in data["rows"]} == {"static", "moonep"}
    refused(capsys, argv + ["--topology", "dp=8,ep=4,gpus=2"], "--topology", "gpus")
    refused(capsys, ["bench", "--profile", "small-test", "--topology", "dp=8,ep=3,gpus_per_node=2"], "topo")
    refused(capsys, ["bench", "--npz", *files, "--workload", "W1"], "--workload", "--npz")


def test_break_even_writes_its_page(capsys, tmp_path, monkeypatch):
    from routepack import break_even

    monkeypatch.setattr(break_even, "TOKENS", (256, 4096))
    monkeypatch.setattr(break_even, "VIOS", (0.0, 2.0))
    out, page = tmp_path / "be.json", tmp_path / "be.md"
    got = run(
        capsys,
        ["bench", "--break-even", "--profile", "small-test", "--quiet", "--json", str(out), "--results", str(page)],
    )
    assert got["rc"] == 0, got["err"]
    data = json.loads(out.read_text())
    assert len(data["cells"]) == 4 and set(data["cells"][0]["speedup"]) == {"moonep", "ultraep", "routepack"}
    hot = [c for c in data["cells"] if c["vio"] == 2.0 and c["tokens"] == 4096][0]
    assert hot["measured_vio"] > 1.0 and hot["speedup"]["moonep"] > 1.0
    assert "Break-even" in page.read_text()
    refused(capsys, ["bench", "--break-even", "--profile", "small-test", "--workload", "W1"], "--break-even")
