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
``install(optimizers=True)``, which adds 6-8 (CUDA-only calls) and 9 (a load path that fails
in Megatron itself where neither Apex nor Transformer Engine is installed). Megatron's pipeline
schedules, the interleaved one's point-to-point communication included, run as shipped.

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

The grouped expert modules real runs build (``GroupedMLP``, ``TEGroupedMLP``) call CUDA
kernels; ``install(kernels=True)``, before ``megatron.core`` is imported (Megatron decides at
import whether ``grouped_gemm`` and Transformer Engine are there), stands in for those kernels
alone, with the real modules' parameter names, shapes, dtypes, registration and math (a loop
of matmuls); Megatron's ``GroupedMLP`` / ``TEGroupedMLP`` / ``TEGroupedLinear`` code, their
``sharded_state_dict`` and the dispatcher run stock:

10. ``grouped_gemm.ops.gmm`` (the package ``fanshiqing/grouped_gemm`` is CUDA-only), which
    Megatron's ``GroupedMLP`` calls (`_gmm_function`);
11. Transformer Engine's ``transformer_engine.pytorch.GroupedLinear`` (TE is CUDA-only), which
    Megatron's ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` subclass for
    ``TEGroupedMLP`` (`_grouped_linear_class`); every other TE name Megatron imports is a
    placeholder that raises if built or called (so no other TE path can run unnoticed).

`standins()` lists them (docs/testing.md names which Megatron paths ran stock).
"""

from __future__ import annotations

import contextlib
from typing import List

_INSTALLED = False
_OPTIMIZERS = False
_KERNELS = False


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


def standins(optimizers: bool = False, kernels: bool = False) -> List[str]:
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
        ]
    if kernels:
        out += [
            "grouped_gemm.ops.gmm -> a loop of matmuls (CUDA-only package)",
            "transformer_engine.pytorch.GroupedLinear -> a loop of matmuls (CUDA-only package; other TE names raise)",
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


def install(optimizers: bool = False, kernels: bool = False) -> None:
    """Applies the five stand-ins in this process (idempotent), 6-9 with ``optimizers``, and
    10-11 with ``kernels`` (before Megatron is imported: call it first thing in a spawned
    rank). Call it in every rank before building a Megatron model (spawned ranks keep them; in
    the pytest process use `applied`, which takes them off again)."""
    global _INSTALLED, _OPTIMIZERS, _KERNELS
    if kernels and not _KERNELS:
        _install_kernels()
        _KERNELS = True
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


# ------------------------------------------------------------------ kernels (10, 11)
#: the Transformer Engine release the stand-in package claims to be (Megatron-Core 0.16 gates
#: its TE code on versions; 2.x is what its GroupedLinear wrapper is written for)
TE_VERSION = "2.7.0"


def _install_kernels() -> None:
    import sys

    if "megatron.core" in sys.modules:
        raise RuntimeError(
            "megatron_cpu.install(kernels=True) must run before megatron.core is imported: Megatron decides at "
            "import whether Transformer Engine is there (install it first thing in the rank's function)"
        )
    import torch

    # 10. grouped_gemm.ops.gmm (megatron.core.transformer.moe.grouped_gemm_util imports it)
    gg = _module("grouped_gemm")
    gg.ops = _module("grouped_gemm.ops")
    gg.ops.gmm = _gmm_function(torch)
    gg.__version__ = "1.1.4"
    # 11. Transformer Engine with GroupedLinear; anything else of TE is a placeholder that
    # raises if Megatron builds or calls it on this path
    te = _module("transformer_engine", absent=True)
    te.__version__ = TE_VERSION
    te.pytorch = _module("transformer_engine.pytorch", absent=True)
    te.pytorch.GroupedLinear = _grouped_linear_class(torch)
    te.pytorch.fp8 = _module("transformer_engine.pytorch.fp8")
    te.pytorch.fp8.FP8GlobalStateManager = _Fp8State
    te.pytorch.fp8.fp8_autocast = _fp8_autocast
    te.pytorch.tensor = _module("transformer_engine.pytorch.tensor")
    te.pytorch.tensor.QuantizedTensor = _absent("transformer_engine.pytorch.tensor.QuantizedTensor")
    te.pytorch.router = _module("transformer_engine.pytorch.router", absent=True)  # fused router kernels


def _module(name: str, absent: bool = False):
    """A module registered under ``name``; ``absent``: its unknown attributes are placeholders."""
    import importlib.machinery
    import sys
    import types

    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    if absent:
        mod.__getattr__ = lambda attr: _absent_attr(name, attr)  # type: ignore[method-assign]
    sys.modules[name] = mod
    _PATCHES.append((sys.modules, name, _MISSING))
    return mod


def _absent_attr(owner: str, attr: str) -> type:
    if attr.startswith("__"):  # module / class protocol (inspect reads __file__, pickle __reduce__, ...)
        raise AttributeError(attr)
    return _absent(f"{owner}.{attr}")


class _AbsentMeta(type):
    def __getattr__(cls, attr):
        return _absent_attr(cls.__qualname__, attr)


def _absent(name: str) -> type:
    """A class standing for a part of Transformer Engine that is not stood in: Megatron may
    subclass it or read its attributes at import, but building or calling it raises."""

    def refuse(self, *a, **k):
        raise NotImplementedError(
            f"{name}: a CUDA kernel of Transformer Engine that tests/megatron_cpu.py does not stand in for "
            "(only GroupedLinear is)"
        )

    return _AbsentMeta(name.rsplit(".", 1)[-1], (), {"__qualname__": name, "__init__": refuse})


class _Fp8State:
    """TE's FP8GlobalStateManager as seen without FP8: nothing is enabled."""

    @staticmethod
    def is_fp8_enabled():
        return False

    @staticmethod
    def is_fp8_calibration():
        return False

    @staticmethod
    def get_skip_fp8_weight_update_tensor():
        return None


