"""`routepack bench --trace`: the Chrome trace of one simulated step per rank
(`routepack.timeline`) loads with json, has one track per rank and one event per part, and
each track's events add up to the plan's simulated step (the bench's own figure)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import routepack as rp
from routepack.cli import main
from routepack.timeline import PARTS, step_parts, traced_plan


def _tracks(doc):
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    tracks = {}
    for e in events:
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    return tracks


def test_bench_trace_has_a_track_per_rank_summing_to_the_step(tmp_path, capsys):
    trace, out = tmp_path / "step.json", tmp_path / "bench.json"
    argv = ["bench", "--windows", "3", "--quiet", "--policy", "static", "--policy", "routepack"]
    assert main([*argv, "--trace", str(trace), "--json", str(out)]) == 0
    assert f"wrote {trace}" in capsys.readouterr().out
    doc = json.loads(trace.read_text())
    bench = json.loads(out.read_text())
    topo = rp.traces.profile("tiny").topology()
    tracks = _tracks(doc)
    assert len(tracks) == topo.pp * topo.dp == topo.pp * topo.num_groups * topo.ep
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {f"rank {r}" for r in range(topo.pp * topo.dp)}
    # the step the bench scored for routepack on the last window
    want = [r["step_time"] for r in bench["rows"] if r["policy"] == "routepack" and r["window"] == 3]
    assert len(want) == 1 and doc["otherData"]["step_time_s"] == pytest.approx(want[0], rel=1e-12)
    for events in tracks.values():
        assert [e["name"] for e in events] == list(PARTS)  # one event per part, in order
        assert all(e["dur"] >= -1e-6 for e in events)
        for a, b in zip(events, events[1:]):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=1e-3)  # end to end
        total = sum(e["args"]["seconds"] for e in events)
        assert total == pytest.approx(want[0], rel=1e-9)
    # the ranks differ: attention and expert work are each rank's own
    own = {tid: {e["name"]: e["dur"] for e in ev} for (_, tid), ev in tracks.items()}
    assert len({round(v["experts"], 3) for v in own.values()}) > 1


@pytest.mark.parametrize("pp", [1, 2])
def test_parts_add_up_per_rank_under_a_pipeline_with_replicas(pp):
    from test_oversize import CAP, cost_for, window_with_long_samples

    windows = [window_with_long_samples(seed=s, share=0.0, samples=48)[0] for s in range(3)]
    topo = replace(rp.Topology(4, 2, 2, 4, pp=pp), replica_slots=1)
    cost = cost_for(4)
    plan = traced_plan(windows, topo, cost, CAP, "routepack", 0)
    plan.validate(windows[-1], topo, CAP)
    sim, parts = step_parts(plan, windows[-1], topo, cost, CAP)
    ref = rp.simulate(plan, windows[-1], topo, cost, CAP)  # the report is simulate's, bit for bit
    assert sim.step_time == ref.step_time and (sim.group_times == ref.group_times).all()
    assert set(parts) == set(PARTS) and all(v.shape == (pp * topo.num_groups * topo.ep,) for v in parts.values())
    total = sum(parts.values())
    np.testing.assert_allclose(total, sim.step_time, rtol=1e-9)
    assert (parts["pipeline bubble"] > 0).any() == (pp > 1)
    for p in PARTS:
        assert (parts[p] >= -1e-12 * sim.step_time).all(), p
    # in each exchange the slowest rank waits for no one: its own time is the exchange's
    _, t = rp._core.simulate_terms(plan, windows[-1].seq_lens, windows[-1].counts, topo, cost)
    np.testing.assert_array_equal(t["attention_rank"].max(axis=3), t["attention"])
    np.testing.assert_array_equal(t["expert_rank"].max(axis=3), t["expert"])


def test_bench_plan_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from routepack.plan_figure import rank_load

    png = tmp_path / "plan.png"
    argv = ["bench", "--windows", "2", "--quiet", "--policy", "static", "--policy", "eplb", "--policy", "routepack"]
    assert main([*argv, "--plan-figure", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the heat maps: tokens per (layer, rank) over the layer's mean
    prof = rp.traces.profile("tiny")
    windows = list(rp.traces.synthetic(prof, 3, 0))
    topo, cost = prof.topology(), prof.cost()
    plan = traced_plan(windows, topo, cost, prof.token_cap, "routepack", 0)
    load = rank_load(plan, windows[-1], topo)
    assert load.shape == (windows[-1].num_layers, topo.dp)
    np.testing.assert_allclose(load.mean(axis=1), 1.0)
    # it needs routepack and a baseline
    assert main(["bench", "--windows", "2", "--quiet", "--policy", "routepack", "--plan-figure", str(png)]) == 2
    assert "--plan-figure needs routepack and a baseline" in capsys.readouterr().err
