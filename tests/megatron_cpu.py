"""Megatron-Core 0.16.1 on CPU with gloo: the ONLY place routepack's tests stand in for
Megatron's CUDA-only calls. Everything else Megatron runs is its own code.

`install()` replaces, in the calling process, exactly these (each with its reason):

1. ``torch.cuda.current_device`` answers ``"cpu"``: Megatron allocates buffers (the
   dispatcher's all-to-all outputs, DDP's grad buffers, the router's expert-bias buffers, ...)
   with ``device=torch.cuda.current_device()``; on a machine without CUDA that call raises.
2. The CUDA RNG tracker's ``fork`` is a no-op context: attention dropout and expert
   initialisation fork a CUDA generator (``tensor_parallel.random``) that does not exist on CPU.
3. The all-to-all dispatcher's CUDA streams and events are no-op objects
   (``torch.cuda.Stream`` / ``current_stream`` / ``stream(...)`` / ``record_event`` /
   ``synchronize``): it copies split sizes device-to-host on a side stream; on CPU the copy is
   synchronous already.
4. ``moe_utils.te_general_gemm`` is ``None``: without Transformer Engine the name is undefined
   in 0.16.1 (its import fails and nothing sets it), and the router's gating reads it.
5. The split sizes reach gloo's ``all_to_all_single`` as Python lists: the dispatcher hands
   numpy arrays (NCCL's binding accepts them, gloo's does not).

Megatron's optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer``), its grad clipping, its pipeline schedules and its checkpoint writer
are CUDA-only beyond those five; the tests that train and checkpoint with them call
``install(optimizers=True)``, which adds 6-8 (CUDA-only calls), 9 (a load path that fails
in Megatron itself where neither Apex nor Transformer Engine is installed) and 10 (the
interleaved schedule's point-to-point order at pp = 2, which gloo pairs by order):

6. ``device='cuda'`` literals in ``megatron.core.optimizer`` (the loss-scale, found-inf and
   overflow tensors, the grad-norm buffers), ``megatron.core.utils`` (the l2 norm without
   Apex) and ``megatron.core.pipeline_parallel.schedules`` (the token counter of
   ``forward_backward_no_pipelining``) allocate on the CPU: those modules see a
   ``torch`` whose ``tensor`` / ``zeros`` / ``empty`` map ``device='cuda'`` to ``'cpu'``;
7. ``Tensor.type()`` without arguments names a CPU tensor as its CUDA type
   (``'torch.cuda.FloatTensor'``): the optimizers accept only parameters whose type string
   says CUDA (``distrib_optimizer.py`` / ``optimizer.py``: a ``TypeError`` otherwise);
8. ``torch.cuda.synchronize`` is a no-op: ``dist_checkpointing``'s torch_dist writer
   synchronizes the device before copying tensors to the host (``filesystem_async.py``).
9. ``DistributedOptimizer``'s load of its state where neither Apex nor Transformer Engine is
   installed (torch's Adam, which keeps a per-parameter ``step``), two faults of Megatron
   0.16.1 that hit the stock model alike: ``load_state_dict`` gives every parameter's state
   one shared ``step`` tensor (torch's Adam then adds 1 to it once per parameter per step:
   wrong bias correction), and the ``fully_reshardable`` load copies the state key by key
   from a loaded state that has no ``step`` (``KeyError: 'step'``). The stand-in keeps the
   step the state holds and gives each parameter its own copy after the load.
10. The pipeline's point-to-point ops at pp = 2 under the interleaved schedule, where a
    stage's previous and next stage are the same rank: ``_batched_p2p_ops`` and
    ``_communicate_shapes`` (``variable_seq_lengths``) post [send_prev, recv_prev, send_next,
    recv_next] on both ranks, and gloo pairs the messages between two ranks by posting order
    (one tag), so the activation's shape and tensor land in the receive meant for the peer's
    gradient and the other way round (a forward on a wrong microbatch's activations, or a size
    mismatch). The stand-in posts the same ops with the sends next-first and the receives
    prev-first, so each rank's k-th send meets the peer's k-th receive of the same kind;
    where prev != next (every other case) it changes nothing that can be observed.

`standins()` lists them (docs/testing.md names which Megatron paths ran stock).
"""

from __future__ import annotations

import contextlib
from typing import List

_INSTALLED = False
_OPTIMIZERS = False


class _NoStream:
    """A CUDA stream / event that does nothing (stand-in 3)."""

    def wait_stream(self, *_a, **_k):
        return None

    def record_event(self, *_a, **_k):
        return self

    def synchronize(self):
        return None

    def wait(self, *_a, **_k):
        return None

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    def __hash__(self):
        return 0


def standins(optimizers: bool = False) -> List[str]:
    """The stand-ins `install` applies, one line each."""
    out = [
        "torch.cuda.current_device -> 'cpu'",
        "tensor_parallel CUDA RNG tracker fork -> no-op context",
        "dispatcher CUDA streams/events -> no-op objects",
        "moe_utils.te_general_gemm -> None (no Transformer Engine)",
        "all_to_all_single split sizes -> lists (gloo)",
    ]
    if optimizers:
        out += [
            "device='cuda' literals of megatron.core.optimizer, utils, pipeline_parallel.schedules -> 'cpu'",
            "Tensor.type() of a CPU tensor -> its CUDA type string",
            "torch.cuda.synchronize -> no-op (checkpoint writer)",
            "DistributedOptimizer state load: Adam's per-parameter step kept and unshared (no Apex/TE)",
            "pipeline p2p ops at pp = 2: sends next-first, receives prev-first (gloo pairs by order)",
        ]
    return out


