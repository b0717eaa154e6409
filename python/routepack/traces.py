"""Synthetic routing-replay traces: the built-in profiles of docs/design.md.

`synthetic(profile, windows, seed)` yields successive `Window`s whose realism matters to the
planner:

* long-tailed lengths: responses are lognormal, clipped at the maximum response length, so a
  visible spike of truncated samples sits at the clip;
* GRPO groups: G responses per prompt arrive together, share the prompt's topic and a
  difficulty factor, so their lengths correlate;
* per-layer expert popularity skew (some layers far more skewed than others);
* per-topic expert affinity: each topic strongly prefers a few experts per layer, so hot
  experts differ between samples and between microbatches;
* drift: popularity and the topic mix random-walk from window to window.

Everything is drawn from one `numpy.random.Generator` seeded by `seed`: the same arguments
give the same windows. L, H, I and the topology of the profiles are assumptions (E, k and
the attention ratio follow the public model cards of Ling-3.0-tiny / -flash).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import numpy as np

from routepack._checks import allocating, finite_float, positive_int, sequence
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.model import UNGROUPED, CostModel, Hardware, ModelShape, Topology
from routepack.window import Window, count_dtype


@dataclass(frozen=True)
class Profile:
    """A synthetic workload: model, cluster, cap, window size and the trace's statistics."""

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    expert_ffn: int
    attention: Sequence[str]
    dp: int
    ep: int
    gpus_per_node: int
    slots_per_rank: int
    token_cap: int
    samples: int
    group_size: int  # GRPO responses per prompt
    prompt_median: float
    response_median: float
    max_response: int
    response_sigma: float = 0.75  # lognormal sigma of a response around its prompt's mean
    difficulty_sigma: float = 0.6  # prompt-level spread of the mean response length
    num_topics: int = 16
    layer_skew: tuple = (0.4, 1.4)  # range of the per-layer popularity spread (logit std)
    topic_strength: float = 2.2  # logit boost of a topic's preferred experts
    topic_experts: float = 0.06  # fraction of experts a topic prefers per layer
    sample_noise: float = 0.25  # per-sample logit noise
    drift: float = 0.15  # per-window random-walk std of popularity logits
    topic_drift: float = 0.3  # per-window log-std drift of the topic mix
    #: the model's routing groups (`ModelShape.expert_groups`): 1, the trace draws every
    #: token's experts from all of them (no group-limited routing)
    expert_groups: int = UNGROUPED
    #: pipeline stages and model chunks per stage (`Topology.pp`, `Topology.vpp`): 1, 1 is
    #: no pipeline; the trace does not depend on them
    pp: int = 1
    vpp: int = 1
    #: GPUs per NVLink domain (`Topology.nvlink_domain`): None, a node
    nvlink_domain: Optional[int] = None
    #: the `Hardware` preset the profile's cost model is derived from (`Hardware.<name>()`)
    hardware: str = "h200"
    #: the model's shared experts (`ModelShape.shared_experts`)
    shared_experts: int = 1

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_experts",
            "top_k",
            "hidden",
            "expert_ffn",
            "dp",
            "ep",
            "gpus_per_node",
            "slots_per_rank",
            "token_cap",
            "samples",
            "group_size",
            "max_response",
            "num_topics",
            "pp",
            "vpp",
        ):
            positive_int(getattr(self, name), f"profile.{name}")
        if self.num_experts <= self.top_k:
            # a token's k experts are distinct and each takes at most 0.95/k of its mass
            raise RoutepackError(f"profile.num_experts: {self.num_experts} must exceed top_k = {self.top_k}")
        if self.samples % self.group_size:
            raise RoutepackError(f"profile.samples={self.samples} is not a multiple of group_size={self.group_size}")
        if not isinstance(self.hardware, str) or not callable(getattr(Hardware, self.hardware, None)):
            raise RoutepackError(f"profile.hardware: {self.hardware!r} names no Hardware preset (h200, gb200_nvl72)")
        for name in ("prompt_median", "response_median"):
            finite_float(getattr(self, name), f"profile.{name}", strict=True)
        for name in ("response_sigma", "difficulty_sigma", "topic_strength", "sample_noise", "drift", "topic_drift"):
            finite_float(getattr(self, name), f"profile.{name}")
        if not 0 < finite_float(self.topic_experts, "profile.topic_experts") <= 1:
            raise RoutepackError(f"profile.topic_experts: must be in (0, 1], got {self.topic_experts}")
        skew = sequence(self.layer_skew, "profile.layer_skew", "two numbers")
        if len(skew) != 2:
            raise RoutepackError(f"profile.layer_skew: expected (low, high), got {self.layer_skew!r}")
        lo, hi = (finite_float(v, "profile.layer_skew") for v in skew)
        if lo > hi:
            raise RoutepackError(f"profile.layer_skew: ({lo}, {hi}) is not a range")
        self.model()
        self.topology()

    def model(self) -> ModelShape:
        # ModelShape checks the kinds; a sequence is all it needs (a mapping or a scalar is refused)
        attention = tuple(sequence(self.attention, "profile.attention", "attention kinds"))
        with _as_profile_fields("model"):
            return ModelShape(
                self.num_layers,
                self.num_experts,
                self.top_k,
                self.hidden,
                self.expert_ffn,
                attention,
                shared_experts=self.shared_experts,
                expert_groups=self.expert_groups,
            )

    def topology(self) -> Topology:
        with _as_profile_fields("topo"):
            return Topology(
                self.dp,
                self.ep,
                self.gpus_per_node,
                self.slots_per_rank,
                pp=self.pp,
                vpp=self.vpp,
                nvlink_domain=self.nvlink_domain,
            )

    def cost(self, hardware: Hardware | None = None) -> CostModel:
        """The cost model of the profile's model on ``hardware`` (None: the profile's own preset,
        ``Hardware.<profile.hardware>()``)."""
        # None, not any falsy value, means the default (an empty dict is not a Hardware)
        hw = getattr(Hardware, self.hardware)() if hardware is None else hardware
        return CostModel.from_model(self.model(), hw)


