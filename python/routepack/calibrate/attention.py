"""Attention-layer timing: one full-attention layer of the model's shape on one sample,
forward and backward, over a sweep of sample lengths.

The layer is what the cost model's ``a_lin·n + a_quad·n²`` covers (docs/design.md): the
attention projections (QKV ``[H, 3H]`` and output ``[H, H]``, 4·H² parameters), causal
attention by ``torch.nn.functional.scaled_dot_product_attention`` with heads of 128 (or the
largest of 64, 32, ... dividing H), the model's shared experts (SwiGLU ``H → I → H`` each) on
every token, and the MoE layer's own work on its tokens where they start and end
(`moe_origin`: each token's top-k copies gathered in dispatch order, put back in token order
after the combine, weighted by their gates and summed, and the residual added, as
`routepack.torch.EPMoE` does at the origin rank). Routed experts and the all-to-all are not in
it (`expert_gemm` and `links` time them). A sample is one sequence, so a point of length n is
what one sample of n tokens costs in one layer.

``dense=False`` times the MoE layer's origin work alone: what a layer without attention or
shared experts (the measured run's, `routepack.measure`) does per token besides its experts.
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
    att = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), is_causal=True
    )  # [1, heads, n, d]
    out = att.squeeze(0).transpose(0, 1).reshape(n, h) @ wo
    for w1, w2 in shared:
        out = out + swiglu(x, w1, w2)
    return out


def moe_origin(x: Any, src: Any, back: Any, gates: Any) -> Any:
    """`EPMoE.forward`'s work at the origin rank, without the experts and the all-to-all (other
    kernels time them): ``x`` ``[n, H]``; the n·k routed copies gathered in dispatch order
    (``src`` int64 ``[n·k]``: the token of each copy), back in (token, k) order (``back``
    ``[n·k]``: the inverse order), weighted by ``gates`` ``[n, k]`` and summed, plus the
    residual. Returns ``[n, H]``."""
    n, h = x.shape
    rows = x.index_select(0, src)  # what the dispatch sends (the experts would transform it)
    pairs = rows.index_select(0, back)  # what the combine brings back, in (token, k) order
    return x + (pairs.view(n, gates.shape[1], h) * gates.unsqueeze(-1)).sum(1)


def measure(
    model: ModelShape,
    sweeps: Sweeps,
    device: Any,
    dtype: Any,
    tick: Callable[[], None] = lambda: None,
    dense: bool = True,
) -> Dict[str, Any]:
    """Forward + backward (and forward-only) seconds at every sample length, measured in
    interleaved rounds (`timed`): the dense layer (``dense``: projections, attention, shared
    experts) and the MoE layer's origin work (`moe_origin`, the model's top-k)."""
    import numpy as np

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
    params = [wqkv, wo] + [w for pair in shared for w in pair] if dense else []
    longest = max(sweeps.lengths)
    x = torch.randn(longest, h, generator=gen).to(device, dtype)
    grad_out = torch.randn(longest, h, generator=gen).to(device, dtype)
    k = model.top_k
    gates = torch.softmax(torch.randn(longest, k, generator=gen), dim=-1).to(device, dtype)
    rng = np.random.default_rng(1)

    def point(n: int) -> Callable[[], Tuple[float, float]]:
        # the copies of n tokens in a dispatch order (sorted by destination: a shuffle here)
        order = rng.permutation(n * k)
        src = torch.from_numpy(order // k).to(device)
        back = torch.from_numpy(np.argsort(order)).to(device)

        def step() -> Tuple[float, float]:
            sample = x[:n].detach().requires_grad_()
            sync()
            t0 = now()
            out = _layer(sample, wqkv, wo, shared, h // d) if dense else sample
            out = moe_origin(out, src, back, gates[:n])
            sync()
            t1 = now()
            out.backward(grad_out[:n])
            sync()
            t2 = now()
            for w in params:
                w.grad = None
            return t2 - t0, t1 - t0

        return step

    got = run_rounds(
        [point(n) for n in sweeps.lengths],
        sweeps.warmup,
        sweeps.repeats,
        tick,
        seed=1,
        visit_s=sweeps.visit_s,
        visit_calls=sweeps.visit_calls,
        short_repeats=sweeps.short_repeats,
    )
    parts = (["projections", "attention"] + (["shared_experts"] if model.shared_experts else []) if dense else []) + [
        "moe_origin"
    ]
    return {
        "sweep": [{"length": n} for n in sweeps.lengths],
        **timed(got),
        "heads": h // d,
        "head_dim": d,
        "top_k": k,
        "parts": parts,
    }
