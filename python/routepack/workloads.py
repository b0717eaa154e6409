"""Megatron-Core's token-imbalance workloads W0-W7 (Megatron-LM issue 6757, PR 7488) as windows of
a profile: ``routepack bench --workload W3``.

Each workload is a rule for every token's top-k experts, from (workload, seed, step) alone, so
the same logical workload exists at any EP layout, and every token routes to exactly k distinct
experts. The rules are PR 7488's ``routing_for_step`` (``benchmarks/moe/token_imbalance``), with
``hotwidth = max(k, E // 4)`` and a token's index t:

=====  ======================  =====================================================================
id     name                    a token's k experts are drawn uniformly, without replacement, from
=====  ======================  =====================================================================
W0     balanced                round robin: t·k, t·k + 1, ... (mod E): every expert equally loaded
W1     hot_expert_set          experts 0..hotwidth-1 when t % 4 != 0, else all E
W2     hot_rank                the same as W1 (the PR defines the hot block from global ids, so
                               which ranks own it is the layout's business; its seed differs)
W3     spread_hot_experts      the even experts 0, 2, 4, ... when t % 4 != 0, else all E
W4     source_ragged           all E (balanced destinations); the PR's pre-dispatch skew is in the
                               sources: here the samples' responses spread twice as wide
                               (``response_sigma`` ×2), so ranks' token counts are ragged
W5     zero_expert_rank        experts E/2..E-1: half the experts, and the ranks owning them, idle
W6     rotating_hotspot        a hot block of hotwidth experts starting at ((step // 3)·hotwidth)
                               mod E when t % 4 != 0, else all E: the hotspot moves every 3 steps
W7     burst                   all E, except at steps with step % 4 == 3, where the even tokens draw
                               from experts 0..hotwidth-1: 3 steady steps, a burst, recovery
=====  ======================  =====================================================================

What this module adds to the PR's rules, as assumptions: the PR routes one layer of one batch;
here a window is a profile's samples (its GRPO groups and long-tailed lengths), its step is the
window's index, every MoE layer follows the rule (each layer drawing its own tokens), and a
sample's token index t runs over the sample. A sample's counts are the expected counts of its
tokens (per expert: its tokens drawing from a pool that holds the expert × k / the pool's size),
rounded by systematic sampling so every row holds exactly n·k assignments and no count exceeds
n (`traces._route_counts`); the PR draws each token with ``torch.randperm``, the aggregate over a
sample of thousands of tokens is the same to within sampling noise. Seeds: SHA-256 of
``"{workload}|{seed}|{step}"``, as the PR seeds its generator (lengths from the profile's own
stream, `traces.draw_lengths`, seeded likewise with ``"lengths"``).
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterator, List, Tuple

import numpy as np

from routepack._checks import allocating, positive_int
from routepack.errors import RoutepackError, RoutepackTypeError
from routepack.traces import Profile, _profile, _route_counts, draw_lengths
from routepack.window import Window, count_dtype

#: The workloads, by short id, with the PR's names.
WORKLOADS: Dict[str, str] = {
    "W0": "W0_balanced",
    "W1": "W1_hot_expert_set",
    "W2": "W2_hot_rank",
    "W3": "W3_spread_hot_experts",
    "W4": "W4_source_ragged",
    "W5": "W5_zero_expert_rank",
    "W6": "W6_rotating_hotspot",
    "W7": "W7_burst",
}


def workload_id(name: str) -> str:
    """``"W3"`` for ``"W3"``, ``"w3"`` or ``"W3_spread_hot_experts"``; else `RoutepackError`
    naming ``workload`` and the known ids."""
    if not isinstance(name, str):
        raise RoutepackTypeError(f"workload: expected a str such as 'W3', got {type(name).__name__} {name!r}")
    short = name.split("_", 1)[0].upper()
    if short not in WORKLOADS or (name.upper() != short and name != WORKLOADS[short]):
        raise RoutepackError(f"workload: unknown workload {name!r}; known: {sorted(WORKLOADS)} (or their PR names)")
    return short


def _generator(*key: object) -> np.random.Generator:
    """A generator seeded as PR 7488 seeds its own: the first 8 hex digits of SHA-256 of the
    key's parts joined by '|'."""
    digest = hashlib.sha256("|".join(str(k) for k in key).encode()).hexdigest()
    return np.random.default_rng(int(digest[:8], 16))


