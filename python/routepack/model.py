"""The cluster, the model and the hardware, and the cost coefficients derived from them."""

from __future__ import annotations

import json
import dataclasses
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

from routepack import _core
from routepack._checks import boolean, file_path, finite_float, instance_of, json_value, positive_int, sequence
from routepack.errors import RoutepackError, RoutepackFileError, RoutepackTypeError
from routepack.hardware import Hardware

ATTENTION_KINDS = ("linear", "full")
#: `CostModel.overlap` values: none, or the dispatch/combine all-to-all behind the compute.
OVERLAPS = ("none", "dispatch_combine")
#: `CostModel.passes` kinds: a forward pass (compute ×1, one dispatch + combine) and a
#: backward pass (compute ×2, one dispatch + combine).
PASS_KINDS = ("forward", "backward")
#: The cost model options' defaults, from the Rust core: the values that price every plan as
#: before the options existed.
_COST_DEFAULTS = _core.cost_defaults()
#: The topology's optional fields' defaults, from the Rust core (``replica_slots``).
_TOPOLOGY_DEFAULTS = _core.topology_defaults()
#: `ModelShape.expert_groups` (and `CostModel`'s) of a model that routes without groups, the default.
UNGROUPED = 1


def _set(obj: object, name: str, value: object) -> None:
    """Stores a checked, normalised field on a frozen dataclass (Python ints and floats, not
    the numpy scalars a caller may have passed)."""
    object.__setattr__(obj, name, value)


def _check_groups(groups: object, num_experts: int | None, name: str) -> int:
    """``groups`` as an int >= 1 that divides ``num_experts`` (when known)."""
    g = positive_int(groups, name)
    if num_experts is not None and num_experts % g:
        raise RoutepackError(f"{name}: {g} does not divide num_experts = {num_experts}")
    return g


