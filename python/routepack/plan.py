"""`Placement` and `Plan`: what `plan_window` returns, checks, saves and loads."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

import numpy as np

from routepack import _core, _npz
from routepack._checks import (
    WINDOW_WORDS,
    as_int_array,
    callers_words,
    frozen,
    index,
    instance_of,
    json_value,
    positive_int,
    token_cap as check_token_cap,
)
from routepack.errors import RoutepackError, RoutepackFileError, RoutepackTypeError
from routepack.model import CostModel, Topology
from routepack.window import Window


def field_names(dtype: np.dtype) -> Tuple[str, ...]:
    """The field names of a structured dtype (`REPLICA_DTYPE`, `MIGRATION_DTYPE`), in order."""
    names = dtype.names
    if names is None:
        raise RoutepackTypeError(f"expected a structured dtype, got {dtype}")
    return names


#: One intra-batch replica: in microbatch `micro` of EP group `group`, layer `layer`, the
#: weights of logical `expert` go from EP-local rank `src_rank` (which hosts it) to `dst_rank`,
#: which computes `share` of that expert's tokens in that cell (`routepack-core/src/flow/`).
REPLICA_DTYPE = np.dtype(
    [
        ("micro", "<i4"),
        ("group", "<i4"),
        ("layer", "<i4"),
        ("expert", "<i4"),
        ("src_rank", "<i4"),
        ("dst_rank", "<i4"),
        ("share", "<f4"),
    ]
)
REPLICA_FIELDS = field_names(REPLICA_DTYPE)
#: One expert moved between windows, with its weights and optimizer state (`bytes` in all).
MIGRATION_DTYPE = np.dtype(
    [
        ("layer", "<i4"),
        ("expert", "<i4"),
        ("src_rank", "<i4"),
        ("dst_rank", "<i4"),
        ("src_slot", "<i4"),
        ("dst_slot", "<i4"),
        ("bytes", "<f8"),
    ]
)
MIGRATION_FIELDS = field_names(MIGRATION_DTYPE)


def empty_replicas() -> np.ndarray:
    return frozen(np.zeros(0, dtype=REPLICA_DTYPE), fresh=True)


def empty_migration() -> np.ndarray:
    return frozen(np.zeros(0, dtype=MIGRATION_DTYPE), fresh=True)


def _columns(table: np.ndarray) -> tuple:
    return tuple(np.ascontiguousarray(table[name]) for name in field_names(table.dtype))


class Placement:
    """Expert placement, in DeepSeek EPLB's convention.

    Attributes:
        phy2log: int32 ``[L, ep*slots_per_rank]``: logical expert in physical slot p of layer l,
                 or -1 for an empty slot; slot p lives on EP-local rank ``p // slots_per_rank``.
                 Every EP group uses the same placement.
        logcnt:  int32 ``[L, E]``: replicas of each logical expert (>= 1).
        log2phy: int32 ``[L, E, max_replicas]``: physical slots of each expert, padded with -1.

    The arrays are read-only (``phy2log`` is a copy where the caller's array could still be
    written), so ``logcnt`` and ``log2phy``, derived from ``phy2log`` here, cannot go stale
    through an in-place edit; build a new `Placement` to change one. `Plan.validate` derives
    them again and refuses a placement whose tables disagree (an attribute reassigned, or
    write access forced back on).
    """

    __slots__ = ("phy2log", "num_experts", "slots_per_rank", "logcnt", "log2phy")

    def __init__(self, phy2log: np.ndarray, num_experts: int, slots_per_rank: int) -> None:
        self.phy2log = frozen(as_int_array(phy2log, "placement.phy2log", 2, np.int32), name="placement.phy2log")
        self.num_experts = positive_int(num_experts, "num_experts")
        self.slots_per_rank = positive_int(slots_per_rank, "slots_per_rank")
        self.logcnt, self.log2phy = self._derived_tables()

    @classmethod
    def _of_core(cls, phy2log: np.ndarray, num_experts: int, slots_per_rank: int) -> "Placement":
        """A placement around a phy2log the core has just returned (int32, C-contiguous, held
        by nobody else): made read-only where it is, not copied. A copy would double the
        largest table of the call, which the core's memory estimate counts once
        (``Placement::tables_bytes``)."""
        self = cls.__new__(cls)
        self.phy2log = frozen(as_int_array(phy2log, "placement.phy2log", 2, np.int32), fresh=True)
        self.num_experts = positive_int(num_experts, "num_experts")
        self.slots_per_rank = positive_int(slots_per_rank, "slots_per_rank")
        self.logcnt, self.log2phy = self._derived_tables()
        return self

    def _check_fields(self, name: str = "placement") -> "Placement":
        """Checks the fields again, naming them as ``name.field``: they are plain attributes,
        so one reassigned after construction (``slots_per_rank = 0``, ``num_experts = -1``)
        fails here, in the caller's words, not inside the core. Returns self."""
        self.num_experts = positive_int(self.num_experts, f"{name}.num_experts")
        self.slots_per_rank = positive_int(self.slots_per_rank, f"{name}.slots_per_rank")
        phy2log = as_int_array(self.phy2log, f"{name}.phy2log", 2, np.int32)
        if phy2log.shape[1] % self.slots_per_rank:
            raise RoutepackError(
                f"{name}.slots_per_rank: {self.slots_per_rank} does not divide the {phy2log.shape[1]} slots of a layer "
                f"({name}.phy2log has shape {phy2log.shape})"
            )
        return self

    def _derived_tables(self) -> tuple:
        """(logcnt, log2phy) of ``phy2log``, read-only."""
        phy2log = as_int_array(self.phy2log, "placement.phy2log", 2, np.int32)
        logcnt, log2phy = _core.placement_tables(phy2log, self.num_experts, self.slots_per_rank)
        return frozen(logcnt, fresh=True), frozen(log2phy, fresh=True)

    @classmethod
    def static(cls, num_layers: int, num_experts: int, topo: Any) -> "Placement":
        """Megatron-LM's default: expert e on rank e // ceil(E/ep); redundant slots empty."""
        num_layers = positive_int(num_layers, "num_layers")
        num_experts = positive_int(num_experts, "num_experts")
        instance_of(topo, Topology, "topo")
        return cls._of_core(_core.static_placement(num_layers, num_experts, topo), num_experts, topo.slots_per_rank)

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_ranks(self) -> int:
        return self.num_slots // self.slots_per_rank

    def rank_experts(self, layer: int, rank: int) -> np.ndarray:
        """Logical experts in EP rank `rank`'s slots of `layer` (-1 = empty): a read-only view
        of ``phy2log``. ``layer`` in [0, L) and ``rank`` in [0, num_ranks), as ints."""
        layer = index(layer, "layer", self.num_layers, "MoE layers")
        rank = index(rank, "rank", self.num_ranks, "EP ranks")
        lo = rank * self.slots_per_rank
        return self.phy2log[layer, lo : lo + self.slots_per_rank]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Placement)
            and self.num_experts == other.num_experts
            and self.slots_per_rank == other.slots_per_rank
            and np.array_equal(self.phy2log, other.phy2log)
        )

    def __repr__(self) -> str:
        return f"Placement(L={self.num_layers}, E={self.num_experts}, slots={self.num_slots})"