@contextlib.contextmanager
def _as_profile_fields(prefix: str) -> Iterator[None]:
    """Restates an error of the `ModelShape` / `Topology` a profile builds (``model.<field>:``
    / ``topo.<field>:``, or the whole ``topo:``) for the profile's field of the same name (or
    the profile): the caller passed a profile, not a model or a topology."""
    try:
        yield
    except RoutepackError as e:
        head, sep, rest = str(e).partition(":")
        if head == prefix:
            raise type(e)(f"profile{sep}{rest}") from None
        if head.startswith(prefix + "."):
            raise type(e)(f"profile.{head[len(prefix) + 1 :]}{sep}{rest}") from None
        raise


def _pattern(linear: int, full: int, layers: int) -> List[str]:
    unit = ["linear"] * linear + ["full"] * full
    return [unit[i % len(unit)] for i in range(layers)]


PROFILES = {
    # Ling-3.0-tiny-like: 128 experts top-8, 3 linear : 1 full attention; the synthetic
    # traces route without expert groups (expert_groups=1), so EPLB runs its global policy
    "tiny": Profile(
        name="tiny",
        num_layers=20,
        num_experts=128,
        top_k=8,
        hidden=2048,
        expert_ffn=512,
        attention=tuple(_pattern(3, 1, 20)),
        dp=16,
        ep=8,
        gpus_per_node=8,
        slots_per_rank=17,
        token_cap=32768,
        samples=1024,
        group_size=8,
        prompt_median=600.0,
        response_median=2500.0,
        max_response=16384,
        expert_groups=1,
    ),
    # Ling-3.0-flash-like: 512 experts top-8, 5 linear : 1 full attention
    "flash": Profile(
        name="flash",
        num_layers=32,
        num_experts=512,
        top_k=8,
        hidden=4096,
        expert_ffn=1024,
        attention=tuple(_pattern(5, 1, 32)),
        dp=64,
        ep=32,
        gpus_per_node=8,
        slots_per_rank=17,
        token_cap=65536,
        samples=4096,
        group_size=16,
        prompt_median=800.0,
        response_median=4000.0,
        max_response=32768,
        expert_groups=1,
    ),
}
# Ling-3.0-flash-like under a pipeline: flash's model, trace and EP groups, each DP rank a
# pipeline of 4 stages with 2 model chunks each (interleaved 1F1B, 4 MoE layers a chunk; 256 GPUs)
PROFILES["flash_pp"] = dataclasses.replace(PROFILES["flash"], name="flash_pp", pp=4, vpp=2)


