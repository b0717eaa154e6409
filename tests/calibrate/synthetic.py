"""Synthetic timings of every kernel kind (made from the cost model's own formulas), the
report they give and its structural check, shared by the tests of `routepack.calibrate`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import strategies as st

import routepack as rp
from routepack.calibrate.expert_table import table_knots
from routepack.calibrate.fit import to_cost_model
from routepack.calibrate.fit.attention import fit_attention
from routepack.calibrate.fit.common import COMPUTE_PASSES, holdout_mask
from routepack.calibrate.fit.exchange import LAYER_ALL_TO_ALLS
from routepack.calibrate.fit.expert_gemm import (
    GEMM_STEP_FORMULA,
    ROOFLINE_FORMULA,
    TABLE_FORMULA,
    fit_expert_gemm,
)
from routepack.calibrate.fit.links import fit_links
from routepack.calibrate.report import build
from routepack.calibrate.sweeps import Sweeps


PYTHON_DIR = str(Path(rp.__file__).resolve().parent.parent)


ROOT = Path(__file__).resolve().parents[2]


HAS_TORCH = importlib.util.find_spec("torch") is not None


HAS_MPL = importlib.util.find_spec("matplotlib") is not None


MODEL = rp.traces.profile("tiny").model()


SWEEPS = Sweeps.default("cpu")


FORM_NAMES = {ROOFLINE_FORMULA: "roofline", GEMM_STEP_FORMULA: "gemm_step", TABLE_FORMULA: "table"}


positive = st.floats(1e-10, 1e-2, allow_nan=False, allow_infinity=False)


def expert_measurement(c_tok: float, c_exp: float, noise: float = 0.0, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sweep = [{"active_experts": a, "tokens_per_expert": t, "tokens": a * t} for a, t in SWEEPS.expert_grid()]
    true = [COMPUTE_PASSES * (c_tok * p["tokens"] + c_exp * p["active_experts"]) for p in sweep]
    measured = [v * (1 + noise * rng.uniform(-1, 1)) for v in true]
    return {"sweep": sweep, "measured_s": measured, "forward_s": [m / 3 for m in measured]}


def attention_measurement(a_lin: float, a_quad: float, noise: float = 0.0, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sweep = [{"length": n} for n in SWEEPS.lengths]
    measured = [
        COMPUTE_PASSES * (a_lin * n + a_quad * n * n) * (1 + noise * rng.uniform(-1, 1)) for n in SWEEPS.lengths
    ]
    return {"sweep": sweep, "measured_s": measured, "forward_s": measured, "heads": 16, "head_dim": 128}


def links_measurement(lat: float, bw_p2p: float, bw_a2a: float, bw_ar: float = 0.0) -> dict:
    """Timings of the links' ops (the all-reduce's where ``bw_ar`` is given; reports before
    it have none)."""
    sweep, measured = [], []
    for op, bw in (("p2p", bw_p2p), ("all_to_all", bw_a2a)) + ((("all_reduce", bw_ar),) if bw_ar else ()):
        for b in SWEEPS.message_bytes:
            sweep.append({"op": op, "bytes": b})
            measured.append(lat + b / bw)
    return {"sweep": sweep, "measured_s": measured, "ranks": 2, "backend": "gloo"}


def synthetic_fits() -> dict:
    return {
        "expert_gemm": fit_expert_gemm(expert_measurement(1e-6, 2e-4), 3, MODEL),
        "attention": fit_attention(attention_measurement(5e-5, 1e-9), 3, MODEL),
        "links": fit_links(links_measurement(1e-4, 2e9, 1e9, 5e8), 3, MODEL),
    }


def synthetic_report(fits: dict) -> dict:
    cost, sources = to_cost_model(MODEL, fits)
    return build(
        fits=fits,
        cost=cost,
        preset=rp.CostModel.from_model(MODEL, rp.Hardware.h200()),
        hardware=rp.Hardware.h200(),
        sources=sources,
        device={"device": "cpu", "threads": 1},
        settings={},
        model={"hidden": MODEL.hidden, "expert_ffn": MODEL.expert_ffn},
        profile="tiny",
        skipped={},
        elapsed_s=1.0,
        version=rp.__version__,
    )


def check_report(rep: dict, kinds=("expert_gemm", "attention", "links")) -> None:
    """The structure the issue asks for: ``kernels`` maps each kind to its sweep, measured and
    predicted times and the held-out max relative error, plus device/torch/thread info."""
    for key in ("kernels", "cost_model", "preset", "sources", "device", "settings", "model"):
        assert key in rep, key
    assert set(kinds) <= set(rep["kernels"])
    for kind in kinds:
        k = rep["kernels"][kind]
        n = len(k["sweep"])
        assert n > 0 and len(k["measured_s"]) == len(k["predicted_s"]) == len(k["held_out"]) == n
        assert k["held_out_points"] == sum(k["held_out"]) > 0
        assert k["max_rel_error"] == pytest.approx(max(abs(e) for e, h in zip(k["rel_error"], k["held_out"]) if h))
        assert k["coefficients"] and k["formula"]
    rp.CostModel.from_json(json.dumps(rep["cost_model"]))
    json.dumps(rep, allow_nan=False)


def run_cli(args, cwd: Path, hide_torch: bool = False) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        + ("sys.modules['torch'] = None\n" if hide_torch else "")
        + "from routepack.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def priced_model(bw: float = 1e9, a_lin: float = 1e-6, latency: float = 1e-4) -> rp.CostModel:
    return replace(rp.CostModel.from_model(MODEL, rp.Hardware.h200()), bw_intra=bw, a_lin=a_lin, a2a_latency=latency)


def exchange_measurement(
    priced: rp.CostModel, lat: float, extra: float, bw: float = 4e9, noise: float = 0.0, seed: int = 0
) -> dict:
    """What the layer would measure if the cost model's exchange were exact (top-2 on two
    ranks: 0, t or 2t rows leave a rank of t tokens, by routing); ``bw`` 0 for bytes that
    cost nothing of their own."""
    rng = np.random.default_rng(seed)
    sweep, measured = [], []
    for t in SWEEPS.exchange_tokens:
        for rows, routing in zip((0, t, 2 * t), ("local", "uniform", "remote")):
            remote = rows * priced.token_bytes
            sweep.append(
                {"tokens": t, "routing": routing, "routed": 2 * t, "remote_rows": rows, "remote_bytes": remote}
            )
            true = (
                LAYER_ALL_TO_ALLS * (lat + (remote / bw if bw else 0.0)) + COMPUTE_PASSES * (priced.a_lin + extra) * t
            )
            measured.append(true * (1 + noise * rng.uniform(-1, 1)))
    return {
        "sweep": sweep,
        "measured_s": measured,
        "layer_s": [2 * m for m in measured],
        "kernel_s": measured,
        "ranks": 2,
        "backend": "gloo",
        "clock": "cpu",
    }


def roofline_measurement(c_tok: float, c_exp: float, knee: float) -> dict:
    sweep = [{"active_experts": a, "tokens_per_expert": t, "tokens": a * t} for a, t in SWEEPS.expert_grid()]
    true = [COMPUTE_PASSES * p["active_experts"] * (c_exp + c_tok * max(p["tokens_per_expert"], knee)) for p in sweep]
    return {"sweep": sweep, "measured_s": true, "forward_s": [m / 3 for m in true]}


def step_measurement(c_tok: float, c_exp: float, knee: float, c_gemm: float, c_call: float = 0.0) -> dict:
    """Timings of `GEMM_STEP_FORMULA`: the roofline plus c_gemm per expert with >= 2 tokens, plus
    c_call per point (one kernel call)."""
    m = roofline_measurement(c_tok, c_exp, knee)
    step = [
        COMPUTE_PASSES * (p["active_experts"] * c_gemm * (p["tokens_per_expert"] >= 2) + c_call) for p in m["sweep"]
    ]
    m["measured_s"] = [v + s for v, s in zip(m["measured_s"], step)]
    return m


def predicted(fields: dict, sweep: list) -> list:
    """`GEMM_STEP_FORMULA` from a fit's cost fields, written out here."""
    return [
        COMPUTE_PASSES
        * (
            fields.get("c_call", 0.0)
            + p["active_experts"]
            * (
                fields["c_exp"]
                + max(fields["c_tok"] * p["tokens_per_expert"], fields["c_weights"])
                + fields.get("c_gemm", 0.0) * (p["tokens_per_expert"] >= 2)
            )
        )
        for p in sweep
    ]


def table_measurement(c_tok: float, c_exp: float, c_call: float, seconds: list) -> dict:
    """Timings of `TABLE_FORMULA` (no floor): ``seconds`` at the table's knots for the CPU sweep
    (`table_knots`), linear between them."""
    m = roofline_measurement(c_tok, c_exp, 1.0)
    per = np.array([p["tokens_per_expert"] for p in m["sweep"]], dtype=np.float64)
    knots = table_knots(per, ~holdout_mask(len(per), 3))
    extra = np.interp(per, knots, seconds)
    m["measured_s"] = [
        v + COMPUTE_PASSES * (p["active_experts"] * e + c_call) for v, e, p in zip(m["measured_s"], extra, m["sweep"])
    ]
    return m