@contextlib.contextmanager
def _fp8_autocast(enabled=False, **_):
    if enabled:
        raise NotImplementedError("fp8_autocast(enabled=True): FP8 is not stood in on CPU")
    yield


def _gmm_function(torch):
    """Stand-in 10: ``grouped_gemm.ops.gmm(a, b, batch_sizes, trans_b=False)`` as
    fanshiqing/grouped_gemm defines it (its ``GroupedGemm`` autograd function: forward
    ``c[rows of group i] = a[rows of group i] @ (b[i]^T if trans_b else b[i])``, backward the
    input gradient by the same grouped product with ``not trans_b`` and each ``b[i]``'s gradient
    by ``a_i^T @ grad_i``), each group one matmul. Its checks: ``batch_sizes`` a 1-D CPU int64
    tensor summing to ``a``'s rows, one group per ``b[i]``, ``a`` and ``b`` of one dtype. The
    kernel takes bf16 only; the stand-in also takes fp32, so a test can compare models to fp32
    precision (Megatron's ``GroupedMLP`` asserts ``config.bf16`` but reads no dtype itself)."""

    def check(a, b, batch_sizes):
        if not (torch.is_tensor(batch_sizes) and batch_sizes.device.type == "cpu"):
            raise RuntimeError("gmm: batch_sizes must be a CPU tensor (grouped_gemm's TORCH_CHECK)")
        if batch_sizes.dim() != 1 or batch_sizes.dtype != torch.int64:
            raise RuntimeError(
                f"gmm: batch_sizes must be 1-D int64, got {batch_sizes.dtype} {tuple(batch_sizes.shape)}"
            )
        if a.dim() != 2 or b.dim() != 3 or b.shape[0] != batch_sizes.numel():
            raise RuntimeError(f"gmm: a {tuple(a.shape)}, b {tuple(b.shape)}, {batch_sizes.numel()} groups")
        if int(batch_sizes.sum()) != a.shape[0]:
            raise RuntimeError(f"gmm: batch_sizes sum to {int(batch_sizes.sum())}, a has {a.shape[0]} rows")
        if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float32):
            raise RuntimeError(f"gmm: a {a.dtype}, b {b.dtype} (bf16; fp32 on this stand-in)")

    def grouped(a, b, sizes, trans_b):
        outs, start = [], 0
        for i, n in enumerate(sizes):
            rhs = b[i].t() if trans_b else b[i]
            outs.append(a[start : start + n] @ rhs)
            start += n
        return torch.cat(outs)

    class GroupedGemm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, batch_sizes, trans_b):
            check(a, b, batch_sizes)
            ctx.save_for_backward(a, b)
            ctx.sizes, ctx.trans_b = batch_sizes.tolist(), trans_b
            return grouped(a, b, ctx.sizes, trans_b)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            a, b = ctx.saved_tensors
            agrad = bgrad = None
            if ctx.needs_input_grad[0]:
                agrad = grouped(grad, b, ctx.sizes, not ctx.trans_b)
            if ctx.needs_input_grad[1]:
                lhs, rhs = (grad, a) if ctx.trans_b else (a, grad)
                parts, start = [], 0
                for n in ctx.sizes:
                    parts.append(lhs[start : start + n].t() @ rhs[start : start + n])
                    start += n
                bgrad = torch.stack(parts)
            return agrad, bgrad, None, None

    def gmm(a, b, batch_sizes, trans_b=False):
        return GroupedGemm.apply(a, b, batch_sizes, trans_b)

    return gmm