def profile(name: str | Profile) -> Profile:
    """The built-in profile called `name` ("tiny" or "flash"); another raises naming the
    profile asked for (``profile: unknown profile 'huge'``, as `routepack.calibrate` and the
    CLI, whose argument is the profile, report it too)."""
    return _profile(name, "profile")


def _profile(value: str | Profile, arg: str) -> Profile:
    """`profile` of ``value``, its errors naming the caller's argument ``arg``."""
    if isinstance(value, Profile):
        return value
    if not isinstance(value, str):
        raise RoutepackTypeError(f"{arg}: expected a profile name or a Profile, got {type(value).__name__} {value!r}")
    if value not in PROFILES:
        raise RoutepackError(f"{arg}: unknown profile {value!r}; known: {sorted(PROFILES)}")
    return PROFILES[value]


def _cap_probs(p: np.ndarray, limit: float) -> np.ndarray:
    """Rows of p capped at `limit` with the excess spread over the others in proportion to
    their mass (exact water-filling), so no expert expects more than one assignment per token:
    a token's k experts are distinct. Needs limit * E >= 1.

    With the top j entries capped, the rest scale by f_j = (1 - j·limit) / (mass below the
    top j); the answer is min(p·f_j, limit) for the smallest j whose next entry fits
    (j = floor(1/limit) always does). Probabilities that underflowed to 0 get the smallest
    positive float, so they can take excess too."""
    p = np.maximum(p, np.finfo(p.dtype).tiny)
    p = p / p.sum(axis=-1, keepdims=True)
    jmax = min(p.shape[-1] - 1, int(np.floor(1.0 / limit)))
    part = -np.partition(-p, jmax, axis=-1)
    top = -np.sort(-part[..., : jmax + 1], axis=-1)  # the jmax+1 largest, descending
    rest = part[..., jmax + 1 :].sum(axis=-1, keepdims=True)  # everything below them
    below = rest + np.cumsum(top[..., ::-1], axis=-1)[..., ::-1]  # mass from entry j down
    factor = (1.0 - np.arange(jmax + 1) * limit) / below
    j = np.argmax(top * factor <= limit, axis=-1)[..., None]
    return np.minimum(p * np.take_along_axis(factor, j, axis=-1), limit)


def _route_counts(rng: np.random.Generator, n: np.ndarray, k: int, probs: np.ndarray) -> np.ndarray:
    """Counts [S, E] with row sums exactly k·n_s and every entry <= n_s.

    Each expert gets the integer part of its expectation k·n_s·p, and the fractional parts are
    resolved by systematic sampling (one uniform offset per row), so every expert receives at
    most one extra token and the expectation is exact. Per-sample variation comes from the
    logit noise; this keeps generation O(S·E) vector operations (``flash`` in a few seconds).
    Because p <= 0.95/k, k·n·p <= 0.95·n and the +1 never exceeds n.
    """
    expected = probs * (n * k)[:, None].astype(np.float64)
    base = np.floor(expected)
    need = n * k - base.sum(axis=1).astype(np.int64)  # tokens still to place per row (< E)
    resid = expected - base
    total = resid.sum(axis=1, keepdims=True)
    resid = np.divide(resid * need[:, None], total, out=np.zeros_like(resid), where=total > 0)
    cum = np.cumsum(resid, axis=1)
    u = rng.random((n.shape[0], 1))
    marks = np.floor(cum + u)
    extra = np.diff(marks, axis=1, prepend=np.floor(u))
    counts = base.astype(np.int64) + extra.astype(np.int64)
    # floating error can leave a row one token off: settle it on the row's likeliest expert
    diff = n * k - counts.sum(axis=1)
    if diff.any():
        rows = np.flatnonzero(diff)
        counts[rows, np.argmax(probs[rows], axis=1)] += diff[rows]
    return counts


