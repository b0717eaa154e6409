"""Exchange timing: what one MoE layer of `routepack.torch.EPMoE` costs a rank beyond its
expert kernel, between local processes (gloo on CPU, NCCL on CUDA), over a sweep of tokens
per rank.

Why: the ``links`` sweep times bare ``all_to_all_single`` calls between idle processes, and
the cost model priced a layer's communication from those alone. The layer does more around
its kernel: it routes (counts per expert, an all-gather of the split sizes, the send order),
gathers the routed copies, exchanges them twice forward and twice backward, sorts the
received rows by slot and back, and combines the results gate-weighted at the origin. On the
measured run's CPU ranks (`routepack.measure`: H = I = 256, 16 experts top-2) that came to
3-4 ms of a layer's forward and backward at a handful of tokens, where the cost model priced
0.7 ms (four all-to-all latencies of the links sweep, 0.16 ms each), and 7.8-9.5 µs per token
where it priced 3.9.

Each rank holds ``num_experts / ranks`` experts (rounded up) in a static placement (expert e
in slot e), routes ``tokens`` tokens of its own to ``top_k`` distinct experts each, three
ways (`ROUTINGS`: all to its own experts, uniformly at random, all to the other ranks'), so
that the bytes that leave a rank vary apart from the tokens, and runs ``x + layer(x)``
forward and backward, timed on ``clock``. The layer runs under a `PlanRunner` whose routes
were computed from the replayed ids before the timing (`_replayed`), as a trainer that
replays routing runs it (and `routepack.measure` does): what is timed is the layer's
forward and backward, not its routing. The expert kernel is timed
inside the same call through `EPMoE.expert_kernel` (its forward directly, its backward from
the gradient reaching its output to the one leaving its input) and taken out. A point's
figure is each rank's least over the timed rounds of the time outside the kernel, the
slowest rank's kept. Not the drift-corrected median of the expert and attention sweeps
(`routepack.calibrate.timing.polish`): a visit here is one call of a layer whose two ranks
wait for each other, so interference on either rank only adds time to both, and the figure
is a difference of two times; at `routepack.measure`'s shapes, in three back-to-back pairs
of runs (2026-12-03), the polished medians missed held-out points by 28-39%, the least by
15-31%. The points are visited round-robin, every rank in the same order (a collective
must be entered by all). ``routepack.calibrate.fit.fit_exchange`` fits the layer's
all-to-all (its fixed cost and its bytes) and the per-token work the origin sweep misses.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Sequence

import numpy as np

from routepack.calibrate.links import spawn
from routepack.calibrate.sweeps import Sweeps
from routepack.calibrate.timing import require_torch, synchronizer
from routepack.model import ModelShape, Topology


#: How the exchange sweep routes each rank's tokens, per token count, in sweep order: every
#: copy to this rank's own experts, at random over all experts, to the other ranks' experts.
ROUTINGS = ("local", "uniform", "remote")


def _timed_kernel(
    torch: Any, kernel: Callable[..., Any], sync: Callable[[], None], now: Callable[[], float], spent: List[float]
) -> Callable[..., Any]:
    """``kernel`` with its forward and backward seconds added to ``spent[0]``."""
    start: List[float] = [0.0]

    class _Stamp(torch.autograd.Function):
        """Identity whose backward calls ``stamp`` when the gradient passes it."""

        @staticmethod
        def forward(ctx, x, stamp):  # type: ignore[override]
            ctx.stamp = stamp
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            ctx.stamp()
            return grad, None

    def begin() -> None:
        sync()
        start[0] = now()

    def end() -> None:
        sync()
        spent[0] += now() - start[0]

    def timed(rows: Any, counts: np.ndarray, w1: Any, w2: Any) -> Any:
        rows = _Stamp.apply(rows, end)  # its backward runs after the kernel's: the kernel's backward ends
        sync()
        t0 = now()
        out = kernel(rows, counts, w1, w2)
        sync()
        spent[0] += now() - t0
        return _Stamp.apply(out, begin)  # its backward runs first: the kernel's backward begins

    return timed


def _replayed(layer: Any, rank: int, world: int, ids: Any) -> Any:
    """A `PlanRunner` of ``layer`` whose window is every rank's tokens of one point (rank r's
    are sample r, one microbatch, the layer's placement), with this rank's routes computed
    from its replayed ids (`PlanRunner.set_microbatches`): the layer's forward then routes
    nothing, as in a trainer that replays routing (`routepack.measure`'s run). Collective."""
    import datetime

    import torch.distributed as dist

    from routepack.plan import Placement, Plan
    from routepack.torch.replay import rank_microbatches
    from routepack.torch.runner import PlanRunner
    from routepack.window import Window

    every: List[Any] = [None] * world
    dist.all_gather_object(every, ids.cpu().numpy().astype(np.int32))
    routed = np.concatenate(every)[:, None, :]
    cu = np.concatenate([[0], np.cumsum([len(a) for a in every])]).astype(np.int64)
    window = Window.from_routed_experts(routed, cu, layer.num_experts)
    placement = Placement(layer.phy2log[None, :].astype(np.int32), layer.num_experts, layer.slots_per_rank)
    plan = Plan(placement, np.arange(world, dtype=np.int32), np.zeros(world, dtype=np.int32), 1)
    # the same microbatch runs forward and backward again and again, one timed point each, with no
    # optimizer step between: a timing loop, not training steps, so the execution audit is off
    runner = PlanRunner([layer], layer.topo, timeout=datetime.timedelta(seconds=300), audit="off")
    runner.begin_window(plan, window, optimizer_state="none")
    runner.set_microbatches(rank_microbatches(plan, routed, rank, cu, dp=world))
    runner.start_micro(0)
    return runner


def _rank_main(
    rank: int,
    world: int,
    device: Any,
    shape: Dict[str, int],
    tokens: Sequence[int],
    warmup: int,
    repeats: int,
    dtype: str,
    clock: str,
) -> Dict[str, Any]:
    """Runs on every spawned rank; returns the sweep and the figures (the same on every rank)."""
    torch = require_torch()
    import torch.distributed as dist

    from routepack.torch.moe import EPMoE, grouped_swiglu

    E, K, H, I = shape["num_experts"], shape["top_k"], shape["hidden"], shape["expert_ffn"]
    spr = -(-E // world)  # the last rank's slots past expert E-1 stay empty
    tdtype = getattr(torch, dtype)
    sync = synchronizer(device)
    now = time.process_time if clock == "cpu" else time.perf_counter
    phy2log = np.arange(world * spr)
    phy2log[phy2log >= E] = -1
    layer = EPMoE(0, E, H, I, Topology(world, world, world, spr), phy2log, dtype=tdtype, device=device)
    gen = torch.Generator().manual_seed(1234 + rank)
    with torch.no_grad():
        layer.w1.copy_(torch.randn(layer.w1.shape, generator=gen) * H**-0.5)
        layer.w2.copy_(torch.randn(layer.w2.shape, generator=gen) * I**-0.5)
    spent = [0.0]
    layer.expert_kernel = _timed_kernel(torch, grouped_swiglu, sync, now, spent)
    mine = phy2log[rank * spr : (rank + 1) * spr]
    own = torch.zeros(E)  # 1 for the experts this rank holds
    own[torch.from_numpy(mine[mine >= 0])] = 1.0
    points, sweep = [], []
    for t in tokens:
        for routing in ROUTINGS:
            # K distinct experts per token at random, this rank's own first ("local"), the
            # other ranks' first ("remote") or none first ("uniform")
            first = {"local": own, "remote": 1.0 - own, "uniform": torch.zeros(E)}[routing]
            ids = (torch.rand(t, E, generator=gen) + 2.0 * first).topk(K, dim=1).indices
            points.append(
                (
                    torch.randn(t, H, generator=gen).to(device, tdtype),
                    ids.to(device),
                    torch.softmax(torch.randn(t, K, generator=gen), dim=-1).to(device, tdtype),
                    torch.randn(t, H, generator=gen).to(device, tdtype),
                )
            )
            sweep.append({"tokens": int(t), "routing": routing, "routed": int(t) * K})
    runners = [_replayed(layer, rank, world, ids) for _, ids, _, _ in points]
    best = np.full((len(points), 3), np.inf)  # per point: outside the kernel, the layer, the kernel
    remote = np.zeros(len(points), dtype=np.int64)
    for r in range(warmup + repeats):
        for i, (x, ids, gates, cot) in enumerate(points):
            layer.runner = runners[i]  # the point's routes, computed once (as a replaying trainer's)
            x = x.detach().requires_grad_()
            dist.barrier()
            sync()
            spent[0] = 0.0
            t0 = now()
            ((x + layer(x, ids, gates)) * cot).sum().backward()
            sync()
            whole = now() - t0
            layer.w1.grad = layer.w2.grad = None
            if r < warmup:
                route = layer.last_route  # this forward's: rows sent to and received from each rank
                if route is not None:
                    remote[i] = max(
                        sum(n for d, n in enumerate(route.send_splits) if d != rank),
                        sum(n for s, n in enumerate(route.recv_splits) if s != rank),
                    )
                continue
            if whole - spent[0] < best[i, 0]:
                best[i] = (whole - spent[0], whole, spent[0])
    slowest = torch.from_numpy(np.concatenate([best.reshape(-1), remote.astype(np.float64)])).to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    got = slowest.cpu().numpy()
    figures, rows = got[: best.size].reshape(best.shape), got[best.size :]
    token_bytes = H * torch.empty(0, dtype=tdtype).element_size()
    for point, n in zip(sweep, rows):
        point.update(remote_rows=int(n), remote_bytes=int(n) * token_bytes)
    return {
        "sweep": sweep,
        "measured_s": figures[:, 0].tolist(),
        "layer_s": figures[:, 1].tolist(),
        "kernel_s": figures[:, 2].tolist(),
    }


def measure(
    model: ModelShape,
    sweeps: Sweeps,
    device: str,
    dtype: Any,
    ranks: int = 2,
    timeout_s: float = 600,
    clock: str = "wall",
) -> Dict[str, Any]:
    """Spawns ``ranks`` local processes and times one MoE layer at every
    ``sweeps.exchange_tokens`` (see the module's docstring) on ``clock``. Returns
    ``{"skipped": why}`` where it cannot run (CUDA with fewer GPUs than ranks)."""
    shape = {k: int(getattr(model, k)) for k in ("num_experts", "top_k", "hidden", "expert_ffn")}
    name = str(dtype).replace("torch.", "")
    got = spawn(
        _rank_main,
        device,
        ranks,
        clock,
        timeout_s,
        shape,
        list(sweeps.exchange_tokens),
        sweeps.warmup + 1,
        2 * sweeps.repeats,
        name,
    )
    return got if "skipped" in got else {**got, "dtype": name}
