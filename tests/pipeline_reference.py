"""An independent pipeline simulator: Megatron-Core's 1F1B and interleaved 1F1B orders run by a
discrete-event loop, written from Megatron's schedule definitions, not from routepack's Rust.

Each stage's order of operations comes from Megatron itself
(``megatron.core.pipeline_parallel.schedules``): ``get_pp_rank_microbatches`` gives the stage's
warm-up count and ``get_schedule_table`` the (microbatch, model chunk) of every virtual
microbatch; the loops of ``forward_backward_pipelining_with_interleaving`` /
``_without_interleaving`` then run the warm-up forwards, the steady 1F1B pairs (forward
``k + warmup``, then backward ``k``) and the cool-down backwards, a backward visiting the model
chunks in reverse. A forward-only run (RL's recompute of log-probabilities) runs every virtual
microbatch's forward in table order (Megatron's ``forward_only``).

The timing rules (what routepack's simulator claims to implement, docs/design.md "Pipeline
parallelism"): model chunk ``c = v * pp + s`` (virtual stage v of pipeline stage s) holds the
layers of that chunk; a stage runs its operations one at a time in its order; an operation
starts when the stage is free and its input has arrived: the forward of (m, c) needs the
forward of (m, c - 1) plus one activation send ``p2p[m, c - 1]``; the backward of (m, c) needs
the backward of (m, c + 1) plus one gradient send ``p2p[m, c]``, and the last chunk's backward
needs its own forward (the loss, no send). A backward-only run (no Megatron counterpart: a
step whose passes hold a backward with no forward before it) runs backward virtual
microbatches in table order with the same rules.

The loop keeps a heap of timed events (an operation ends, an input arrives) and starts a
stage's next operation as soon as both hold: an event loop, not the Rust's sweep over stages.
"""

from __future__ import annotations

import heapq
from types import SimpleNamespace
from typing import Dict, List, Tuple

import numpy as np

Op = Tuple[str, int, int]  # ("F" | "B", microbatch, local model chunk v)


def stage_order(pp: int, vpp: int, micro: int, stage: int, kind: str) -> List[Op]:
    """Stage ``stage``'s operations in Megatron's order; ``kind`` "1f1b", "forward" or "backward"."""
    from megatron.core.pipeline_parallel import schedules

    comm = SimpleNamespace(
        pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: stage),
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )
    total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
        micro, vpp, pp, forward_only=(kind == "forward"), p2p_communicator=comm
    )
    table = schedules.get_schedule_table(micro, vpp, pp) if vpp > 1 else [(m, 0) for m in range(micro)]

    def fwd(k: int) -> Op:
        return ("F", table[k][0], table[k][1])

    def bwd(k: int) -> Op:
        return ("B", table[k][0], vpp - 1 - table[k][1])

    if kind == "forward":
        return [fwd(k) for k in range(total)]
    if kind == "backward":
        return [bwd(k) for k in range(total)]
    ops = [fwd(k) for k in range(warmup)]
    for k in range(remaining):
        ops += [fwd(warmup + k), bwd(k)]
    ops += [bwd(k) for k in range(remaining, total)]
    return ops


def simulate_pipeline(
    pp: int, vpp: int, fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray, kind: str = "1f1b"
) -> Tuple[float, np.ndarray]:
    """(makespan, busy seconds of each stage) of one run. ``fwd``, ``bwd``: ``[M, pp * vpp]``
    seconds of each (microbatch, model chunk); ``p2p``: ``[M, pp * vpp - 1]`` seconds of one
    send across the boundary after chunk c (activations forward, their gradients backward)."""
    micro, chunks = fwd.shape
    assert chunks == pp * vpp
    orders = [stage_order(pp, vpp, micro, s, kind) for s in range(pp)]

    def chunk(op: Op, s: int) -> int:
        return op[2] * pp + s

    def duration(op: Op, s: int) -> float:
        return float((fwd if op[0] == "F" else bwd)[op[1], chunk(op, s)])

    def needs_input(op: Op, s: int) -> bool:
        c = chunk(op, s)
        if op[0] == "F":
            return c > 0
        return kind != "backward" or c < chunks - 1

    arrived: Dict[Tuple[str, int, int], float] = {}  # (kind, micro, chunk) -> input ready time
    nxt = [0] * pp
    free = [True] * pp
    busy = np.zeros(pp)
    events: List[Tuple[float, int, str, tuple]] = []
    seq = 0
    now = 0.0
    makespan = 0.0

    def push(t: float, what: str, data: tuple) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, what, data))
        seq += 1

    def try_start(s: int) -> None:
        if not free[s] or nxt[s] >= len(orders[s]):
            return
        op = orders[s][nxt[s]]
        key = (op[0], op[1], chunk(op, s))
        if needs_input(op, s) and key not in arrived:
            return
        start = max(now, arrived.get(key, 0.0))
        free[s] = False
        nxt[s] += 1
        busy[s] += duration(op, s)
        push(start + duration(op, s), "done", (s, op))

    for s in range(pp):
        try_start(s)
    while events:
        now, _, what, data = heapq.heappop(events)
        if what == "done":
            s, op = data
            free[s] = True
            makespan = max(makespan, now)
            kind_, m, c = op[0], op[1], chunk(op, s)
            if kind_ == "F" and c + 1 < chunks:
                push(now + float(p2p[m, c]), "arrive", ("F", m, c + 1))
            elif kind_ == "F" and kind == "1f1b":
                push(now, "arrive", ("B", m, c))  # the loss: the last chunk's backward, same stage
            elif kind_ == "B" and c > 0:
                push(now + float(p2p[m, c - 1]), "arrive", ("B", m, c - 1))
        else:
            arrived[data] = now
        for s in range(pp):
            try_start(s)
    if any(nxt[s] < len(orders[s]) for s in range(pp)):
        raise RuntimeError("the schedule deadlocked")
    return makespan, busy
