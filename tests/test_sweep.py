"""The stage-combination sweep (`routepack.sweep`, ``routepack bench --sweep``, benches/sweep.py)."""

from __future__ import annotations

from dataclasses import replace

import json
from functools import lru_cache

import pytest

import routepack as rp
from routepack.cli import main
from routepack.compare import BASELINES
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.policies import PRESETS
from routepack.stages.registry import PACKINGS, PLACEMENTS, REPLICATIONS
from routepack.sweep import PRESET, combinations, format_sweep, sweep_policies


@lru_cache(maxsize=None)
def _cli_run(tmp: str) -> dict:
    path = f"{tmp}/sweep.json"
    rc = main(
        [
            "bench",
            "--sweep",
            "--windows",
            "1",
            "--quiet",
            "--placements",
            "static",
            "eplb",
            "--packings",
            "kk",
            "--replications",
            "none",
            "--json",
            path,
        ]
    )
    assert rc == 0
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    return _cli_run(str(tmp_path_factory.mktemp("sweep")))


def test_combinations_cover_the_registry():
    combos = combinations()
    assert len(combos) == len(PLACEMENTS) * len(PACKINGS) * len(REPLICATIONS)
    assert len(set(combos)) == len(combos)
    # the preset chooses among its stages' candidates (Policy.choose): it is no combination,
    # the sweep plans it beside them; its unchosen stages are one
    assert PRESETS[PRESET] not in combos and replace(PRESETS[PRESET], choose=False) in combos
    assert all(c.loads == "window" for c in combos)
    # every baseline configuration that is a combination reuses its plans
    assert sweep_policies(combos) == combos + [PRESET, "eplb", "eplb_hierarchical"]


def test_a_preset_that_is_a_combination_plans_the_same_bytes():
    prof = rp.traces.profile("tiny")
    w = next(rp.traces.synthetic(prof, 1, 0))
    a = rp.plan_window(w, prof.topology(), prof.cost(), token_cap=prof.token_cap, policy="eplb_oracle")
    b = rp.plan_window(
        w, prof.topology(), prof.cost(), token_cap=prof.token_cap, policy=rp.Policy("eplb", "kk", "none")
    )
    assert a.same_as(b)
    assert a.report["predicted"]["step_time"] == b.report["predicted"]["step_time"]


def test_filters_are_checked():
    with pytest.raises(RoutepackError, match="placements: unknown choice"):
        combinations(placements=["nope"])
    with pytest.raises(RoutepackError, match="packings: expected at least one"):
        combinations(packings=[])
    with pytest.raises(RoutepackTypeError, match="replications: expected a sequence of names"):
        combinations(replications="none")
    with pytest.raises(RoutepackError, match="loads: expected"):
        combinations(loads="oracle")


def test_filter_flags_need_sweep(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--placements", "static"])
    assert e.value.code == 2
    assert "--placements needs --sweep" in capsys.readouterr().err


def test_sweep_table(result):
    entries = result["entries"]
    # two combinations and the preset (not among them), sorted by median step time
    assert [e["step_s"] for e in entries] == sorted(e["step_s"] for e in entries)
    assert {e["policy"] for e in entries} == {"static+kk+none", "eplb+kk+none", PRESET}
    mine = [e for e in entries if e["preset"]]
    assert len(mine) == 1 and mine[0]["vs_preset"] == 1.0
    for e in entries:
        assert e["step_min"] <= e["step_s"] <= e["step_max"]
        assert e["cross_node_bytes_per_token"] == 0.0  # tiny: one node per EP group
        assert e["plan_s"] > 0
    # the best baseline: per window the fastest baseline preset (eplb_oracle ran as eplb+kk+none)
    rows = result["rows"]
    steps = {r["policy"]: r["step_time"] for r in rows}
    names = {b: ("eplb+kk+none" if b == "eplb_oracle" else b) for b in BASELINES}
    best = min(BASELINES, key=lambda b: steps[names[b]])
    assert result["best_baseline"]["step_s"] == steps[names[best]]
    assert result["best_baseline"]["best_of"] == {"1": best}
    v = result["verdict"]
    assert v["rank"] == [e["policy"] for e in entries].index(PRESET) + 1
    assert v["is_fastest"] == (v["rank"] == 1)
    assert v["gap"] == pytest.approx(mine[0]["step_s"] / entries[0]["step_s"] - 1)


def test_format_sweep_marks_the_preset(result):
    text = format_sweep(result)
    marked = [line for line in text.splitlines() if line.startswith("* routepack ")]
    assert len(marked) == 2  # in both tables (the second: min/max step and plan time)
    assert "xnode kB/tok" in text.splitlines()[0]
    assert "best baseline" in text and "the routepack preset" in text
