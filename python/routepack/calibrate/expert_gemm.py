"""Expert GEMM timing: the routed experts of one EP rank, forward and backward, as
`routepack.torch.EPMoE` computes them.

The layout is EPMoE's: stacked weights ``w1`` ``[active, H, 2I]`` (gate and up side by side)
and ``w2`` ``[active, I, H]``, one SwiGLU (`routepack.torch.moe.swiglu`) per expert over
its tokens; the received tokens arrive in no particular order, are sorted by expert
(stable), split, computed expert by expert and put back in arrival order (the steps of
``EPMoE._experts``, repeated here so that the timed region holds nothing but them). The
weights, the tokens and the gradient flowing back all require grad, as in training, and
the weight tensors have one entry per *active* expert, so a point's fixed cost is per
active expert (what ``c_exp`` prices).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from routepack.calibrate.sweeps import Sweeps
from routepack.calibrate.timing import median_time, require_torch, synchronizer
from routepack.model import ModelShape


def _experts(recv: Any, perm: Any, inverse: Any, counts: List[int], w1: Any, w2: Any) -> Any:
    """``EPMoE._experts`` with the permutation precomputed: sort by expert, one SwiGLU per
    expert, back to arrival order."""
    torch = require_torch()
    from routepack.torch.moe import swiglu

    chunks = torch.split(recv.index_select(0, perm), counts)
    out = torch.cat([swiglu(chunk, w1[u], w2[u]) for u, chunk in enumerate(chunks)])
    return out.index_select(0, inverse)


def measure(model: ModelShape, sweeps: Sweeps, device: Any, dtype: Any,
            tick: Callable[[str], None] = lambda _: None) -> Dict[str, Any]:
    """Median forward + backward (and forward-only) seconds at every (active experts, tokens
    per expert) point of ``sweeps.expert_grid()``."""
    torch = require_torch()
    sync = synchronizer(device)
    h, i = model.hidden, model.expert_ffn
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    sweep: List[Dict[str, Any]] = []
    total: List[float] = []
    forward: List[float] = []
    for active, per_expert in sweeps.expert_grid():
        n = active * per_expert
        w1 = (torch.randn(active, h, 2 * i, generator=gen) * h ** -0.5).to(device, dtype).requires_grad_()
        w2 = (torch.randn(active, i, h, generator=gen) * i ** -0.5).to(device, dtype).requires_grad_()
        x = torch.randn(n, h, generator=gen).to(device, dtype).requires_grad_()
        grad_out = torch.randn(n, h, generator=gen).to(device, dtype)
        unit = rng.permutation(np.repeat(np.arange(active), per_expert))
        order = np.argsort(unit, kind="stable")
        perm = torch.from_numpy(order).to(device)
        inverse = torch.from_numpy(np.argsort(order)).to(device)
        counts = [per_expert] * active

        def step() -> Tuple[float, float]:
            sync()
            t0 = time.perf_counter()
            out = _experts(x, perm, inverse, counts, w1, w2)
            sync()
            t1 = time.perf_counter()
            out.backward(grad_out)
            sync()
            t2 = time.perf_counter()
            x.grad = w1.grad = w2.grad = None
            return t2 - t0, t1 - t0

        both, fwd = median_time(step, sweeps.warmup, sweeps.repeats, budget_s=sweeps.budget_s)
        sweep.append({"active_experts": active, "tokens_per_expert": per_expert, "tokens": n})
        total.append(both)
        forward.append(fwd)
        tick(f"expert_gemm {active}x{per_expert}")
        del w1, w2, x, grad_out
    return {"sweep": sweep, "measured_s": total, "forward_s": forward}
