"""Attention-layer timing: one full-attention layer of the model's shape on one sample,
forward and backward, over a sweep of sample lengths.

The layer is what the cost model's ``a_lin·n + a_quad·n²`` covers (docs/design.md): the
attention projections (QKV ``[H, 3H]`` and output ``[H, H]``, 4·H² parameters), causal
attention by ``torch.nn.functional.scaled_dot_product_attention`` with heads of 128 (or the
largest of 64, 32, ... dividing H), and the model's shared experts (SwiGLU ``H → I → H``
each) on every token. Routed experts are not in it (`expert_gemm` times them). A sample is
one sequence, so a point of length n is what one sample of n tokens costs in one layer.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

from routepack.calibrate.sweeps import Sweeps
from routepack.calibrate.timing import clock, require_torch, run_rounds, synchronizer, timed
from routepack.model import ModelShape


def head_dim(hidden: int) -> int:
    """128 when it divides ``hidden``, else the largest power of two below it that does."""
    d = 128
    while d > 1 and hidden % d:
        d //= 2
    return d


def _layer(x: Any, wqkv: Any, wo: Any, shared: List[Tuple[Any, Any]], heads: int) -> Any:
    """Projections, causal attention over the whole sample, output projection, shared experts."""
    import torch.nn.functional as F

    from routepack.torch.moe import swiglu

    n, h = x.shape
    q, k, v = (x @ wqkv).view(n, 3, heads, h // heads).permute(1, 0, 2, 3).unbind(0)  # [n, heads, d] each
    att = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), is_causal=True)  # [1, heads, n, d]
    out = att.squeeze(0).transpose(0, 1).reshape(n, h) @ wo
    for w1, w2 in shared:
        out = out + swiglu(x, w1, w2)
    return out


def measure(model: ModelShape, sweeps: Sweeps, device: Any, dtype: Any,
            tick: Callable[[], None] = lambda: None) -> Dict[str, Any]:
    """Forward + backward (and forward-only) seconds at every sample length, measured in
    interleaved rounds (`timed`)."""
    torch = require_torch()
    sync = synchronizer(device)
    _, now = clock(device)
    h, i = model.hidden, model.expert_ffn
    d = head_dim(h)
    gen = torch.Generator().manual_seed(1)

    def param(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * shape[0] ** -0.5).to(device, dtype).requires_grad_()

    wqkv, wo = param(h, 3 * h), param(h, h)
    shared = [(param(h, 2 * i), param(i, h)) for _ in range(model.shared_experts)]
    params = [wqkv, wo] + [w for pair in shared for w in pair]
    longest = max(sweeps.lengths)
    x = torch.randn(longest, h, generator=gen).to(device, dtype)
    grad_out = torch.randn(longest, h, generator=gen).to(device, dtype)

    def point(n: int) -> Callable[[], Tuple[float, float]]:
        def step() -> Tuple[float, float]:
            sample = x[:n].detach().requires_grad_()
            sync()
            t0 = now()
            out = _layer(sample, wqkv, wo, shared, h // d)
            sync()
            t1 = now()
            out.backward(grad_out[:n])
            sync()
            t2 = now()
            for w in params:
                w.grad = None
            return t2 - t0, t1 - t0
        return step

    got = run_rounds([point(n) for n in sweeps.lengths], sweeps.warmup, sweeps.repeats, tick, seed=1,
                     visit_s=sweeps.visit_s, visit_calls=sweeps.visit_calls)
    return {"sweep": [{"length": n} for n in sweeps.lengths], **timed(got), "heads": h // d, "head_dim": d}
