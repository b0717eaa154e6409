"""Issue 13, classes 1 and 2 at the core: inputs that used to panic in Rust or abort the
interpreter on an allocation now plan, or fail with a RoutepackError naming the argument.

* zero-weight samples (no attention cost, no expert tokens) are placed by routepack's
  layout search (they left a cell empty, and the annealer indexed it);
* a cost model with ``c_tok = 0`` plans replicas (the levelling share overflowed i64);
* sizes from arguments (``anneal_chains``, ``anneal_steps``, ``rebalance_experts``'s
  ``num_replicas``) are checked before anything is allocated, each in its own interpreter
  (an allocation failure aborts it);
* a panic caught at the boundary prints nothing to stderr.
"""

from __future__ import annotations

import numpy as np
import pytest
import routepack as rp

from fuzzing import assert_absurd_size_fails_cleanly, run_in_own_interpreter


def _cost(layers: int, a_lin: float = 1e-9, c_tok: float = 1e-9, c_exp: float = 1e-6, token_bytes: float = 10.0):
    return rp.CostModel(a_lin, [0.0] * layers, c_tok, c_exp, token_bytes, 1e9, 1e8, 1e3, 1e3, 1e3)


def _skewed_window(s_n: int, layers: int, experts: int, seed: int) -> rp.Window:
    rng = np.random.default_rng(seed)
    lens = rng.integers(8, 200, s_n)
    tokens = np.zeros((s_n, layers, experts), dtype=np.int32)
    for s in range(s_n):
        for l in range(layers):
            # two of every three experts get tokens, a third of them one hot expert
            hot = rng.integers(0, experts)
            picks = np.where(rng.random(int(lens[s]) * 2) < 1 / 3, hot, rng.integers(0, experts, int(lens[s]) * 2))
            picks = picks[picks % 3 != 0]
            np.add.at(tokens[s, l], picks, 1)
    return rp.Window(lens, np.minimum(tokens, lens[:, None, None]))  # a token picks an expert once


@pytest.mark.parametrize("c_tok", [1e-9, 0.0])
def test_zero_weight_samples_are_placed(c_tok):
    layers, experts = 2, 8
    lens = np.arange(10, 10 + 24)
    window = rp.Window(lens, np.zeros((len(lens), layers, experts), dtype=np.int32))
    topo = rp.Topology(4, 2, 2, 4)
    cost = _cost(layers, a_lin=0.0, c_tok=c_tok)
    plan = rp.plan_window(window, topo, cost, token_cap=200, policy="routepack", anneal_moves=5000)
    plan.validate(window, topo, 200)


@pytest.mark.parametrize("seed", range(4))
def test_zero_token_cost_plans_replicas(seed):
    layers, experts = 3, 16
    window = _skewed_window(32, layers, experts, seed)
    topo = rp.Topology(8, 4, 2, 5)
    cost = _cost(layers, c_tok=0.0, c_exp=1e-9, token_bytes=1e6)
    plan = rp.plan_window(window, topo, cost, token_cap=800, policy="routepack", anneal_moves=5000)
    plan.validate(window, topo, 800)


ABSURD = {
    "anneal_chains": "rp.plan_window(window, topo, cost, token_cap=10, anneal_chains=10**8, anneal_moves=10**12)",
    "anneal_steps": "rp.plan_window(window, topo, cost, token_cap=10, anneal_steps=10**9, anneal_moves=10**12)",
    "anneal_steps ": "rp.plan_window(window, topo, cost, token_cap=10, anneal_steps=2**62, anneal_moves=2**63 - 1)",
    "num_replicas": "__import__('routepack.placement').placement.rebalance_experts(np.ones((2, 8)), 2**40, 4, 2, 4)",
}


@pytest.mark.parametrize("arg", list(ABSURD))
def test_absurd_sizes_are_refused_naming_the_argument(arg):
    assert_absurd_size_fails_cleanly(ABSURD[arg])
    out = run_in_own_interpreter(ABSURD[arg]).stdout
    assert arg.strip() in out, out