@dataclass
class Plan:
    """A plan for one window (see docs/design.md's table).

    * ``placement``: `Placement`.
    * ``sample_rank``, ``sample_micro``: int32 ``[S]``, DP rank and microbatch of sample s.
    * ``num_micro``: M, the same on every DP rank.
    * ``replicas``: structured array of `REPLICA_DTYPE` rows (intra-batch replication).
    * ``migration``: structured array of `MIGRATION_DTYPE` rows (moves from ``previous``).
    * ``report``: predicted step time and its parts, bounds, certificates, imbalance, wall time.
    * ``replica_timing``: when the intra-batch copies move (`REPLICA_TIMINGS`): ``"prefetch"``
      (the default: planned before the step, fetched while each layer's attention runs) or
      ``"after_router"`` (planned from the router's output, as MoonEP and UltraEP plan:
      fetched after it, so `simulate` exposes their forward weight copies).

    The arrays are read-only after construction (copies where the caller's could still be
    written); fields reassigned later are checked, and frozen, again by `validate`,
    `simulate` and the core's conversion.
    """

    placement: Placement
    sample_rank: np.ndarray
    sample_micro: np.ndarray
    num_micro: int
    replicas: np.ndarray = field(default_factory=empty_replicas)
    migration: np.ndarray = field(default_factory=empty_migration)
    report: Dict[str, Any] = field(default_factory=dict)
    policy: str = ""
    replica_timing: str = "prefetch"

    def __post_init__(self) -> None:
        self._check_fields()

    def _check_fields(self, prefix: str = "") -> None:
        """Checks (and normalises) every field. A dataclass's fields can be reassigned after
        construction, so `validate`, `simulate` and the core's conversion run this again:
        a field set to ``None`` or a wrong type fails naming the field, not deep inside.
        ``prefix`` is how the caller knows the plan (``"plan."`` where it was an argument
        named ``plan``; '' for the plan's own methods and constructor)."""
        instance_of(self.placement, Placement, f"{prefix}placement")._check_fields(f"{prefix}placement")
        for name in ("sample_rank", "sample_micro"):
            arg = f"{prefix}{name}"
            setattr(self, name, frozen(as_int_array(getattr(self, name), arg, 1, np.int32), name=arg))
        self.num_micro = positive_int(self.num_micro, f"{prefix}num_micro")
        for name, dtype in (("replicas", REPLICA_DTYPE), ("migration", MIGRATION_DTYPE)):
            table = np.asarray(getattr(self, name))
            if table.dtype != dtype or table.ndim != 1:
                raise RoutepackTypeError(
                    f"{prefix}{name}: expected a 1-D structured array of dtype {dtype}, got {table.dtype}"
                )
            setattr(self, name, frozen(table, name=f"{prefix}{name}"))
        if not isinstance(self.report, dict):
            raise RoutepackTypeError(f"{prefix}report: expected a dict, got {type(self.report).__name__}")
        if not isinstance(self.policy, str):
            raise RoutepackTypeError(f"{prefix}policy: expected a str, got {type(self.policy).__name__}")
        if not isinstance(self.replica_timing, str) or self.replica_timing not in REPLICA_TIMINGS:
            raise RoutepackError(f"{prefix}replica_timing: {self.replica_timing!r} is not one of {REPLICA_TIMINGS}")

    @property
    def num_samples(self) -> int:
        return int(self.sample_rank.shape[0])

    def cell_samples(self, rank: int, micro: int) -> np.ndarray:
        """Indices of the samples that DP rank `rank` runs in microbatch `micro` (ints >= 0; a
        rank or microbatch the plan does not have runs none, so the result is empty)."""
        rank = positive_int(rank, "rank", minimum=0)
        micro = positive_int(micro, "micro", minimum=0)
        return np.flatnonzero((self.sample_rank == rank) & (self.sample_micro == micro))

    def _to_core(self) -> tuple:
        """The tuple the Rust bindings read (see src/convert.rs)."""
        self._check_fields()
        p = self.placement
        return (
            as_int_array(p.phy2log, "placement.phy2log", 2, np.int32),
            p.num_experts,
            p.slots_per_rank,
            self.sample_rank,
            self.sample_micro,
            self.num_micro,
            _columns(self.replicas),
            _columns(self.migration),
        )

    def validate(self, window: Any, topo: Any, token_cap: int, oversize: Any = None) -> "Plan":
        """Checks every invariant of docs/design.md; raises `InvalidPlanError` with the first
        violation (each sample exactly once, no row over the cap, equal microbatch counts
        meeting a pipeline's rule, no empty cell, valid placement, replica shares in [0, 1]
        summing to at most 1, migration consistent with the placement, ``logcnt`` and
        ``log2phy`` what ``phy2log`` gives). ``oversize`` (None: what ``report["oversize"]``
        records, else "refuse"): with "alone" a row over the cap may hold one sample; with
        "split" a sample over the cap is split over a CP group of ``topo.cp`` ranks (at the
        group's first rank, alone in its cell, the group's other cells at its microbatch
        empty).
        Returns self."""
        from routepack.oversize import plan_mode

        instance_of(window, Window, "window")._check_fields("window")
        instance_of(topo, Topology, "topo")
        token_cap = check_token_cap(token_cap)
        self._check_fields()  # before reading report: a field set to None must be named
        mode = plan_mode(self, oversize)
        with callers_words(WINDOW_WORDS):
            _core.validate_plan(self, window.seq_lens, window.counts, topo, token_cap, mode)
        return self

    def memory(self, topo: Any, cost: Any) -> Dict[str, Any]:
        """The expert memory the plan needs on each DP rank, in bytes (what
        ``plan.report["memory"]`` holds): every MoE layer's ``slots_per_rank`` resident slots,
        each with its weights and optimizer state (``cost.expert_state_bytes``) and its fp32
        gradient (``cost.expert_grad_bytes``); plus the replica buffers, each holding a copy's
        weights in the forward pass (``cost.expert_weight_bytes``) and its fp32 gradient in the
        backward until it is sent home (``cost.expert_grad_bytes``). A layer's buffers on a
        rank are the most distinct experts it receives copies of in one microbatch of that
        layer (a copy lives from the layer's forward to its backward, so the buffers of every
        layer are held at once).

        Keys: ``resident_bytes`` (the same on every rank), ``replica_bytes`` ``[dp]`` (the
        buffers this plan uses), ``rank_bytes`` ``[dp]`` (their sum), ``max_rank_bytes``,
        ``replica_buffers`` (the most copies of one rank in one exchange) and
        ``topology_buffer_bytes``: what ``topo.replica_slots`` buffers a layer take on every
        rank (the allocation a runner that sizes them by the topology makes)."""
        instance_of(topo, Topology, "topo")
        instance_of(cost, CostModel, "cost")
        self._check_fields()
        layers = self.placement.num_layers
        resident = layers * topo.slots_per_rank * (cost.expert_state_bytes + cost.expert_grad_bytes)
        copy = cost.expert_weight_bytes + cost.expert_grad_bytes
        used = np.zeros(topo.dp, dtype=np.int64)
        most = 0
        r = self.replicas
        if len(r):
            # one int64 key per (group, micro, layer, dst, expert): distinct copies, then copies per
            # (group, micro, layer, dst), then the most over microbatches per (group, layer, dst)
            e_n, m_n = self.placement.num_experts, self.num_micro
            g, m, l, d = (r[f].astype(np.int64) for f in ("group", "micro", "layer", "dst_rank"))
            exchange = ((g * m_n + m) * layers + l) * topo.ep + d
            key = np.unique(exchange * e_n + r["expert"].astype(np.int64))
            exchange, copies = np.unique(key // e_n, return_counts=True)
            most = int(copies.max())
            per = np.zeros((topo.num_groups, layers, topo.ep), dtype=np.int64)
            grp, lay, dst = exchange // (m_n * layers * topo.ep), exchange // topo.ep % layers, exchange % topo.ep
            np.maximum.at(per, (grp, lay, dst), copies)
            used = per.sum(axis=1).reshape(-1)  # DP rank = group * ep + EP-local rank
        replica = used * copy
        rank = resident + replica
        return {
            "resident_bytes": float(resident),
            "replica_bytes": replica.astype(np.float64).tolist(),
            "rank_bytes": rank.astype(np.float64).tolist(),
            "max_rank_bytes": float(rank.max()),
            "replica_buffers": most,
            "topology_buffer_bytes": float(layers * topo.replica_slots * copy),
        }

    # ------------------------------------------------------------ persistence
    def save(self, path: _npz.Target) -> None:
        """Writes an ``.npz`` to exactly ``path`` (a str or `os.PathLike`, no suffix added, or a
        binary file open for writing) that `Plan.load` reads back identically (its fields are
        checked first: a plan is saved only as one `Plan.load` reads)."""
        self._check_fields()
        try:
            report = np.array(json.dumps(_json_ready(self.report, "report")))
        except RecursionError:
            raise RoutepackTypeError("report: nested too deeply to save as JSON") from None
        _npz.write(
            path,
            phy2log=self.placement.phy2log,
            num_experts=np.int64(self.placement.num_experts),
            slots_per_rank=np.int64(self.placement.slots_per_rank),
            sample_rank=self.sample_rank,
            sample_micro=self.sample_micro,
            num_micro=np.int64(self.num_micro),
            replicas=self.replicas,
            migration=self.migration,
            report=report,
            policy=np.array(self.policy),
            replica_timing=np.array(self.replica_timing),
        )

    @classmethod
    def load(cls, path: _npz.Target) -> "Plan":
        """Reads what `save` wrote (from a path or a binary file open for reading); a damaged
        file raises `RoutepackFileError` naming it."""
        z = _npz.read(path, _PLAN_KEYS, "plan", optional=("replica_timing",))
        try:
            report = json_value(_npz.scalar_str(z, "report", path, "plan"), "report")
        except RoutepackError as e:
            _npz.fail(path, "plan", str(e))
        if not isinstance(report, dict):
            _npz.fail(path, "plan", f"report: expected a JSON object, got {type(report).__name__}")
        try:
            return cls(
                placement=Placement(
                    z["phy2log"],
                    _npz.scalar_int(z, "num_experts", path, "plan"),
                    _npz.scalar_int(z, "slots_per_rank", path, "plan"),
                ),
                sample_rank=z["sample_rank"],
                sample_micro=z["sample_micro"],
                num_micro=_npz.scalar_int(z, "num_micro", path, "plan"),
                replicas=z["replicas"],
                migration=z["migration"],
                report=report,
                policy=_npz.scalar_str(z, "policy", path, "plan"),
                replica_timing=(
                    _npz.scalar_str(z, "replica_timing", path, "plan") if "replica_timing" in z else "prefetch"
                ),
            )
        except RoutepackFileError:
            raise
        except RoutepackError as e:
            _npz.fail(path, "plan", str(e))

    def digest(self) -> str:
        """SHA-256 (hex) of the plan's decisions: each of ``sample_rank``, ``sample_micro``,
        ``num_micro`` (as int64), ``placement.phy2log``, ``replicas``, ``migration`` as its
        dtype name, shape and bytes, and ``replica_timing`` where it is not ``"prefetch"``.
        Equal digests, equal plans (the report is not hashed); what the golden-digest test pins
        and ``benches/scale.py`` prints."""
        self._check_fields()
        h = hashlib.sha256()
        for arr in (
            self.sample_rank,
            self.sample_micro,
            np.asarray([self.num_micro], dtype=np.int64),
            self.placement.phy2log,
            self.replicas,
            self.migration,
        ):
            a = np.ascontiguousarray(arr)
            h.update(str(a.dtype).encode())
            h.update(str(a.shape).encode())
            h.update(a.tobytes())
        if self.replica_timing != "prefetch":
            h.update(self.replica_timing.encode())
        return h.hexdigest()

    def same_as(self, other: "Plan") -> bool:
        """Same decisions (placement, layout, replicas, migration); the report may differ."""
        instance_of(other, Plan, "other")
        return (
            self.placement == other.placement
            and np.array_equal(self.sample_rank, other.sample_rank)
            and np.array_equal(self.sample_micro, other.sample_micro)
            and self.num_micro == other.num_micro
            and self.replicas.tobytes() == other.replicas.tobytes()
            and self.migration.tobytes() == other.migration.tobytes()
            and self.replica_timing == other.replica_timing
        )

    def __repr__(self) -> str:
        return (
            f"Plan(policy={self.policy!r}, S={self.num_samples}, M={self.num_micro}, "
            f"{self.placement!r}, replicas={len(self.replicas)}, moves={len(self.migration)})"
        )


#: `Plan.replica_timing` values: copies prefetched while the layer's attention runs, or fetched
#: after its router (planned from the router's output).
REPLICA_TIMINGS = ("prefetch", "after_router")

#: The arrays a plan file holds (`Plan.save`; and ``replica_timing``, optional: files written
#: before it existed hold prefetched copies).
_PLAN_KEYS = (
    "phy2log",
    "num_experts",
    "slots_per_rank",
    "sample_rank",
    "sample_micro",
    "num_micro",
    "replicas",
    "migration",
    "report",
    "policy",
)


#: What JSON holds as it is (besides dicts and lists, which `_json_ready` walks).
_JSON_SCALARS = (str, int, float, bool, type(None))


def _json_ready(value: Any, where: str) -> Any:
    """``value`` as what `json.dumps` writes and `json.loads` reads back: numpy arrays as
    lists, numpy scalars as Python numbers, tuples as lists, dict keys as str (as JSON makes
    them; a key that is no str, number, bool or None is refused). Anything else raises
    `RoutepackTypeError` naming where it sits (``report['a'][3]``)."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, np.generic) and isinstance(value.item(), _JSON_SCALARS):
        return value.item()
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return [_json_ready(v, f"{where}[{i}]") for i, v in enumerate(value.tolist())]
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_json_ready(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if isinstance(k, np.generic):
                k = k.item()
            if not isinstance(k, _JSON_SCALARS):
                raise RoutepackTypeError(
                    f"{where}: key {k!r} of type {type(k).__name__} is not a JSON key (str, number, bool or None)"
                )
            out[k] = _json_ready(v, f"{where}[{k!r}]")
        return out
    raise RoutepackTypeError(f"{where}: value of type {type(value).__name__} is not JSON-serialisable: {value!r:.80}")
