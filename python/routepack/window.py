"""`Window`: the samples of one planning window and their per-layer expert demand."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from routepack import _core, _npz
from routepack._checks import as_int_array, positive_int
from routepack._routed import ROUTED_DTYPES, flatten_slime, flatten_verl, native_order
from routepack.errors import RoutepackError, RoutepackTypeError


class Window:
    """One window of samples, as routing replay describes it.

    Attributes:
        seq_lens:      int64 ``[S]``, tokens of each sample, every entry >= 1.
        expert_tokens: int32 ``[S, L, E]``, tokens of sample s routed to logical expert e in
                       MoE layer l (a token routed top-k counts once for each of its k experts).
    """

    __slots__ = ("seq_lens", "expert_tokens")

    def __init__(self, seq_lens: np.ndarray, expert_tokens: np.ndarray) -> None:
        seq_lens = as_int_array(seq_lens, "seq_lens", 1, np.int64)
        expert_tokens = as_int_array(expert_tokens, "expert_tokens", 3, np.int32)
        if seq_lens.shape[0] == 0:
            raise RoutepackError("seq_lens: a window needs at least one sample (got 0)")
        if expert_tokens.shape[0] != seq_lens.shape[0]:
            raise RoutepackError(
                f"expert_tokens: has {expert_tokens.shape[0]} samples but seq_lens has {seq_lens.shape[0]}"
            )
        if expert_tokens.shape[1] == 0 or expert_tokens.shape[2] == 0:
            raise RoutepackError(f"expert_tokens: needs L >= 1 and E >= 1, got shape {expert_tokens.shape}")
        bad = np.flatnonzero(seq_lens < 1)
        if bad.size:
            raise RoutepackError(f"seq_lens: sample {bad[0]} has length {seq_lens[bad[0]]}; every length must be >= 1")
        if expert_tokens.size and expert_tokens.min() < 0:
            s, l, e = np.unravel_index(int(np.argmin(expert_tokens)), expert_tokens.shape)
            raise RoutepackError(
                f"expert_tokens: negative count {expert_tokens[s, l, e]} at sample {s}, layer {l}, expert {e}"
            )
        self.seq_lens = seq_lens
        self.expert_tokens = expert_tokens

    # ------------------------------------------------------------------ shape
    @property
    def num_samples(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.expert_tokens.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.expert_tokens.shape[2])

    @property
    def total_tokens(self) -> int:
        return int(self.seq_lens.sum())

    def layer_expert_load(self) -> np.ndarray:
        """float64 ``[L, E]``: tokens per logical expert over the window."""
        return self.expert_tokens.sum(axis=0, dtype=np.float64)

    def __repr__(self) -> str:
        return (
            f"Window(S={self.num_samples}, L={self.num_layers}, E={self.num_experts}, "
            f"tokens={self.total_tokens})"
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Window)
            and np.array_equal(self.seq_lens, other.seq_lens)
            and np.array_equal(self.expert_tokens, other.expert_tokens)
        )

    # ------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """Writes an ``.npz`` to exactly ``path`` (no suffix added)."""
        _npz.write(path, seq_lens=self.seq_lens, expert_tokens=self.expert_tokens)

    @classmethod
    def load(cls, path: str | Path) -> "Window":
        """Reads what `save` wrote; a damaged file raises `RoutepackFileError` naming it."""
        z = _npz.read(path, ("seq_lens", "expert_tokens"), "window")
        try:
            return cls(z["seq_lens"], z["expert_tokens"])
        except RoutepackError as e:
            _npz.fail(path, "window", str(e))

    # -------------------------------------------------------- routing replay
    @classmethod
    def from_routed_experts(cls, routed: np.ndarray, cu_seqlens: np.ndarray, num_experts: int) -> "Window":
        """Builds a window from recorded top-k expert ids (routing replay).

        Args:
            routed:      uint8 | int16 | int32 | int64 ``[T, L, k]``: the top-k logical expert
                         ids of every token in every MoE layer (verl, slime, vLLM layout).
            cu_seqlens:  int ``[S+1]``: cumulative token offsets of the samples in ``routed``
                         (``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``, strictly increasing).
            num_experts: E; every id must lie in [0, E).

        Counting runs in Rust, in parallel over samples, reading ``routed`` without a copy.
        """
        num_experts = positive_int(num_experts, "num_experts")
        routed = np.asarray(routed)
        if routed.dtype.type not in ROUTED_DTYPES:
            raise RoutepackTypeError(f"routed: dtype {routed.dtype} is not one of uint8, int16, int32, int64")
        if routed.ndim != 3:
            raise RoutepackError(f"routed: expected [T, L, k], got shape {routed.shape}")
        routed = np.ascontiguousarray(native_order(routed))
        cu = as_int_array(cu_seqlens, "cu_seqlens", 1, np.int64)
        seq_lens, counts = _core.expert_tokens_from_routed(routed, cu, num_experts)
        return cls(seq_lens, counts)

    @classmethod
    def from_verl(cls, routed_experts: np.ndarray, attention_mask: np.ndarray, num_experts: int) -> "Window":
        """verl's padded layout: ``routed_experts [B, T, L, k]`` top-k ids per position (padding
        ignored) and ``attention_mask [B, T]``, 1 (or True) for real tokens, 0 for padding; a
        sample's real tokens may sit anywhere in its row. Sample b's length is its number of
        real tokens. Also `routepack.replay.from_verl`."""
        num_experts = positive_int(num_experts, "num_experts")
        return cls.from_routed_experts(*flatten_verl(routed_experts, attention_mask), num_experts)

    @classmethod
    def from_slime(cls, per_sample: Sequence[np.ndarray], num_experts: int, add_last_token: bool = True) -> "Window":
        """slime's layout: a list of ``[T_i, L, k]`` arrays, one per sample (same L, k and
        dtype). slime records ``tokens - 1`` positions; with ``add_last_token`` (default) each
        sample's length is ``T_i + 1`` (the trainer runs every token), while expert demand
        counts the recorded positions. Also `routepack.replay.from_slime`."""
        num_experts = positive_int(num_experts, "num_experts")
        w = cls.from_routed_experts(*flatten_slime(per_sample), num_experts)
        if add_last_token:
            return cls(w.seq_lens + 1, w.expert_tokens)
        return w
