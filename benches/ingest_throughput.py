"""Routing-replay ingestion: routepack (Rust, parallel over samples) vs a vectorised numpy
bincount reference, for every id dtype. Prints GB/s of routed ids and the speed-up.

    python benches/ingest_throughput.py [--tokens 262144] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import routepack as rp


def numpy_reference(routed: np.ndarray, cu: np.ndarray, num_experts: int) -> np.ndarray:
    """One global bincount over (sample, layer, expert) keys: the fastest plain-numpy way."""
    t, l, k = routed.shape
    s = len(cu) - 1
    sample = np.repeat(np.arange(s, dtype=np.int64), np.diff(cu))
    key = (sample[:, None, None] * l + np.arange(l, dtype=np.int64)[None, :, None]) * num_experts
    key = key + routed.astype(np.int64)
    return np.bincount(key.ravel(), minlength=s * l * num_experts).reshape(s, l, num_experts)


def distinct_top_k(rng: np.random.Generator, tokens: int, layers: int, top_k: int, experts: int) -> np.ndarray:
    """int64 ``[T, L, k]`` ids, k distinct ones per (token, layer), as a router picks them
    (`Window.from_routed_experts` refuses a repeat): a run of k consecutive entries, from a
    random start, of one of 64 random permutations of the experts."""
    perms = np.stack([rng.permutation(experts) for _ in range(64)])
    which = rng.integers(0, 64, size=(tokens, layers, 1))
    start = rng.integers(0, experts, size=(tokens, layers, 1))
    return perms[which, (start + np.arange(top_k)) % experts]


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=256 * 1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    cu = np.linspace(0, a.tokens, a.samples + 1).astype(np.int64)
    print(f"T={a.tokens} tokens, L={a.layers}, k={a.topk}, E={a.experts}, S={a.samples}; best of {a.repeat}")
    print(f"{'dtype':>6} {'MB':>8} {'routepack GB/s':>15} {'numpy GB/s':>11} {'speed-up':>9}")
    ids = distinct_top_k(rng, a.tokens, a.layers, a.topk, a.experts)
    for dtype in (np.uint8, np.int16, np.int32, np.int64):
        routed = ids.astype(dtype)
        w = rp.Window.from_routed_experts(routed, cu, a.experts)
        assert np.array_equal(w.counts, numpy_reference(routed, cu, a.experts))
        t_rp = best_of(lambda: rp.Window.from_routed_experts(routed, cu, a.experts), a.repeat)
        t_np = best_of(lambda: numpy_reference(routed, cu, a.experts), max(1, a.repeat // 2))
        gb = routed.nbytes / 1e9
        print(
            f"{np.dtype(dtype).name:>6} {routed.nbytes / 1e6:>8.1f} {gb / t_rp:>15.2f} {gb / t_np:>11.3f} {t_np / t_rp:>8.1f}x"
        )


if __name__ == "__main__":
    main()