def pools(workload: str, num_experts: int, top_k: int, step: int) -> List[Tuple[float, np.ndarray]]:
    """The workload's pools at ``step``: (fraction of a sample's tokens, the experts they draw
    k distinct from), fractions summing to 1. W0 is round robin: one pool of all E."""
    w = workload_id(workload)
    E, k = int(num_experts), int(top_k)
    everyone = np.arange(E)
    hotwidth = max(k, E // 4)
    hot = np.arange(hotwidth) % E
    if w in ("W0", "W4"):
        return [(1.0, everyone)]
    if w in ("W1", "W2"):
        return [(0.75, hot), (0.25, everyone)]
    if w == "W3":
        spread = np.unique((2 * np.arange(max(k, E // 2))) % E)
        return [(0.75, spread if len(spread) >= k else everyone), (0.25, everyone)]
    if w == "W5":
        live = np.arange(E // 2, E)
        return [(1.0, live if len(live) >= k else everyone)]
    if w == "W6":
        base = ((step // 3) * hotwidth) % E
        return [(0.75, (base + np.arange(hotwidth)) % E), (0.25, everyone)]
    # W7: a burst every fourth step, half the tokens from the hot block
    if step % 4 == 3:
        return [(0.5, hot), (0.5, everyone)]
    return [(1.0, everyone)]


def _expected(n: np.ndarray, k: int, num_experts: int, parts: List[Tuple[float, np.ndarray]]) -> np.ndarray:
    """float64 ``[S, E]``: each expert's expected share of a sample's n·k assignments."""
    p = np.zeros(num_experts)
    for frac, pool in parts:
        p[pool] += frac / len(pool)
    return np.broadcast_to(p, (len(n), num_experts))


def windows(profile_name: str | Profile, workload: str, count: int = 1, seed: int = 0) -> Iterator[Window]:
    """``count`` successive windows (steps 0, 1, ...) of ``workload`` on the profile's model
    and samples, deterministically for ``seed``."""
    prof = _profile(profile_name, "profile_name")
    w = workload_id(workload)
    count = positive_int(count, "windows")
    seed = positive_int(seed, "seed", minimum=0)
    S, L, E, k = prof.samples, prof.num_layers, prof.num_experts, prof.top_k
    with allocating("profile_name", f"generating windows of {S} x {L} x {E} counts", S * L * E + 8 * S * E * 8):
        for step in range(count):
            sigma = 2 * prof.response_sigma if w == "W4" else None
            seq_lens = draw_lengths(prof, _generator(WORKLOADS[w], seed, step, "lengths"), sigma)
            rng = _generator(WORKLOADS[w], seed, step)
            counts = np.empty((S, L, E), dtype=count_dtype(int(seq_lens.max())))
            parts = pools(w, E, k, step)
            for layer in range(L):
                if w == "W0":
                    counts[:, layer, :] = _round_robin(seq_lens, k, E, layer)
                else:
                    counts[:, layer, :] = _route_counts(rng, seq_lens, k, _expected(seq_lens, k, E, parts))
            yield Window(seq_lens, counts, top_k=k)


def _round_robin(n: np.ndarray, k: int, num_experts: int, layer: int) -> np.ndarray:
    """W0's counts ``[S, E]``: token t of the window (samples in order) routes to experts
    t·k .. t·k + k − 1 (mod E), exactly as the PR's round robin; each sample's n·k consecutive
    assignments cover the experts evenly, the remainder starting where the previous sample's
    ended."""
    del layer  # every layer routes alike: the PR's rule has no randomness to vary
    E = num_experts
    start = (np.concatenate([[0], np.cumsum(n)[:-1]]) * k) % E
    total = n * k
    counts = np.repeat((total // E)[:, None], E, axis=1)
    rem = total % E
    # the remainder: rem consecutive experts from the sample's start (mod E)
    offset = (np.arange(E)[None, :] - start[:, None]) % E
    counts += (offset < rem[:, None]).astype(counts.dtype)
    return counts


__all__ = ["WORKLOADS", "pools", "windows", "workload_id"]