def _grouped_linear_class(torch):
    """Stand-in 11: Transformer Engine's ``transformer_engine.pytorch.GroupedLinear`` (module
    ``transformer_engine/pytorch/module/grouped_linear.py``), which Megatron's
    ``TEGroupedLinear`` / ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``
    subclass for ``TEGroupedMLP``. As TE builds it: ``weight{i}`` ``[out, in]`` parameters of
    ``params_dtype`` on ``device`` (initialised by ``init_method`` under the RNG tracker), a
    ``bias{i}`` parameter ``[out]`` of zeros where ``bias`` (else a plain empty tensor
    attribute, as TE sets it), registered in the order ``weight0, bias0, weight1, ...``; the
    tensor-parallel attributes TE sets (``tensor_model_parallel``, ``partition_dim`` 1 for
    ``parallel_mode='row'`` else 0, ``partition_stride``); an ``_extra_state`` that is TE's
    empty uint8 tensor without FP8. Forward ``y_i = x_i W_i^T (+ b_i)`` over the rows
    ``m_splits`` gives each GEMM, in the weights' dtype; backward ``dx_i = dy_i W_i``,
    ``dW_i = dy_i^T x_i``, ``db_i`` the column sums, and with ``fuse_wgrad_accumulation`` the
    weight gradient accumulated into ``main_grad`` (overwritten on a first microbatch, as TE
    does) and ``grad_added_to_main_grad`` set for Megatron's DDP. No FP8, no userbuffers, no
    delayed weight gradients (each refused)."""

    class _Grouped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, module, m_splits, use_bias, is_first, *params):
            n = module.num_gemms
            weights, biases = params[:n], params[n:]
            dtype = weights[0].dtype
            x = inp.reshape(-1, inp.shape[-1]).to(dtype)
            xs = torch.split(x, m_splits)
            out = torch.cat(
                [xi @ w.t() + (b.to(dtype) if use_bias else 0) for xi, w, b in zip(xs, weights, biases or weights)]
            )
            ctx.save_for_backward(x, *weights)
            ctx.module, ctx.m_splits, ctx.use_bias, ctx.is_first = module, m_splits, use_bias, is_first
            ctx.inp_shape, ctx.inp_dtype = inp.shape, inp.dtype
            return out.view(*inp.shape[:-1], out.shape[-1])

        @staticmethod
        def backward(ctx, grad):
            x, *weights = ctx.saved_tensors
            module = ctx.module
            dy = torch.split(grad.reshape(-1, grad.shape[-1]).to(weights[0].dtype), ctx.m_splits)
            xs = torch.split(x, ctx.m_splits)
            dx = torch.cat([d @ w for d, w in zip(dy, weights)]).view(ctx.inp_shape).to(ctx.inp_dtype)
            wgrads = []
            for i, (d, xi) in enumerate(zip(dy, xs)):
                g = d.t() @ xi
                w = getattr(module, f"weight{i}")
                if module.fuse_wgrad_accumulation:
                    if ctx.is_first:
                        w.main_grad.copy_(g)
                    else:
                        w.main_grad.add_(g)
                    w.grad_added_to_main_grad = True
                    g = torch.zeros_like(w)
                wgrads.append(g)
            bgrads = [d.sum(0) for d in dy] if ctx.use_bias else []
            return (dx, None, None, None, None, *wgrads, *bgrads)

    def tp_attributes(t, dim):
        t.tensor_model_parallel, t.partition_dim, t.partition_stride = True, dim, 1

    class GroupedLinear(torch.nn.Module):
        def __init__(
            self,
            num_gemms,
            in_features,
            out_features,
            sequence_parallel=False,
            fuse_wgrad_accumulation=False,
            tp_group=None,
            tp_size=1,
            get_rng_state_tracker=None,
            rng_tracker_name=None,
            init_method=None,
            bias=True,
            return_bias=False,
            params_dtype=None,
            parallel_mode=None,
            device="cuda",
            ub_overlap_rs=False,
            ub_overlap_ag=False,
            ub_name=None,
            delay_wgrad_compute=False,
            **unknown,
        ):
            super().__init__()
            if unknown or ub_overlap_rs or ub_overlap_ag or delay_wgrad_compute:
                raise NotImplementedError(
                    f"GroupedLinear stand-in: {sorted(unknown) or 'userbuffers / delay_wgrad_compute'} not stood in"
                )
            if parallel_mode not in (None, "column", "row"):
                raise ValueError(f"parallel_mode {parallel_mode} not supported")
            dtype = params_dtype or torch.get_default_dtype()
            self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
            self.fuse_wgrad_accumulation, self.use_bias, self.return_bias = fuse_wgrad_accumulation, bias, return_bias
            self.apply_bias = bias and not return_bias
            self.parallel_mode, self.tp_size, self.tp_group = parallel_mode, tp_size, tp_group
            self.sequence_parallel = tp_size > 1 and sequence_parallel
            self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
            self.fp8 = self.fp8_calibration = self.primary_weights_in_fp8 = False
            self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}
            if parallel_mode == "column":
                self.out_features = out_features // tp_size
            elif parallel_mode == "row":
                self.in_features = in_features // tp_size
            init = init_method or (lambda w: torch.nn.init.normal_(w, mean=0.0, std=0.023))
            for i in range(num_gemms):
                w = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, device=device, dtype=dtype))
                self.register_parameter(f"weight{i}", w)
                if get_rng_state_tracker is not None:
                    with get_rng_state_tracker().fork(rng_tracker_name):
                        init(w.data)
                else:
                    init(w.data)
                tp_attributes(w, 1 if parallel_mode == "row" else 0)
                if bias:
                    b = torch.nn.Parameter(torch.zeros(self.out_features, device=device, dtype=dtype))
                    self.register_parameter(f"bias{i}", b)
                    if parallel_mode == "row":
                        b.sequence_parallel = self.sequence_parallel
                    elif parallel_mode == "column":
                        tp_attributes(b, 0)
                else:
                    setattr(self, f"bias{i}", torch.Tensor().to(dtype=dtype, device=device))

        def set_tensor_parallel_group(self, tp_group):
            self.tp_group = tp_group

        def init_fp8_metadata(self, num_gemms=1):
            return None

        def get_extra_state(self):
            return torch.empty(0, dtype=torch.uint8)

        def set_extra_state(self, state):
            if state is not None and torch.is_tensor(state) and state.numel():
                raise NotImplementedError("GroupedLinear stand-in: an FP8 extra state cannot be loaded")

        def backward_dw(self):
            return None

        def forward(self, inp, m_splits, is_first_microbatch=None):
            if len(m_splits) != self.num_gemms:
                raise AssertionError("Number of splits should match number of GEMMs.")
            weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
            biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []
            unfused = self.parallel_mode == "row" and self.apply_bias
            args = (inp, self, list(m_splits), self.apply_bias and not unfused, is_first_microbatch, *weights, *biases)
            out = _Grouped.apply(*args)
            if unfused:
                parts = torch.split(out.view(-1, self.out_features), list(m_splits))
                out = torch.cat([o + b.to(o.dtype) for o, b in zip(parts, biases)]).view(out.shape)
            if self.return_bias:
                return out, [b.to(out.dtype) for b in biases]
            return out

    return GroupedLinear