@dataclass(frozen=True)
class Topology:
    """Data-parallel and expert-parallel layout of the cluster.

    * ``dp`` DP ranks, each running its own microbatches.
    * EP groups are consecutive blocks of ``ep`` DP ranks; nodes are consecutive blocks of
      ``gpus_per_node`` ranks (an EP group spans whole nodes or lies inside one).
    * each EP rank has ``slots_per_rank`` physical expert slots per MoE layer; physical slot p
      lives on EP-local rank ``p // slots_per_rank``; ``ep * slots_per_rank - E`` of them are
      redundant (for replicas of hot experts).
    * each EP rank has ``replica_slots`` spare expert buffers per MoE layer for the intra-batch
      copies of one microbatch: in one exchange (EP group, microbatch, layer) a rank receives
      copies of at most that many distinct experts. `Plan.validate` refuses a plan over it, the
      replication stages plan within it (their own ``replication_slots`` /
      ``replication_hot_experts`` are capped by it) and the lower bound relies on it. The
      default, 3, is what the built-in policies use at most with their defaults (``hot_n``
      broadcasts its 3 hot experts to every rank); 0 allows no copies.
    * ``pp`` pipeline stages of ``vpp`` model chunks each (interleaved 1F1B where ``vpp`` > 1,
      Megatron's virtual pipeline; it needs ``pp`` >= 2). Every stage has its own ``dp`` ranks
      (DP rank d of stage s is global rank ``s * dp + d``), EP groups and nodes, and holds the
      MoE layers of its chunks: chunk ``v * pp + s`` (virtual stage v of stage s) takes
      ``layers_per_stage[v * pp + s]`` consecutive layers, or, where ``layers_per_stage`` is
      None, an even split (Megatron's default). `simulate` prices the 1F1B schedule
      (docs/design.md, "Pipeline parallelism"); plans run at least ``pp`` microbatches per DP
      rank, a multiple of ``pp`` under ``vpp`` > 1 (`min_micro`, `micro_multiple`).
    * ``cp`` consecutive DP ranks (a divisor of ``ep``: inside one EP group) form a
      context-parallel group: ``plan_window(..., oversize="split")`` splits a sample longer
      than the token cap over one (docs/design.md, "Samples over the cap"); 1: none.
    * ``nvlink_domain``: GPUs that reach one another over NVLink (``bw_intra``); None, the
      default, is one node. A rack-scale system joins nodes (GB200 NVL72: 72 GPUs, nodes of
      4): a multiple of ``gpus_per_node``, and either a divisor of ``ep`` (an EP group spans
      whole domains) or at least ``ep`` (a domain holds whole EP groups; GPUs beyond
      ⌊domain / ep⌋·ep run none of the plan's ranks). The cost model prices a link by whether
      its ranks share a domain (docs/design.md, "NVLink domains").
    """

    dp: int
    ep: int
    gpus_per_node: int
    slots_per_rank: int
    replica_slots: int = _TOPOLOGY_DEFAULTS["replica_slots"]
    pp: int = _TOPOLOGY_DEFAULTS["pp"]
    vpp: int = _TOPOLOGY_DEFAULTS["vpp"]
    cp: int = _TOPOLOGY_DEFAULTS["cp"]
    layers_per_stage: Optional[Tuple[int, ...]] = _TOPOLOGY_DEFAULTS["layers_per_stage"]
    nvlink_domain: Optional[int] = _TOPOLOGY_DEFAULTS["nvlink_domain"]

    def __post_init__(self) -> None:
        for name in ("dp", "ep", "gpus_per_node", "slots_per_rank"):
            # stored as Python ints (a numpy uint64 would turn later arithmetic into uint64)
            _set(self, name, positive_int(getattr(self, name), f"topo.{name}", maximum=2**31 - 1))  # int32 ids
        _set(
            self, "replica_slots", positive_int(self.replica_slots, "topo.replica_slots", minimum=0, maximum=2**31 - 1)
        )
        if self.dp % self.ep:
            raise RoutepackError(f"topo: dp={self.dp} is not a multiple of ep={self.ep}")
        if self.ep % self.gpus_per_node and self.gpus_per_node % self.ep:
            raise RoutepackError(f"topo: ep={self.ep} and gpus_per_node={self.gpus_per_node} must divide one another")
        if self.nvlink_domain is not None:
            d = positive_int(self.nvlink_domain, "topo.nvlink_domain", maximum=2**31 - 1)
            if d % self.gpus_per_node or (d < self.ep and self.ep % d):
                raise RoutepackError(
                    f"topo.nvlink_domain: {d} must be a multiple of gpus_per_node = {self.gpus_per_node} and "
                    f"divide ep = {self.ep} or be at least ep"
                )
            _set(self, "nvlink_domain", d)
        if self.ep * self.slots_per_rank > 2**31 - 1:
            raise RoutepackError(
                f"topo: ep*slots_per_rank = {self.ep}*{self.slots_per_rank} does not fit the int32 slot ids of a plan"
            )
        for name in ("pp", "vpp", "cp"):
            _set(self, name, positive_int(getattr(self, name), f"topo.{name}", maximum=2**31 - 1))
        if self.vpp > 1 and self.pp < 2:
            raise RoutepackError(
                f"topo.vpp: {self.vpp} model chunks per stage need a pipeline (pp >= 2), got pp = {self.pp}"
            )
        if self.ep % self.cp:
            raise RoutepackError(
                f"topo.cp: {self.cp} must divide ep = {self.ep} (a context-parallel group lies inside one EP group)"
            )
        if self.layers_per_stage is not None:
            chunks = tuple(sequence(self.layers_per_stage, "topo.layers_per_stage", "layer counts"))
            chunks = tuple(positive_int(n, f"topo.layers_per_stage[{i}]") for i, n in enumerate(chunks))
            if len(chunks) != self.pp * self.vpp:
                raise RoutepackError(
                    f"topo.layers_per_stage: has {len(chunks)} entries, expected one per model chunk, "
                    f"pp*vpp = {self.pp * self.vpp}"
                )
            _set(self, "layers_per_stage", chunks)

    @property
    def num_groups(self) -> int:
        """EP groups (dp // ep)."""
        return self.dp // self.ep

    @property
    def num_slots(self) -> int:
        """Physical expert slots per layer in one EP group (ep * slots_per_rank)."""
        return self.ep * self.slots_per_rank

    @property
    def domain(self) -> int:
        """GPUs per NVLink domain (``nvlink_domain``, or a node's ``gpus_per_node``)."""
        return self.gpus_per_node if self.nvlink_domain is None else self.nvlink_domain

    @property
    def nodes_per_group(self) -> int:
        """NVLink domains (nodes unless ``nvlink_domain`` joins them) one EP group spans."""
        return max(1, -(-self.ep // self.domain))

    @property
    def min_micro(self) -> int:
        """The fewest microbatches per DP rank a plan may run: ``pp`` under a pipeline, else 1
        (the core's rule, ``MicroRule::of_pipeline``, through `_core.micro_rule`)."""
        return int(_core.micro_rule(self.pp, self.vpp)[0])

    @property
    def micro_multiple(self) -> int:
        """Microbatches per DP rank come in multiples of this: ``pp`` under the interleaved
        schedule (``vpp`` > 1: Megatron's ``microbatch_group_size_per_vp_stage``, default pp),
        else 1 (the core's rule, through `_core.micro_rule`)."""
        return int(_core.micro_rule(self.pp, self.vpp)[1])

    def chunk_bounds(self, num_layers: int) -> List[int]:
        """``[pp * vpp + 1]``: model chunk c holds MoE layers ``bounds[c]:bounds[c + 1]`` (chunk
        ``v * pp + s`` is virtual stage v of stage s); ``layers_per_stage`` or the even split."""
        num_layers = positive_int(num_layers, "num_layers")
        chunks = self.pp * self.vpp
        if self.layers_per_stage is not None:
            sizes = list(self.layers_per_stage)
            if sum(sizes) != num_layers:
                raise RoutepackError(
                    f"topo.layers_per_stage: {sizes} holds {sum(sizes)} MoE layers, but the model has {num_layers}"
                )
        elif num_layers % chunks == 0:
            sizes = [num_layers // chunks] * chunks
        else:
            raise RoutepackError(
                f"topo.layers_per_stage: not given, and {num_layers} MoE layers do not split evenly over "
                f"pp*vpp = {self.pp}*{self.vpp} = {chunks} model chunks; give each chunk's layers"
            )
        return [int(x) for x in np.concatenate([[0], np.cumsum(sizes)])]

    def stage_layers(self, stage: int, num_layers: int) -> List[int]:
        """The MoE layers pipeline stage ``stage`` holds, ascending (its chunks' layers): what
        the glue of one stage migrates, replicates and routes."""
        stage = positive_int(stage, "stage", minimum=0, maximum=self.pp - 1)
        b = self.chunk_bounds(num_layers)
        return [l for v in range(self.vpp) for l in range(b[v * self.pp + stage], b[v * self.pp + stage + 1])]

    def check_experts(self, num_experts: int) -> None:
        """Raises unless ``num_experts`` is a count >= 1 and the slots can hold every logical
        expert once."""
        num_experts = positive_int(num_experts, "num_experts")
        if self.num_slots < num_experts:
            raise RoutepackError(
                f"topo: ep*slots_per_rank = {self.ep}*{self.slots_per_rank} = {self.num_slots} "
                f"< num_experts = {num_experts}"
            )


@dataclass(frozen=True)
class ModelShape:
    """The MoE model's shape. ``attention`` has one kind ("linear" or "full") per MoE layer.

    ``expert_groups``: the groups of the model's group-limited routing (each token picks its
    experts from a few of ``expert_groups`` blocks of ``num_experts / expert_groups``
    consecutive experts): 8 for DeepSeek-V3; 1, the default, for a model that routes without
    groups (Qwen3-MoE, Mixtral, the synthetic profiles). EPLB takes it as ``num_groups``, as
    DeepSeek, vLLM and SGLang pass it.
    """

    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    expert_ffn: int
    attention: Sequence[str] = field(default_factory=tuple)
    shared_experts: int = 1
    expert_groups: int = UNGROUPED

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "hidden", "expert_ffn"):
            _set(self, name, positive_int(getattr(self, name), f"model.{name}"))
        _set(self, "shared_experts", positive_int(self.shared_experts, "model.shared_experts", minimum=0))
        _set(self, "expert_groups", _check_groups(self.expert_groups, self.num_experts, "model.expert_groups"))
        if self.top_k > self.num_experts:
            raise RoutepackError(f"model.top_k: {self.top_k} > num_experts {self.num_experts}")
        att = tuple(sequence(() if self.attention is None else self.attention, "model.attention", "attention kinds"))
        att = att or ("full",) * self.num_layers
        if len(att) != self.num_layers:
            raise RoutepackError(f"model.attention: has {len(att)} entries, expected num_layers={self.num_layers}")
        for i, a in enumerate(att):
            if a not in ATTENTION_KINDS:
                raise RoutepackError(f"model.attention[{i}]: {a!r} is not one of {ATTENTION_KINDS}")
        object.__setattr__(self, "attention", att)


#: The kinds of `CostModel`'s number fields (besides ``a_quad`` [L]), declared on each field
#: (``field(metadata=_WORK_FIELD)``), so that the dataclass's field list is the one table of
#: their names: the checks, the refusal of a model that prices nothing and the JSON keys are
#: built from it (`_numbers`, `_OPTIONAL_JSON_KEYS`). "work" prices a token's
#: or an expert's work, in time or bytes (finite, >= 0; a cost model needs one of these, an
#: ``a_quad`` entry or an ``expert_table`` knot above 0), "option" is finite and >= 0 but prices
#: nothing alone (``bw_reduce``: 0 means ``bw_intra``), "rate" is a bandwidth (finite, > 0).
NUMBER_KINDS = ("work", "option", "rate")
_WORK_FIELD, _OPTION_FIELD, _RATE_FIELD = ({"kind": kind} for kind in NUMBER_KINDS)


def _expert_table(value: object) -> Tuple[Tuple[float, float], ...]:
    """``cost.expert_table`` (a sequence of (tokens, seconds) pairs, or an array of shape
    ``[knots, 2]``) as a tuple of float pairs: tokens finite, >= 1 and increasing, seconds
    finite and >= 0 (what the core's check asks, named here per knot)."""
    knots: List[Tuple[float, float]] = []
    if isinstance(value, np.ndarray) and value.ndim == 2:
        # an array of knots, one (tokens, seconds) row each, as `a_quad` takes an array
        if value.shape[1] != 2:
            raise RoutepackError(f"cost.expert_table: expected an array of shape [knots, 2], got {value.shape}")
        value = list(value)
    for i, knot in enumerate(sequence(value, "cost.expert_table", "(tokens, seconds) knots")):
        pair = sequence(knot, f"cost.expert_table[{i}]", "numbers (tokens, seconds)")
        if len(pair) != 2:
            raise RoutepackError(f"cost.expert_table[{i}]: expected (tokens, seconds), got {knot!r}")
        tokens = finite_float(pair[0], f"cost.expert_table[{i}].tokens", minimum=1.0)
        if knots and tokens <= knots[-1][0]:
            raise RoutepackError(
                f"cost.expert_table[{i}].tokens: must increase from knot to knot, got {tokens} after {knots[-1][0]}"
            )
        knots.append((tokens, finite_float(pair[1], f"cost.expert_table[{i}].seconds")))
    return tuple(knots)


@dataclass(frozen=True)
class CostModel:
    """Coefficients of docs/design.md's cost model (seconds, bytes, bytes/s).

    * ``a_lin``  attention/dense work per token per layer (projections, shared experts).
    * ``a_quad`` ``[L]`` quadratic attention work per layer (0 for linear-attention layers).
    * ``c_tok``  expert compute per routed token; ``c_exp`` fixed cost per active expert.
    * ``token_bytes`` hidden state of one routed token; ``bw_intra``/``bw_inter`` per-GPU links.
    * ``expert_weight_bytes`` (replication, forward), ``expert_grad_bytes`` (fp32 gradient
      reduced back), ``expert_state_bytes`` (weights + optimizer state moved by migration).
    * ``expert_groups``: not a coefficient but the model's `ModelShape.expert_groups`, which
      the ``eplb`` placement passes to EPLB as ``num_groups``; it rides here because the cost
      model is the planner's only view of the model. `from_model` copies it; a hand-built
      cost model, or a JSON file written before it existed, gets 1 (routing without groups).
    * ``num_experts``: the model's `ModelShape.num_experts` E, or None (unknown). Coefficients
      such as ``expert_state_bytes`` are per expert of one model, so `plan_window`,
      `simulate` (and the lower bound it reports) refuse a window with another expert count.
      `from_model` copies it; a hand-built cost model, or a JSON file written before it
      existed, gets None, which checks nothing.
    * ``c_weights``: seconds one active expert's GEMM takes at least per pass (streaming its
      weights): an expert with t tokens on a rank costs ``c_exp + max(c_tok * t, c_weights)``,
      a roofline whose knee is ``c_weights / c_tok`` tokens. 0 (the default): the linear model
      ``c_tok * t + c_exp``. `routepack calibrate` fits it.
    * ``c_gemm``: seconds one active expert's GEMM costs beyond a matrix-vector product per
      pass, once it has ≥ 2 tokens on a rank: the fixed cost of a matrix-matrix kernel (a CPU
      BLAS's GEMM set-up; one token runs as a matrix-vector product and an outer-product
      weight gradient, which skip it). The expert then costs ``c_exp + max(c_tok * t,
      c_weights) + c_gemm * (t >= 2)``: splitting an expert's tokens over replicas pays it once
      per copy. 0 (the default) prices no step; `routepack calibrate` fits it (about 0 on a
      GPU, where ``c_weights`` is the floor of a small grouped GEMM).
    * ``expert_table``: seconds one active expert costs per pass beyond the roofline and
      the GEMM step, as knots ``((tokens per expert, seconds), ...)``, tokens >= 1 and
      increasing, seconds >= 0: linear between knots, the end knots' seconds outside them.
      The expert then costs ``c_exp + max(c_tok * t, c_weights) + c_gemm * (t >= 2) +
      table(t)``. It prices what no closed form follows (a CPU BLAS switching kernels at a few
      rows, a per-token cost that rises once a tile leaves the cache, a GPU's tile
      quantization). Empty (the default) prices none; `routepack calibrate` fits it where it
      earns its knots.
    * ``c_call``: seconds of one EP rank's grouped expert kernel call per pass, whatever its
      experts and tokens (the kernel's launch and set-up, the framework's per-operator work
      around it, an idle stack slot's zero gradient): charged once per rank and exchange where
      the rank computes a token, so a rank's expert time in a pass is ``c_call + Σ over its
      active experts``. 0 (the default) prices none; `routepack calibrate` fits it from the
      spread between active-expert counts (about a millisecond a pass on a CPU).
    * ``a2a_latency``: seconds of one all-to-all beyond its bytes' link time (one dispatch or
      one combine of one pass: the collective's start-up), paid by every exchange whatever it
      moves: an exchange's all-to-all costs ``2 · K · (a2a_latency + link time)``. 0 (the
      default) prices none; `routepack calibrate` fits it with the links (a bare
      all-to-all), or in the MoE layer where the ``exchange`` kind is measured (its routing,
      split sizes and launches too: about 1 ms an all-to-all on the measured run's CPU ranks).
    * ``bw_reduce``: bytes/s at which an all-reduce inside a node moves a rank's bytes (a
      ring all-reduce of n bytes sends ``2·(ep−1)/ep·n`` from every rank): what the
      once-per-step sum of redundant experts' gradients costs (`SimResult.redundant_grads`).
      0 (the default) prices it at ``bw_intra``; `routepack calibrate` measures it with the
      links where it also times the ``exchange``, whose bytes then set ``bw_intra``.
    * ``reduce_latency``: seconds of one all-reduce beyond its bytes' time; the once-per-step
      sum of redundant experts' gradients pays it once per layer holding a redundant expert.
      0 (the default) prices none; `routepack calibrate` fits it with the links.
    * ``replica_prefetch``: whether replica weights are fetched, and their gradients returned,
      while the layer's attention runs (True, the default: replication is exposed only beyond
      the attention, as `routepack.torch` overlaps it on a GPU). False exposes it in full, as
      on a clock that counts the transfers' work whenever it runs (a CPU rank's CPU time:
      `routepack measure`).
    * ``c_replica``: seconds per byte of a replica's weights or gradient an EP rank sends or
      receives, beyond the link's time (posting, relaying and receiving the copy's weights,
      adding and forwarding its fp32 gradient in `routepack.torch`'s replica exchange); a
      rank's replication then costs its link time + ``c_replica`` × the bytes of its hops.
      0 (the default) prices the link alone; `routepack calibrate` fits it where it times the
      ``replication``.
    * ``c_migrate``: seconds per byte of expert state an EP rank migrates, sent or received
      (twice a byte it copies between two of its own slots: packed, then unpacked, over no
      link), beyond the link's time (packing, checksums, backups, unpacking in
      `routepack.torch.migrate`); ``migration_latency``: seconds of a window's migration where
      it moves anything, whatever it moves (the ranks' agreement and verification rounds).
      0 (the defaults) price the link alone; `routepack calibrate` fits both where it times
      the ``migration``. A window's migration then costs ``migration_latency`` + the slowest
      rank's link time + ``c_migrate`` × the bytes it stages (sent, received, 2 × copied within it).
    * ``overlap``: ``"none"`` (the default: a layer's time is attention + experts +
      all-to-all) or ``"dispatch_combine"``: the all-to-all of one microbatch runs behind the
      attention and expert compute of another (DualPipe, DeepEP, Megatron ``moe_fb_overlap``),
      so a layer costs ``max(compute, all_to_all) + exposed replication``.
    * ``passes``: the passes of one step, each ``"forward"`` (compute ×1, one dispatch +
      combine) or ``"backward"`` (compute ×2, one dispatch + combine). The default
      ``("forward", "backward")`` is compute ×3, communication ×2; RL's recompute of old
      log-probs adds a forward: ``("forward", "forward", "backward")``.

    The options' defaults (every field above with a default, ``c_weights`` on) come from the
    core (``_core.cost_defaults()``); a JSON file written before they existed loads with them,
    and prices every plan as it did.
    """

    a_lin: float = field(metadata=_WORK_FIELD)
    a_quad: List[float]
    c_tok: float = field(metadata=_WORK_FIELD)
    c_exp: float = field(metadata=_WORK_FIELD)
    token_bytes: float = field(metadata=_WORK_FIELD)
    bw_intra: float = field(metadata=_RATE_FIELD)
    bw_inter: float = field(metadata=_RATE_FIELD)
    expert_weight_bytes: float = field(metadata=_WORK_FIELD)
    expert_grad_bytes: float = field(metadata=_WORK_FIELD)
    expert_state_bytes: float = field(metadata=_WORK_FIELD)
    expert_groups: int = UNGROUPED
    num_experts: Optional[int] = None
    c_weights: float = field(default=_COST_DEFAULTS["c_weights"], metadata=_WORK_FIELD)
    overlap: str = _COST_DEFAULTS["overlap"]
    passes: Tuple[str, ...] = tuple(_COST_DEFAULTS["passes"])
    c_gemm: float = field(default=_COST_DEFAULTS["c_gemm"], metadata=_WORK_FIELD)
    c_call: float = field(default=_COST_DEFAULTS["c_call"], metadata=_WORK_FIELD)
    a2a_latency: float = field(default=_COST_DEFAULTS["a2a_latency"], metadata=_WORK_FIELD)
    bw_reduce: float = field(default=_COST_DEFAULTS["bw_reduce"], metadata=_OPTION_FIELD)
    expert_table: Tuple[Tuple[float, float], ...] = tuple(map(tuple, _COST_DEFAULTS["expert_table"]))
    reduce_latency: float = field(default=_COST_DEFAULTS["reduce_latency"], metadata=_WORK_FIELD)
    replica_prefetch: bool = _COST_DEFAULTS["replica_prefetch"]
    c_replica: float = field(default=_COST_DEFAULTS["c_replica"], metadata=_WORK_FIELD)
    c_migrate: float = field(default=_COST_DEFAULTS["c_migrate"], metadata=_WORK_FIELD)
    migration_latency: float = field(default=_COST_DEFAULTS["migration_latency"], metadata=_WORK_FIELD)

    def __post_init__(self) -> None:
        if self.num_experts is not None:
            object.__setattr__(self, "num_experts", positive_int(self.num_experts, "cost.num_experts"))
        object.__setattr__(
            self, "expert_groups", _check_groups(self.expert_groups, self.num_experts, "cost.expert_groups")
        )
        if not isinstance(self.overlap, str) or self.overlap not in OVERLAPS:
            raise RoutepackError(f"cost.overlap: {self.overlap!r} is not one of {OVERLAPS}")
        passes = tuple(sequence(self.passes, "cost.passes", "pass kinds"))
        if not passes:
            raise RoutepackError("cost.passes: must name at least one pass, got none")
        for i, kind in enumerate(passes):
            if not isinstance(kind, str) or kind not in PASS_KINDS:
                raise RoutepackError(f"cost.passes[{i}]: {kind!r} is not one of {PASS_KINDS}")
        object.__setattr__(self, "passes", passes)
        for name in _NONNEGATIVE:  # in field order: the first bad one is named
            object.__setattr__(self, name, finite_float(getattr(self, name), f"cost.{name}"))
        object.__setattr__(self, "replica_prefetch", boolean(self.replica_prefetch, "cost.replica_prefetch"))
        for name in _RATES:
            object.__setattr__(self, name, finite_float(getattr(self, name), f"cost.{name}", strict=True))
        object.__setattr__(self, "expert_table", _expert_table(self.expert_table))
        aq = [finite_float(v, f"cost.a_quad[{i}]") for i, v in enumerate(sequence(self.a_quad, "cost.a_quad"))]
        if not aq:
            raise RoutepackError("cost.a_quad: needs one entry per MoE layer, got none")
        object.__setattr__(self, "a_quad", aq)
        if not any(aq) and not any(getattr(self, n) for n in _PRICING) and not any(v for _, v in self.expert_table):
            # every plan would cost 0 s: nothing to rank plans by, and no throughput to report
            priced = ", ".join(f"cost.{n}" for n in ("a_quad", *_PRICING, "expert_table"))
            raise RoutepackError(
                f"cost: every coefficient that prices work is 0 ({priced}), so every plan would take 0 s and "
                "none could be told from another; set at least one"
            )

    @property
    def num_layers(self) -> int:
        return len(self.a_quad)

    def check_window_shape(self, num_layers: int, num_experts: int) -> None:
        """Raises `RoutepackError` naming both numbers unless this cost model is for a window
        of ``num_layers`` MoE layers and (when known) ``num_experts`` experts."""
        if self.num_layers != num_layers:
            raise RoutepackError(f"cost.a_quad: has {self.num_layers} layers but the window has {num_layers}")
        if self.num_experts is not None and self.num_experts != num_experts:
            raise RoutepackError(
                f"cost.num_experts: the cost model is for {self.num_experts} experts but the window has {num_experts}"
            )

    @classmethod
    def from_model(cls, model: ModelShape, hardware: Hardware, weight_bytes: float = 2) -> "CostModel":
        """FLOPs over the achieved rate, bytes over the achieved bandwidth.

        Per token per layer: attention projections 4·H² and shared experts 3·H·I each
        (2 FLOPs per parameter); full attention adds 2·H·n² FLOPs per sample of length n
        (causal QKᵀ and AV); a routed token costs 2·3·H·I on its expert. Migration moves bf16
        weights plus fp32 master weights and Adam's two fp32 moments (14 bytes a parameter).
        """
        instance_of(model, ModelShape, "model")
        instance_of(hardware, Hardware, "hardware")
        # Bytes per parameter (2 for bf16; a fraction for sub-byte formats), checked here so
        # an error blames this argument, not the cost terms derived from it.
        finite_float(weight_bytes, "weight_bytes", strict=True)
        rate = hardware.flops * hardware.flops_efficiency
        h, i = model.hidden, model.expert_ffn
        expert_params = 3 * h * i
        dense = 4 * h * h + model.shared_experts * expert_params
        return cls(
            a_lin=2.0 * dense / rate,
            a_quad=[(2.0 * h / rate if a == "full" else 0.0) for a in model.attention],
            c_tok=2.0 * expert_params / rate,
            c_exp=hardware.expert_overhead_s,
            token_bytes=float(h * weight_bytes),
            bw_intra=hardware.bw_intra * hardware.comm_efficiency,
            bw_inter=hardware.bw_inter * hardware.comm_efficiency,
            expert_weight_bytes=float(expert_params * weight_bytes),
            expert_grad_bytes=float(expert_params * 4),
            expert_state_bytes=float(expert_params * (weight_bytes + 12)),
            expert_groups=model.expert_groups,
            num_experts=model.num_experts,
        )

    # ------------------------------------------------------------- JSON
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "CostModel":
        """The cost model `to_json` wrote: a str, or bytes / bytearray of UTF-8 text."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise RoutepackTypeError(f"cost JSON: expected a string, got {type(text).__name__}")
        if not isinstance(text, str):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as e:
                raise RoutepackError(f"cost JSON: not UTF-8 text ({e})") from None
        data = json_value(text, "cost JSON")
        if not isinstance(data, dict):
            raise RoutepackError(f"cost JSON: expected an object, got {type(data).__name__}")
        fields = set(cls.__dataclass_fields__)
        unknown = set(data) - fields
        missing = fields - set(data) - _OPTIONAL_JSON_KEYS
        if unknown or missing:
            raise RoutepackError(f"cost JSON: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Writes `to_json` (UTF-8) to ``path``, a str or `os.PathLike`."""
        Path(file_path(path)).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Reads what `save` wrote (``routepack calibrate --out``), or the cost model a
        ``routepack calibrate --report`` file holds (its ``cost_model``, e.g. the committed
        docs/calibrate_tiny_cpu.json). A missing or unreadable path raises the usual `OSError`;
        a file that is neither raises `RoutepackFileError` naming the path."""
        raw = Path(file_path(path)).read_bytes()
        try:
            data = json.loads(raw)
        except ValueError:
            data = None  # from_json says what is wrong with it
        if isinstance(data, dict) and isinstance(data.get("cost_model"), dict) and "kernels" in data:
            raw = json.dumps(data["cost_model"]).encode()  # a calibration report
        try:
            return cls.from_json(raw)
        except RoutepackError as e:
            raise RoutepackFileError(f"cost file {str(path)!r}: {e}") from None


#: CostModel fields a JSON file may lack (written before they existed): every field with a
#: default, which then applies.
_OPTIONAL_JSON_KEYS = frozenset(
    f.name for f in dataclasses.fields(CostModel) if f.default is not MISSING or f.default_factory is not MISSING
)


def _numbers(*kinds: str) -> Tuple[str, ...]:
    """`CostModel`'s number fields of ``kinds`` (`NUMBER_KINDS`), in field order."""
    return tuple(f.name for f in dataclasses.fields(CostModel) if f.metadata.get("kind") in kinds)


#: The fields that price work; those checked finite and >= 0; the bandwidths (finite, > 0).
_PRICING, _NONNEGATIVE, _RATES = _numbers("work"), _numbers("work", "option"), _numbers("rate")