def draw_lengths(prof: Profile, rng: np.random.Generator, response_sigma: Optional[float] = None) -> np.ndarray:
    """int64 ``[S]`` sample lengths of one window of ``prof``, drawn from ``rng``: GRPO groups
    of ``group_size`` responses per prompt (prompt lognormal around ``prompt_median``; each
    prompt a difficulty that shifts its responses' lognormal mean, so a group's lengths
    correlate), responses clipped at ``max_response`` (the truncation spike), samples at the
    cap. ``response_sigma`` overrides the profile's spread of a response around its prompt's."""
    G = prof.group_size
    prompts = prof.samples // G
    prompt_len = np.clip(
        np.round(rng.lognormal(np.log(prof.prompt_median), 0.5, size=prompts)), 16, prof.max_response // 4
    ).astype(np.int64)
    difficulty = rng.normal(0.0, prof.difficulty_sigma, size=prompts)
    mu = np.log(prof.response_median) + difficulty
    sigma = prof.response_sigma if response_sigma is None else response_sigma
    resp = rng.lognormal(np.repeat(mu, G), sigma)
    resp = np.clip(np.round(resp), 1, prof.max_response).astype(np.int64)  # the truncation spike
    return np.minimum(np.repeat(prompt_len, G) + resp, prof.token_cap)


def synthetic(profile_name: str | Profile, windows: int = 1, seed: int = 0) -> Iterator[Window]:
    """Yields `windows` successive windows of the profile, deterministically for `seed`."""
    prof = _profile(profile_name, "profile_name")
    windows = positive_int(windows, "windows")
    seed = positive_int(seed, "seed", minimum=0)
    S, L, E = prof.samples, prof.num_layers, prof.num_experts
    if S % prof.group_size:
        raise RoutepackError(f"profile.samples={S} is not a multiple of group_size={prof.group_size}")
    # the profile's sizes are the caller's: a window it cannot hold is refused naming it
    # (the counts, and a layer's float64 draws a few times over)
    with allocating("profile_name", f"generating windows of {S} x {L} x {E} counts", S * L * E + 8 * S * E * 8):
        yield from _windows(prof, windows, seed)


def _windows(prof: Profile, windows: int, seed: int) -> Iterator[Window]:
    """`synthetic`'s windows of the checked profile ``prof``."""
    rng = np.random.default_rng(seed)
    L, E, k, T = prof.num_layers, prof.num_experts, prof.top_k, prof.num_topics
    S, G = prof.samples, prof.group_size

    # popularity: per-layer logits with a per-layer spread (skew differs between layers)
    lo, hi = prof.layer_skew
    spread = rng.uniform(lo, hi, size=(L, 1))
    base = rng.standard_normal((L, E)) * spread
    # topic affinity: each topic boosts a few experts per layer
    n_pref = max(1, int(round(prof.topic_experts * E)))
    affinity = np.zeros((T, L, E))
    for t in range(T):
        for l in range(L):
            affinity[t, l, rng.choice(E, size=n_pref, replace=False)] = prof.topic_strength * rng.uniform(0.5, 1.0)
    topic_logits = rng.standard_normal(T) * 0.5
    limit = 0.95 / k

    for _ in range(windows):
        prompts = S // G
        topic_p = np.exp(topic_logits - topic_logits.max())
        topic_p /= topic_p.sum()
        topic = rng.choice(T, size=prompts, p=topic_p)
        seq_lens = draw_lengths(prof, rng)
        sample_topic = np.repeat(topic, G)

        # no count exceeds its sample's length: the dtype holding the longest one holds them
        # all (the window narrows further when its counts allow), never a dense int32 array
        expert_tokens = np.empty((S, L, E), dtype=count_dtype(int(seq_lens.max())))
        noise_scale = prof.sample_noise
        for l in range(L):
            logits = base[l][None, :] + affinity[sample_topic, l, :]
            logits = logits + rng.standard_normal((S, E)) * noise_scale
            logits -= logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            p = _cap_probs(p, limit)
            expert_tokens[:, l, :] = _route_counts(rng, seq_lens, k, p)
        yield Window(seq_lens, expert_tokens)

        # drift between windows
        base = base + rng.standard_normal((L, E)) * prof.drift
        topic_logits = topic_logits + rng.standard_normal(T) * prof.topic_drift


__all__ = ["Profile", "PROFILES", "draw_lengths", "profile", "synthetic"]
