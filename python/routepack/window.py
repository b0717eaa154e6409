"""`Window`: the samples of one planning window and their per-layer expert demand."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from routepack import _core, _npz
from routepack._checks import allocating, as_int_array, boolean, positive_int, restated
from routepack.routes.ids import (
    ROUTED_DTYPES,
    flatten_slime,
    flatten_verl,
    native_order,
    renamed,
    slime_location,
    verl_location,
)
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.routes.layers import check_moe_layers, dense_hint
from routepack.routes.summary import RouteSummary


#: Largest total of a window's lengths: `Window.total_tokens` and every token sum the core
#: compares with a cap are int64.
MAX_TOTAL_TOKENS = 2**63 - 1

#: The dtypes `Window.counts` is stored in, narrowest first: a window keeps the first that
#: holds its largest count (what the core and every binding taking counts read, zero-copy).
COUNT_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32))
#: `Window.from_slime`'s default: a sample runs one token more than slime records.
SLIME_ADD_LAST_TOKEN = True


def count_dtype(top: int) -> np.dtype:
    """The narrowest of `COUNT_DTYPES` holding every count in ``0..=top``."""
    return next((d for d in COUNT_DTYPES[:2] if top <= np.iinfo(d).max), COUNT_DTYPES[2])


class Window:
    """One window of samples, as routing replay describes it.

    Attributes:
        seq_lens:      int64 ``[S]``, tokens of each sample, every entry >= 1; their total
                       fits int64 (`MAX_TOTAL_TOKENS`).
        counts:        uint8 | uint16 | int32 ``[S, L, E]``, C-contiguous: tokens of sample s
                       routed to logical expert e in MoE layer l (a token routed top-k counts
                       once for each of its k experts), stored in the narrowest of
                       `COUNT_DTYPES` that holds the largest count (uint8 when every count is
                       <= 255, uint16 when <= 65,535, else int32). The planner, the simulator
                       and validation read this array without a copy.
        expert_tokens: int32 ``[S, L, E]``, the same counts widened (a property: a new
                       read-only int32 copy on every access unless ``counts`` is int32, then a
                       read-only view of it); for code written against int32 counts.
        top_k:         the experts each token picks (k), or None where the window's maker did
                       not say.

    ``expert_tokens`` given to the constructor may be any integer array (int64, int32, the
    unsigned types, ...); values that fit uint16 are converted straight to the narrowest
    dtype, never through int32. A window equals another with the same lengths and counts
    whatever dtypes they were given in.

    Counts must be possible for their lengths, else the constructor raises naming the
    sample, layer (and expert): a token picks an expert at most once, so no count exceeds its
    sample's length; and with ``top_k`` known, a layer's counts add up to at most
    ``seq_len · top_k``. ``top_k`` is known when the window comes from routing replay
    (`from_routed_experts`, `from_verl`, `from_slime` set it to the routed array's k) or when
    its maker passes it; `save` keeps it and `load` restores it (files written before it
    existed load with None). It is declared data about the counts, not part of them, so it
    does not take part in ``==``. No known trace format needs counts beyond these bounds, so
    there is no escape hatch: a window that violates them is a recording or conversion bug.
    """

    __slots__ = ("seq_lens", "counts", "top_k", "_checked", "__weakref__")

    def __init__(self, seq_lens: np.ndarray, expert_tokens: np.ndarray, top_k: Optional[int] = None) -> None:
        seq_lens = as_int_array(seq_lens, "seq_lens", 1, np.int64)
        expert_tokens = _as_counts(expert_tokens)
        if seq_lens.shape[0] == 0:
            raise RoutepackError("seq_lens: a window needs at least one sample (got 0)")
        if expert_tokens.shape[0] != seq_lens.shape[0]:
            raise RoutepackError(
                f"expert_tokens: has {expert_tokens.shape[0]} samples but seq_lens has {seq_lens.shape[0]}"
            )
        if expert_tokens.shape[1] == 0 or expert_tokens.shape[2] == 0:
            raise RoutepackError(f"expert_tokens: needs L >= 1 and E >= 1, got shape {expert_tokens.shape}")
        if top_k is not None:
            top_k = positive_int(top_k, "top_k", maximum=expert_tokens.shape[2])
        bad = np.flatnonzero(seq_lens < 1)
        if bad.size:
            raise RoutepackError(f"seq_lens: sample {bad[0]} has length {seq_lens[bad[0]]}; every length must be >= 1")
        _check_total(seq_lens)
        # negative counts, counts above their sample's length and (with top_k) layer totals
        # above seq_len * top_k: one parallel pass in the core, naming the first offender;
        # it returns the largest count, which picks the narrowest dtype
        top = _core.check_expert_tokens(seq_lens, expert_tokens, top_k)
        want = count_dtype(top)
        if want.itemsize < expert_tokens.dtype.itemsize:
            with allocating("expert_tokens", f"a {want.name} copy", expert_tokens.size * want.itemsize):
                expert_tokens = expert_tokens.astype(want)
        self.seq_lens = seq_lens
        self.counts = expert_tokens
        self.top_k = top_k
        self._checked = self._fields_key()

    def _fields_key(self) -> Optional[tuple]:
        """What the counts' values were last checked with: the arrays (by weak reference, so a
        replaced array is not kept alive) and ``top_k``."""
        return (weakref.ref(self.seq_lens), weakref.ref(self.counts), self.top_k)

    def __getstate__(self) -> dict:
        # pickled (torch.distributed's object collectives): the fields, not the weak references
        return {"seq_lens": self.seq_lens, "counts": self.counts, "top_k": self.top_k}

    def __setstate__(self, state: dict) -> None:
        self.seq_lens, self.counts, self.top_k = state["seq_lens"], state["counts"], state["top_k"]
        self._checked = None  # checked again where it is first read (`_check_fields`)

    def _fields_unchanged(self) -> bool:
        if self._checked is None:
            return False
        seq_ref, counts_ref, top_k = self._checked
        seq, counts = seq_ref(), counts_ref()  # None once the checked array is gone
        return (
            seq is not None
            and seq is self.seq_lens
            and counts is not None
            and counts is self.counts
            and (type(top_k) is type(self.top_k) and top_k == self.top_k)
        )

    def _check_fields(self, name: str = "window") -> "Window":
        """Checks the fields again, naming them as ``name.field``: they are plain attributes,
        so one reassigned after construction (float ``seq_lens``, counts of another shape or
        above their lengths, a ``top_k`` of 0) fails here, in the caller's words, at every
        public call that reads the window (`plan_window`, `simulate`, `Plan.validate`). Types
        and shapes are checked every time; the counts' values, as the constructor checks them,
        whenever an array or ``top_k`` was replaced since they last were (an array edited in
        place is not seen: the core still refuses a negative count as it reads it).
        Returns self."""
        if self._fields_unchanged():
            return self
        seq_lens = as_int_array(self.seq_lens, f"{name}.seq_lens", 1, np.int64)
        counts = _as_counts(self.counts, f"{name}.counts")
        if seq_lens.shape[0] == 0:
            raise RoutepackError(f"{name}.seq_lens: a window needs at least one sample (got 0)")
        if counts.shape[0] != seq_lens.shape[0] or counts.shape[1] == 0 or counts.shape[2] == 0:
            raise RoutepackError(
                f"{name}.counts: expected [S={seq_lens.shape[0]}, L >= 1, E >= 1], got shape {counts.shape}"
            )
        bad = np.flatnonzero(seq_lens < 1)
        if bad.size:
            raise RoutepackError(
                f"{name}.seq_lens: sample {bad[0]} has length {seq_lens[bad[0]]}; every length must be >= 1"
            )
        _check_total(seq_lens, f"{name}.seq_lens")
        top_k = None if self.top_k is None else positive_int(self.top_k, f"{name}.top_k", maximum=counts.shape[2])
        try:
            _core.check_expert_tokens(seq_lens, counts, top_k)
        except RoutepackError as e:
            raise restated(e, {"expert_tokens": f"{name}.expert_tokens", "seq_lens": f"{name}.seq_lens"}) from None
        self.seq_lens, self.counts, self.top_k = seq_lens, counts, top_k
        self._checked = self._fields_key()
        return self

    @property
    def expert_tokens(self) -> np.ndarray:
        """int32 ``[S, L, E]``: `counts` widened to int32, read-only. A new copy on every
        access (S·L·E·4 bytes) unless `counts` is int32 already (then a read-only view);
        routepack's own code reads `counts`."""
        if self.counts.dtype == np.int32:
            out = self.counts.view()
        else:
            with allocating("expert_tokens", "an int32 copy of the counts", self.counts.size * 4):
                out = self.counts.astype(np.int32)
        out.flags.writeable = False
        return out

    # ------------------------------------------------------------------ shape
    @property
    def num_samples(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.counts.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[2])

    @property
    def total_tokens(self) -> int:
        """Σ seq_lens (fits int64: checked at construction)."""
        return int(self.seq_lens.sum())

    def layer_expert_load(self) -> np.ndarray:
        """float64 ``[L, E]``: tokens per logical expert over the window."""
        return self.counts.sum(axis=0, dtype=np.float64)

    def __repr__(self) -> str:
        k = "" if self.top_k is None else f", top_k={self.top_k}"
        return f"Window(S={self.num_samples}, L={self.num_layers}, E={self.num_experts}{k}, tokens={self.total_tokens})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Window)
            and np.array_equal(self.seq_lens, other.seq_lens)
            and np.array_equal(self.counts, other.counts)
        )

    # ------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """Writes an ``.npz`` to exactly ``path`` (no suffix added): ``seq_lens``, the counts
        as ``expert_tokens`` in their stored dtype (`counts`), ``top_k`` only when known."""
        extra = {} if self.top_k is None else {"top_k": np.int64(self.top_k)}
        _npz.write(path, seq_lens=self.seq_lens, expert_tokens=self.counts, **extra)

    @classmethod
    def load(cls, path: str | Path) -> "Window":
        """Reads what `save` wrote; a damaged file raises `RoutepackFileError` naming it. A file
        without ``top_k`` (written before it was kept) loads with ``top_k=None``; one whose
        counts were saved as int32 (before windows stored the narrowest dtype) loads narrowed,
        read chunk by chunk so the int32 array is never held whole."""
        z = _npz.read(path, ("seq_lens", "expert_tokens"), "window", optional=("top_k",), narrow=("expert_tokens",))
        top_k = _npz.scalar_int(z, "top_k", path, "window") if "top_k" in z else None
        try:
            return cls(z["seq_lens"], z["expert_tokens"], top_k)
        except RoutepackError as e:
            _npz.fail(path, "window", str(e))

    # -------------------------------------------------------- routing replay
    @classmethod
    def from_routed_experts(
        cls, routed: np.ndarray, cu_seqlens: np.ndarray, num_experts: int, moe_layers: Any = None
    ) -> "Window":
        """Builds a window from recorded top-k expert ids (routing replay).

        Args:
            routed:      uint8 | int16 | int32 | int64 ``[T, L, k]``: the top-k logical expert
                         ids of every token, one row per layer (verl, slime, vLLM, SGLang
                         layout: ``L = num_hidden_layers``, a dense layer's row zero filler).
            cu_seqlens:  int ``[S+1]``: cumulative token offsets of the samples in ``routed``
                         (``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``, strictly increasing).
            num_experts: E; every counted id must lie in [0, E).
            moe_layers:  ints ``[L']``, the rows of ``routed``'s layer axis that are MoE layers,
                         strictly increasing (`routepack.routes.MoELayers` reads them from a
                         Megatron or transformers config); None (default): every row. The
                         window's layer l is row ``moe_layers[l]``, so plans are keyed by MoE
                         layer (L' of them); the other rows are never read.

        Counting runs in Rust, in parallel over samples, reading ``routed`` without a copy.
        A token that lists one expert twice among its k in a counted layer is refused naming
        the token and the layer's row, as is a sample of more than 2**31 - 1 tokens (its counts
        could not fit int32). The window's ``top_k`` is the routed array's k.
        """
        num_experts = positive_int(num_experts, "num_experts")
        routed = np.asarray(routed)
        if routed.dtype.type not in ROUTED_DTYPES:
            raise RoutepackTypeError(f"routed: dtype {routed.dtype} is not one of uint8, int16, int32, int64")
        if routed.ndim != 3:
            raise RoutepackError(f"routed: expected [T, L, k], got shape {routed.shape}")
        if routed.shape[2] > num_experts:
            raise RoutepackError(
                f"num_experts: {num_experts} is fewer than the {routed.shape[2]} experts each token picks (k)"
            )
        with allocating("routed", "a contiguous copy", routed.nbytes):
            routed = np.ascontiguousarray(native_order(routed))
        rows = check_moe_layers(moe_layers, int(routed.shape[1]))
        cu = as_int_array(cu_seqlens, "cu_seqlens", 1, np.int64)
        layers = None if rows is None else [int(r) for r in rows]
        try:
            seq_lens, counts = _core.expert_tokens_from_routed(routed, cu, num_experts, layers)
        except RoutepackError as e:
            raise dense_hint(e, moe_layers) from None
        return cls(seq_lens, counts, top_k=int(routed.shape[2]))

    @classmethod
    def from_summary(cls, summary: Any) -> "Window":
        """The window of a `routepack.routes.RouteSummary` (per-sample counts a rollout worker
        computed; `routepack.routes.merge` joins them): its lengths and counts, in its count
        type, and its ``top_k``."""
        if not isinstance(summary, RouteSummary):
            raise RoutepackTypeError(f"summary: expected a routepack.routes.RouteSummary, got {type(summary).__name__}")
        return cls(summary.seq_lens, summary.counts, top_k=summary.top_k)

    @classmethod
    def from_verl(
        cls, routed_experts: np.ndarray, attention_mask: np.ndarray, num_experts: int, moe_layers: Any = None
    ) -> "Window":
        """verl's padded layout: ``routed_experts [B, T, L, k]`` top-k ids per position (padding
        ignored) and ``attention_mask [B, T]``, 1 (or True) for real tokens, 0 for padding; a
        sample's real tokens may sit anywhere in its row. Sample b's length is its number of
        real tokens; ``moe_layers`` as in `from_routed_experts`. Every real position is
        counted (verl's R3 placeholder rows too: `routepack.routes.verl_summary` leaves them
        out). Also `routepack.replay.from_verl`."""
        num_experts = positive_int(num_experts, "num_experts")
        routed, cu = flatten_verl(routed_experts, attention_mask)
        try:
            return cls.from_routed_experts(routed, cu, num_experts, moe_layers)
        except RoutepackError as e:
            raise renamed(e, "routed_experts", verl_location(attention_mask, cu)) from None

    @classmethod
    def from_slime(
        cls,
        per_sample: Iterable[np.ndarray],
        num_experts: int,
        add_last_token: bool = SLIME_ADD_LAST_TOKEN,
        moe_layers: Any = None,
    ) -> "Window":
        """slime's layout: a list (or any iterable) of ``[T_i, L, k]`` arrays, one per sample
        (same L, k and dtype). slime records ``tokens - 1`` positions; with ``add_last_token``
        (default True; a bool) each sample's length is ``T_i + 1`` (the trainer runs every
        token), while expert demand counts the recorded positions; ``moe_layers`` as in
        `from_routed_experts`. Also `routepack.replay.from_slime`."""
        num_experts = positive_int(num_experts, "num_experts")
        add_last_token = boolean(add_last_token, "add_last_token")
        routed, cu = flatten_slime(per_sample)
        try:
            w = cls.from_routed_experts(routed, cu, num_experts, moe_layers)
        except RoutepackError as e:
            raise renamed(e, "per_sample", slime_location(cu)) from None
        if add_last_token:
            return cls(w.seq_lens + 1, w.counts, w.top_k)
        return w


def _as_counts(value: Any, name: str = "expert_tokens") -> np.ndarray:
    """``expert_tokens`` as a C-contiguous ``[S, L, E]`` array of `COUNT_DTYPES`: kept as given
    when it is one (native byte order), converted straight to the narrowest when its values
    fit uint16, else to int32 as `as_int_array` does (which also names every type or shape
    error). Values are checked by the core afterwards (`_core.check_expert_tokens`)."""
    arr = np.asarray(value)
    if arr.dtype in COUNT_DTYPES and arr.dtype.isnative:
        if arr.ndim != 3:
            raise RoutepackError(f"{name}: expected 3 dimensions, got shape {arr.shape}")
        with allocating(name, "a contiguous copy", arr.nbytes):
            return np.ascontiguousarray(arr)
    if arr.dtype != np.bool_ and np.issubdtype(arr.dtype, np.integer) and arr.ndim == 3 and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo >= 0 and hi <= np.iinfo(np.uint16).max:
            want = count_dtype(hi)
            with allocating(name, f"a contiguous {want.name} copy", arr.size * want.itemsize):
                return np.ascontiguousarray(arr, dtype=want)
    return as_int_array(arr, name, 3, np.int32)


def _check_total(seq_lens: np.ndarray, name: str = "seq_lens") -> None:
    """Refuses lengths (each >= 1) whose total would overflow int64. Summed exactly in Python
    ints, but only where numpy's int64 sum could wrap (the largest length times S exceeds
    the limit), so the common case costs one max."""
    if int(seq_lens.max()) <= MAX_TOTAL_TOKENS // seq_lens.shape[0]:
        return
    total = sum(int(n) for n in seq_lens)
    if total > MAX_TOTAL_TOKENS:
        raise RoutepackError(
            f"{name}: the {seq_lens.shape[0]} lengths add up to {total} tokens, more than int64 holds "
            f"({MAX_TOTAL_TOKENS}); the largest is {int(seq_lens.max())}"
        )
