"""Expert GEMM timing: the routed experts of one EP rank, forward and backward, as
`routepack.torch.EPMoE` computes them.

The timed region is ``EPMoE._experts``' local path, step for step: the received tokens
arrive in no particular order, are sorted by expert (stable, a precomputed permutation),
computed by `routepack.torch.moe.grouped_swiglu` (one ``torch._grouped_mm`` per projection
where this torch offers it for the operands, else a loop over the experts on ``unbind``
views) over stacked weights ``w1`` ``[slots, H, 2I]`` (gate and up side by side) and ``w2``
``[slots, I, H]``, and put back in arrival order. ``stack`` sets ``slots``: the measured run
(`routepack.measure`) times a stack of its ``slots_per_rank`` with ``active`` of them fed, as
its ranks run it; by default the stack holds the active experts only (a grouped GEMM over
them). The weights, the tokens and the gradient flowing back all require grad, as in
training, so a point's fixed cost is per active expert (what ``c_exp`` prices), plus what an
idle slot of the stack costs (its zero gradient), the same at every point of a stack.

(Before this module called `grouped_swiglu`, ``stack`` timed per-expert indexing ``w1[u]``,
which EPMoE had stopped using: its backward builds a zero gradient of the whole stack per
expert, 32.5 ms against 14.4 ms for 8 experts of 40 tokens in a stack of 10 at H = I = 256 on
one CPU core, so the measured run's cost model priced a kernel twice as slow as the one it ran.)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from routepack.calibrate.sweeps import Sweeps
from routepack.calibrate.timing import clock, require_torch, run_rounds, synchronizer, timed
from routepack.model import ModelShape


def _experts(recv: Any, perm: Any, inverse: Any, counts: np.ndarray, w1: Any, w2: Any) -> Any:
    """``EPMoE._experts``' local path with the permutation precomputed: sort by expert,
    `grouped_swiglu` over the stack (``counts`` int64 ``[slots]``, 0 for idle slots), back to
    arrival order."""
    from routepack.torch.moe import grouped_swiglu

    return grouped_swiglu(recv.index_select(0, perm), counts, w1, w2).index_select(0, inverse)


def _step(
    x: Any,
    grad_out: Any,
    w1: Any,
    w2: Any,
    active: int,
    per_expert: int,
    rng: Any,
    device: Any,
    sync: Callable[[], None],
    now: Callable[[], float],
) -> Callable[[], Tuple[float, float]]:
    """One point's timed call: ``active`` experts, ``per_expert`` tokens each, arriving
    shuffled. Inputs are views of the shared buffers, fresh leaves on every call."""
    torch = require_torch()
    n = active * per_expert
    unit = rng.permutation(np.repeat(np.arange(active), per_expert))
    order = np.argsort(unit, kind="stable")
    perm = torch.from_numpy(order).to(device)
    inverse = torch.from_numpy(np.argsort(order)).to(device)
    counts = np.zeros(w1.shape[0], dtype=np.int64)
    counts[:active] = per_expert

    def step() -> Tuple[float, float]:
        recv = x[:n].detach().requires_grad_()
        sync()
        t0 = now()
        out = _experts(recv, perm, inverse, counts, w1, w2)
        sync()
        t1 = now()
        out.backward(grad_out[:n])
        sync()
        t2 = now()
        w1.grad = w2.grad = None
        return t2 - t0, t1 - t0

    return step


def measure(
    model: ModelShape,
    sweeps: Sweeps,
    device: Any,
    dtype: Any,
    tick: Callable[[], None] = lambda: None,
    stack: Optional[int] = None,
) -> Dict[str, Any]:
    """Forward + backward (and forward-only) seconds at every (active experts, tokens per
    expert) point of ``sweeps.expert_grid()``, measured in interleaved rounds (`timed`). ``stack``:
    a stack of ``max(stack, active)`` slots, ``active`` of them fed (None: the active experts
    only)."""
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
    weights = {
        a: (
            (torch.randn(size[a], h, 2 * i, generator=gen) * h**-0.5).to(device, dtype).requires_grad_(),
            (torch.randn(size[a], i, h, generator=gen) * i**-0.5).to(device, dtype).requires_grad_(),
        )
        for a in sorted({a for a, _ in grid})
    }
    steps = [_step(x, grad_out, *weights[a], a, t, rng, device, sync, now) for a, t in grid]
    got = run_rounds(
        steps,
        sweeps.warmup,
        sweeps.repeats,
        tick,
        seed=0,
        visit_s=sweeps.visit_s,
        visit_calls=sweeps.visit_calls,
        short_repeats=sweeps.short_repeats,
    )
    return {"sweep": [{"active_experts": a, "tokens_per_expert": t, "tokens": a * t} for a, t in grid], **timed(got)}
