"""What `routepack.calibrate` measures: the sweep points and the timer's settings.

`Sweeps.default` scales the sweeps to the device: a CUDA GPU runs the whole range a training
step sees (thousands of tokens per expert, samples of tens of thousands of tokens) in a few
minutes, while one CPU core needs a narrower range to stay within ~10 minutes; ``quick``
is a smoke run (tests, the README) of well under a minute with small shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, NamedTuple, Optional, Tuple

from routepack._checks import finite_float, positive_int, sequence
from routepack.errors import RoutepackError


def log_points(lo: int, hi: int, per_octave: float) -> Tuple[int, ...]:
    """Integers from ``lo`` to ``hi`` (both included), ``per_octave`` points per doubling,
    rounded, duplicates dropped."""
    lo, hi = positive_int(lo, "lo"), positive_int(hi, "hi")
    if hi < lo:
        raise RoutepackError(f"sweep: hi={hi} < lo={lo}")
    out: List[int] = []
    i = 0
    while True:
        v = int(round(lo * 2.0 ** (i / per_octave)))
        if v >= hi:
            break
        if not out or v != out[-1]:
            out.append(v)
        i += 1
    return tuple(out) + (hi,)


def _ints(values: object, name: str) -> Tuple[int, ...]:
    got = tuple(positive_int(v, f"{name}[{i}]") for i, v in enumerate(sequence(values, name)))
    if not got:
        raise RoutepackError(f"{name}: needs at least one point, got none")
    if list(got) != sorted(set(got)):
        raise RoutepackError(f"{name}: must be increasing without repeats, got {list(got)}")
    return got


class _Preset(NamedTuple):
    tokens_per_expert: int  # top of the expert sweep, from 1
    per_octave: float
    active: Tuple[int, ...]
    max_tokens: int
    shortest: int  # attention lengths from ... to ...
    length: int
    per_octave_length: float
    messages: Tuple[int, int, float]  # bytes from, to, points per octave
    warmup: int
    repeats: int
    visit_s: float  # a visit calls a point as often as fills this many seconds ...
    visit_calls: int  # ... at most this often
    exchange_tokens: Tuple[int, int, float]  # tokens per rank of the exchange sweep: from, to, per octave
    short_repeats: int  # timed rounds more for the short points (called more than once a visit)
    migration_moves: Tuple[int, ...]  # experts two ranks swap at each point of the migration sweep
    replication_copies: Tuple[int, ...]  # copies each of two ranks sends at each point of the replication sweep


_PRESETS = {
    # quick: messages up to 8 MiB, so the fitted bandwidth is not lost in a loaded machine's noise
    "quick": _Preset(
        256,
        0.5,
        (1, 4),
        1024,
        64,
        512,
        1.0,
        (4096, 8 << 20, 0.5),
        1,
        3,
        0.0,
        1,
        (4, 256, 0.5),
        0,
        (1, 2, 4, 8),
        (1, 2, 4),
    ),
    # cpu: the small expert points (5-50 ms) are the noisy ones on a shared machine and cost
    # little, so a visit repeats them and 24 more rounds visit them (33 visits in all, about a
    # minute and a half more at tiny's shapes); the large ones (0.1-1.3 s) are called once a
    # visit, 9 rounds (with 7 rounds and 16 more, the held-out expert points missed by up to
    # 16-19% at tiny's shapes, a noisy point of either kind the worst)
    "cpu": _Preset(
        4096,
        2.0,
        (1, 2, 4, 8),
        4096,
        128,
        2048,
        2.0,
        (4096, 64 << 20, 2.0),
        1,
        9,
        0.1,
        5,
        (4, 1024, 1.0),
        24,
        (1, 2, 4, 8, 16, 32),
        (1, 2, 3, 4, 6, 8),
    ),
    "cuda": _Preset(
        8192,
        2.0,
        (1, 2, 4, 8, 16, 32),
        1 << 17,
        128,
        32768,
        2.0,
        (4096, 256 << 20, 2.0),
        2,
        7,
        0.01,
        10,
        (16, 16384, 1.0),
        0,
        (1, 2, 4, 8, 16, 32),
        (1, 2, 3, 4, 6, 8),
    ),
}


@dataclass(frozen=True)
class Sweeps:
    """Sweep points and timer settings.

    * ``tokens_per_expert`` × ``active_experts``: the expert-GEMM grid (points with more than
      ``max_tokens`` tokens in all are skipped, so the large corner does not dominate).
    * ``lengths``: sample lengths of the attention sweep.
    * ``message_bytes``: bytes each rank sends in a point-to-point or all-to-all.
    * ``exchange_tokens``: tokens each rank routes through the MoE layer of the ``exchange``
      sweep (`routepack.calibrate.exchange`; default: the CPU preset's).
    * ``migration_moves``: experts two ranks swap at each point of the ``migration`` sweep
      (`routepack.calibrate.migration`; default: the CPU preset's).
    * ``replication_copies``: replica copies each of two ranks sends the other at each point
      of the ``replication`` sweep (`routepack.calibrate.replication`; default: the CPU
      preset's).
    * ``warmup`` untimed and ``repeats`` timed rounds over each sweep, every point visited
      once a round and called ``visit_calls`` times at most in a visit, as many as fill
      ``visit_s`` seconds (`routepack.calibrate.timing.run_rounds`: the median visit, each
      round's drift divided out, is kept).
    * ``short_repeats`` more timed rounds visit only the short points, those called more than
      once a visit (a call shorter than ``visit_s``): on a shared CPU they are the noisy ones,
      and they cost little.
    * ``holdout_every``: every k-th point of each sweep is held out of the fit and only
      predicted (`routepack.calibrate.fit.holdout_mask`).
    """

    tokens_per_expert: Tuple[int, ...]
    active_experts: Tuple[int, ...]
    max_tokens: int
    lengths: Tuple[int, ...]
    message_bytes: Tuple[int, ...]
    warmup: int = 1
    repeats: int = 5
    holdout_every: int = 3
    visit_s: float = 0.0
    visit_calls: int = 1
    exchange_tokens: Tuple[int, ...] = field(default_factory=lambda: log_points(*_PRESETS["cpu"].exchange_tokens))
    short_repeats: int = 0
    migration_moves: Tuple[int, ...] = _PRESETS["cpu"].migration_moves
    replication_copies: Tuple[int, ...] = _PRESETS["cpu"].replication_copies

    def __post_init__(self) -> None:
        for name in (
            "tokens_per_expert",
            "active_experts",
            "lengths",
            "message_bytes",
            "exchange_tokens",
            "migration_moves",
            "replication_copies",
        ):
            object.__setattr__(self, name, _ints(getattr(self, name), f"sweeps.{name}"))
        positive_int(self.max_tokens, "sweeps.max_tokens")
        positive_int(self.warmup, "sweeps.warmup", minimum=0)
        positive_int(self.repeats, "sweeps.repeats")
        positive_int(self.holdout_every, "sweeps.holdout_every", minimum=2)
        object.__setattr__(self, "visit_s", finite_float(self.visit_s, "sweeps.visit_s", minimum=0.0))
        positive_int(self.visit_calls, "sweeps.visit_calls")
        positive_int(self.short_repeats, "sweeps.short_repeats", minimum=0)
        if not self.expert_grid():
            raise RoutepackError(
                f"sweeps.max_tokens: {self.max_tokens} leaves no expert-GEMM point "
                f"(smallest is {self.tokens_per_expert[0] * self.active_experts[0]} tokens)"
            )

    def expert_grid(self) -> Tuple[Tuple[int, int], ...]:
        """(active experts, tokens per expert) points, grouped by active experts."""
        return tuple((a, t) for a in self.active_experts for t in self.tokens_per_expert if a * t <= self.max_tokens)

    @property
    def points(self) -> int:
        """Measurement points of the expert GEMM and attention sweeps (for the progress bar)."""
        return len(self.expert_grid()) + len(self.lengths)

    @classmethod
    def default(
        cls,
        device: str = "cpu",
        quick: bool = False,
        max_tokens_per_expert: Optional[int] = None,
        max_length: Optional[int] = None,
    ) -> "Sweeps":
        """The sweeps for ``device`` ("cpu" or "cuda"); ``max_tokens_per_expert`` and
        ``max_length`` shorten (or lengthen) the expert-GEMM and attention ranges."""
        if device not in ("cpu", "cuda"):
            raise RoutepackError(f"device: expected 'cpu' or 'cuda', got {device!r}")
        pre = _PRESETS["quick" if quick else device]
        tpe, length, lo_len = pre.tokens_per_expert, pre.length, pre.shortest
        tpe = positive_int(max_tokens_per_expert, "max_tokens_per_expert") if max_tokens_per_expert else tpe
        length = positive_int(max_length, "max_length") if max_length else length
        lo_len = min(lo_len, length)
        return cls(
            tokens_per_expert=log_points(1, tpe, pre.per_octave),
            active_experts=pre.active,
            max_tokens=max(pre.max_tokens, tpe),
            lengths=log_points(lo_len, length, pre.per_octave_length),
            message_bytes=log_points(*pre.messages),
            warmup=pre.warmup,
            repeats=pre.repeats,
            visit_s=pre.visit_s,
            visit_calls=pre.visit_calls,
            exchange_tokens=log_points(*pre.exchange_tokens),
            short_repeats=pre.short_repeats,
            migration_moves=pre.migration_moves,
            replication_copies=pre.replication_copies,
        )

    def with_timer(
        self, warmup: Optional[int] = None, repeats: Optional[int] = None, holdout_every: Optional[int] = None
    ) -> "Sweeps":
        """These sweeps with some timer settings replaced (None keeps one)."""
        return replace(
            self,
            warmup=self.warmup if warmup is None else warmup,
            repeats=self.repeats if repeats is None else repeats,
            holdout_every=self.holdout_every if holdout_every is None else holdout_every,
        )
