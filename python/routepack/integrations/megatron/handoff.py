"""How a trainer's plans reach routepack's Megatron execution on its workers: the plan, its
window and its topology packed into bytes a trainer ships with its batches
(`pack_plan` / `unpack_plan`: numpy only), and `Handoff`, which ties one worker's
`routepack.integrations.megatron.MegatronRunner` to the trainer's step: a planned
mini-batch (``begin``), its microbatches (``iterate``, or ``step_function`` around Megatron's
``forward_step_func``), the step's end before the optimizer
steps (``before_optimizer_step``), and steps that run without a plan (``unplanned``).

Shared by the verl hand-off (`routepack.integrations.verl.megatron_engine`) and the slime one
(`routepack.integrations.slime.actor`). torch and Megatron are imported only by `Handoff`.
"""

from __future__ import annotations

import io
import logging
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

from routepack.errors import RoutepackError
from routepack.model import Topology
from routepack.plan import Plan
from routepack.window import Window

LOG = logging.getLogger("routepack.integrations.megatron")


def pack_plan(plan: Plan, window: Window, topo: Topology) -> Dict[str, Any]:
    """A plan with what a worker needs to carry it out: ``plan`` and ``window`` as compressed
    ``.npz`` bytes (`Plan.save` / `Window.save`), the topology as ints, the plan's digest."""
    pbuf, wbuf = io.BytesIO(), io.BytesIO()
    plan.save(pbuf)
    window.save(wbuf)  # type: ignore[arg-type]
    return {
        "plan_npz": pbuf.getvalue(),
        "window_npz": wbuf.getvalue(),
        "topology": [
            int(topo.dp),
            int(topo.ep),
            int(topo.gpus_per_node),
            int(topo.slots_per_rank),
            int(topo.replica_slots),
            int(topo.domain),
        ],
        "digest": plan.digest(),
    }


def unpack_plan(payload: Any, where: str) -> tuple:
    """``(plan, window, topology)`` from `pack_plan`'s dict; raises `RoutepackError` naming
    ``where`` when it holds none."""
    if not isinstance(payload, dict) or "plan_npz" not in payload or "window_npz" not in payload:
        raise RoutepackError(f"{where}: carries no plan for the Megatron execution (made by another routepack?)")
    plan = Plan.load(io.BytesIO(bytes(payload["plan_npz"])))
    window = Window.load(io.BytesIO(bytes(payload["window_npz"])))  # type: ignore[arg-type]
    dp, ep, gpn, spr, rs, dom = (int(x) for x in payload["topology"])
    if plan.digest() != payload.get("digest", plan.digest()):
        raise RoutepackError(f"{where}: the plan's bytes do not match its digest")
    return (
        plan,
        window,
        Topology(
            dp=dp,
            ep=ep,
            gpus_per_node=gpn,
            slots_per_rank=spr,
            replica_slots=rs,
            nvlink_domain=None if dom == gpn else dom,
        ),
    )


class Handoff:
    """One worker's `MegatronRunner` over ``model`` (DDP-wrapped chunks) and ``topo``, and the
    state of the step in progress. ``name`` names the trainer in messages."""

    def __init__(self, model: Any, topo: Topology, name: str) -> None:
        from routepack.integrations.megatron.runner import MegatronRunner

        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != 1:
            raise RoutepackError(
                f"{name}: {len(chunks)} model chunks (virtual pipeline stages); routepack's Megatron execution "
                "runs one chunk per rank (virtual_pipeline_model_parallel_size=1)"
            )
        self.runner = MegatronRunner(chunks, topo)
        self.topo, self.name = topo, name
        self.micro_ids: Optional[List[int]] = None  # the plan's microbatch of each item of the step, or None
        self.plans_run = 0
        self.unplanned_steps = 0
        self._unplanned = False

    def check_topology(self, topo: Topology, where: str) -> None:
        if topo != self.topo:
            raise RoutepackError(
                f"{where}: the plan was made for {topo}, the model was built for {self.topo} (plan with the model's "
                "slots_per_rank and the trainer's GPUs per node)"
            )

    def begin(self, plan: Plan, window: Window, optimizer: Any, micro_ids: Sequence[int]) -> Any:
        """A planned step: `MegatronRunner.begin_window` (migration with ``optimizer``'s state,
        routing tables), then ``micro_ids[k]`` is the plan's microbatch of the step's k-th item.
        Collective over the EP group."""
        ids = [int(m) for m in micro_ids]
        if sorted(ids) != list(range(plan.num_micro)):
            raise RoutepackError(
                f"{self.name}: this rank runs microbatches {ids} of a plan with {plan.num_micro}; every EP rank must "
                "run each of the plan's microbatches once"
            )
        report = self.runner.begin_window(plan, window, optimizer)
        self.micro_ids, self._unplanned = ids, False
        self.plans_run += 1
        return report

    def unplanned(self) -> None:
        """The step runs without a plan (the trainer's own microbatches): the placement in force
        routes by its default table; redundant experts are summed before the optimizer steps."""
        self.micro_ids, self._unplanned = None, True
        self.runner.end_micro()

    def iterate(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``iterable`` with the plan's microbatch made current before each item (`begin`'s
        ``micro_ids``); as it is without a planned step."""
        ids = self.micro_ids
        for k, item in enumerate(iterable):
            if ids is not None:
                self.runner.start_micro(ids[k % len(ids)])
            yield item

    def step_function(self, fn: Any) -> Any:
        """``fn`` (Megatron's ``forward_step_func``) with the plan's next microbatch made current
        before each call (`begin`'s ``micro_ids``, in order); ``fn`` itself without a planned step."""
        import functools

        ids = self.micro_ids
        if ids is None:
            return fn
        calls = [0]

        @functools.wraps(fn)
        def planned(*args: Any, **kwargs: Any) -> Any:
            self.runner.start_micro(ids[calls[0] % len(ids)])
            calls[0] += 1
            return fn(*args, **kwargs)

        return planned

    def before_optimizer_step(self) -> None:
        """Before ``optimizer.step()``: a planned step's `MegatronRunner.finish_step`; after an
        unplanned one, every redundant expert's gradient summed over the EP group (what the
        planned step's last microbatch does), so copies stay equal."""
        if self._unplanned:
            self.runner.sum_redundant()
            self.unplanned_steps += 1
            self._unplanned = False
        elif self.micro_ids is not None:
            self.runner.finish_step()
        self.micro_ids = None


__all__ = ["Handoff", "pack_plan", "unpack_plan"]
