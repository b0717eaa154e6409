"""Expert GEMM timing: the routed experts of one EP rank, forward and backward, as
`routepack.torch.EPMoE` computes them.

The layout is EPMoE's: stacked weights ``w1`` ``[active, H, 2I]`` (gate and up side by side)
and ``w2`` ``[active, I, H]``, one SwiGLU (`routepack.torch.moe.swiglu`) per expert over
its tokens; the received tokens arrive in no particular order, are sorted by expert
(stable), split, computed expert by expert and put back in arrival order (the steps of
``EPMoE._experts``, repeated here so that the timed region holds nothing but them). One
difference: the stacked weights are split with ``unbind`` (whose backward stacks the
experts' gradients once) where EPMoE indexes ``w1[u]`` per expert (whose backward builds a
zero gradient of the whole stack per expert, so its backward grows as active experts ×
slots: 1.38 s against 0.19 s for 8 experts of the tiny profile with 2 tokens each on one CPU
core); a grouped-GEMM kernel, which calibration stands for, does the former. ``stack`` (the
measured run, `routepack.measure`, uses it) times EPMoE's own indexing instead, into a stack
of that many slots, so that a run of EPMoE is predicted by the kernel it runs. The
weights, the tokens and the gradient flowing back all require grad, as in training, and
the weight tensors have one entry per *active* expert, so a point's fixed cost is per
active expert (what ``c_exp`` prices).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from routepack.calibrate.sweeps import Sweeps
from routepack.calibrate.timing import clock, require_torch, run_rounds, synchronizer, timed
from routepack.model import ModelShape


def _experts(recv: Any, perm: Any, inverse: Any, counts: List[int], w1: Any, w2: Any, index: bool = False) -> Any:
    """``EPMoE._experts`` with the permutation precomputed: sort by expert, one SwiGLU per
    expert, back to arrival order (``index``: the experts' weights as ``w1[u]``, EPMoE's way)."""
    torch = require_torch()
    from routepack.torch.moe import swiglu

    chunks = torch.split(recv.index_select(0, perm), counts)
    if index:
        w1s, w2s = [w1[u] for u in range(len(counts))], [w2[u] for u in range(len(counts))]
    else:
        w1s, w2s = w1.unbind(0), w2.unbind(0)
    out = torch.cat([swiglu(chunk, a, b) for chunk, a, b in zip(chunks, w1s, w2s)])
    return out.index_select(0, inverse)


def _step(x: Any, grad_out: Any, w1: Any, w2: Any, active: int, per_expert: int, rng: Any, device: Any,
          sync: Callable[[], None], now: Callable[[], float], index: bool = False) -> Callable[[], Tuple[float, float]]:
    """One point's timed call: ``active`` experts, ``per_expert`` tokens each, arriving
    shuffled. Inputs are views of the shared buffers, fresh leaves on every call."""
    torch = require_torch()
    n = active * per_expert
    unit = rng.permutation(np.repeat(np.arange(active), per_expert))
    order = np.argsort(unit, kind="stable")
    perm = torch.from_numpy(order).to(device)
    inverse = torch.from_numpy(np.argsort(order)).to(device)
    counts = [per_expert] * active

    def step() -> Tuple[float, float]:
        recv = x[:n].detach().requires_grad_()
        sync()
        t0 = now()
        out = _experts(recv, perm, inverse, counts, w1, w2, index)
        sync()
        t1 = now()
        out.backward(grad_out[:n])
        sync()
        t2 = now()
        w1.grad = w2.grad = None
        return t2 - t0, t1 - t0

    return step


def measure(model: ModelShape, sweeps: Sweeps, device: Any, dtype: Any,
            tick: Callable[[], None] = lambda: None, stack: Optional[int] = None) -> Dict[str, Any]:
    """Forward + backward (and forward-only) seconds at every (active experts, tokens per
    expert) point of ``sweeps.expert_grid()``, measured in interleaved rounds (`timed`). ``stack``:
    index the weights as EPMoE does, out of a stack of ``max(stack, active)`` slots (None:
    one weight tensor per active expert, split with ``unbind``)."""
    torch = require_torch()
    sync = synchronizer(device)
    _, now = clock(device)
    h, i = model.hidden, model.expert_ffn
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    grid = sweeps.expert_grid()
    most = max(a * t for a, t in grid)
    x = torch.randn(most, h, generator=gen).to(device, dtype)
    grad_out = torch.randn(most, h, generator=gen).to(device, dtype)
    size = {a: a if stack is None else max(stack, a) for a, _ in grid}
    weights = {a: ((torch.randn(size[a], h, 2 * i, generator=gen) * h ** -0.5).to(device, dtype).requires_grad_(),
                   (torch.randn(size[a], i, h, generator=gen) * i ** -0.5).to(device, dtype).requires_grad_())
               for a in sorted({a for a, _ in grid})}
    steps = [_step(x, grad_out, *weights[a], a, t, rng, device, sync, now, stack is not None) for a, t in grid]
    got = run_rounds(steps, sweeps.warmup, sweeps.repeats, tick, seed=0, visit_s=sweeps.visit_s,
                     visit_calls=sweeps.visit_calls)
    return {"sweep": [{"active_experts": a, "tokens_per_expert": t, "tokens": a * t} for a, t in grid],
            **timed(got)}