class _CpuTorch:
    """``torch`` as megatron.core.optimizer's modules see it under stand-in 6."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in ("tensor", "zeros", "empty", "ones", "full"):

            def on_cpu(*a, **k):
                if str(k.get("device", "")).startswith("cuda"):
                    k["device"] = "cpu"
                return attr(*a, **k)

            return on_cpu
        return attr


#: (object, attribute, original) of every stand-in in force, in the order applied
_PATCHES: List[tuple] = []
_MISSING = object()


def _patch(obj, name, value) -> None:
    _PATCHES.append((obj, name, obj.__dict__.get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name)))
    setattr(obj, name, value)


def install(optimizers: bool = False) -> None:
    """Applies the five stand-ins in this process (idempotent), and 6-9 with ``optimizers``.
    Call it in every rank before building a Megatron model (spawned ranks keep them; in the
    pytest process use `applied`, which takes them off again)."""
    global _INSTALLED, _OPTIMIZERS
    if not _INSTALLED:
        _install_basic()
        _INSTALLED = True
    if optimizers and not _OPTIMIZERS:
        _install_optimizers()
        _OPTIMIZERS = True


@contextlib.contextmanager
def applied(optimizers: bool = False):
    """`install` for the duration of a ``with`` block (restores every original after)."""
    global _INSTALLED, _OPTIMIZERS
    if _INSTALLED:  # already in force for the whole process
        yield
        return
    mark = len(_PATCHES)
    try:
        install(optimizers)
        yield
    finally:
        while len(_PATCHES) > mark:
            obj, name, old = _PATCHES.pop()
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        _INSTALLED = _OPTIMIZERS = False


def _install_basic() -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    # 1. device of Megatron's buffers
    _patch(torch.cuda, "current_device", lambda: "cpu")

    # 2. CUDA RNG tracker
    from megatron.core.tensor_parallel import random as tp_random

    _patch(tp_random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())

    # 3. dispatcher streams and events
    _patch(torch.cuda, "Stream", _NoStream)
    _patch(torch.cuda, "current_stream", lambda *a, **k: _NoStream())
    _patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())

    # 4. te_general_gemm without Transformer Engine
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        _PATCHES.append((moe_utils, "te_general_gemm", _MISSING))
        moe_utils.te_general_gemm = None

    # 5. split sizes as lists for gloo
    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        def as_list(s):
            if s is None or isinstance(s, list):
                return s
            if isinstance(s, torch.Tensor):
                return [int(x) for x in s.tolist()]
            return [int(x) for x in np.asarray(s).reshape(-1).tolist()]

        return original(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *a, **k)

    _patch(dist, "all_to_all_single", all_to_all_single)


def _install_optimizers() -> None:
    import torch
    from megatron.core import utils as core_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as optimizer_mod
    from megatron.core.pipeline_parallel import schedules

    # 6. device='cuda' literals of the optimizers, grad clipping (and the local multi-tensor
    # l2 norm in megatron.core.utils it calls without Apex) and the schedules
    for mod in (optimizer_mod, distrib_optimizer, clip_grads, core_utils, schedules):
        _patch(mod, "torch", _CpuTorch(torch))

    # 7. the optimizers' CUDA type-string checks
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return original(self, dtype, non_blocking, **kwargs)

    _patch(torch.Tensor, "type", type_)

    # 8. the checkpoint writer's device synchronisation
    _patch(torch.cuda, "synchronize", lambda *a, **k: None)

    # 9. DistributedOptimizer's state load without Apex/TE: the step torch's Adam keeps per parameter
    cls = distrib_optimizer.DistributedOptimizer
    set_states, load = cls._set_main_param_and_optimizer_states, cls.load_state_dict

    def keep_step(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)

    def load_unshared(self, state_dict):
        load(self, state_dict)
        for st in self.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()

    _patch(cls, "_set_main_param_and_optimizer_states", keep_step)
    _patch(cls, "load_state_dict", load_unshared)

    # 10. pp = 2 (previous stage = next stage): post the sends next-first, the receives prev-first
    _install_p2p_order(torch)


def _install_p2p_order(torch) -> None:
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    def ordered(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group, **ranks):
        prev, nxt = ranks["prev_pipeline_rank"], ranks["next_pipeline_rank"]
        ops = [
            torch.distributed.P2POp(op, t, peer, group)
            for op, t, peer in (
                (torch.distributed.isend, tensor_send_next, nxt),
                (torch.distributed.irecv, tensor_recv_prev, prev),
                (torch.distributed.isend, tensor_send_prev, prev),
                (torch.distributed.irecv, tensor_recv_next, nxt),
            )
            if t is not None
        ]
        return torch.distributed.batch_isend_irecv(ops) if ops else []

    def shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        def shape(t):
            return None if t is None else torch.tensor(t.size(), dtype=torch.int64)

        got = [torch.empty(3, dtype=torch.int64) if r else None for r in (recv_prev, recv_next)]
        for req in ordered(
            tensor_send_prev=shape(tensor_send_prev),
            tensor_recv_prev=got[0],
            tensor_send_next=shape(tensor_send_next),
            tensor_recv_next=got[1],
            group=self.pp_group,
            prev_pipeline_rank=self.prev_rank,
            next_pipeline_rank=self.next_rank,
        ):
            req.wait()
        return tuple([0, 0, 0] if g is None else g.tolist() for g in got)

    _patch(p2p, "_batched_p2p_ops", ordered)
    _patch(p2p.P2PCommunicator, "_communicate_shapes", shapes)
