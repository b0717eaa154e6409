"""Targets of `routepack.window` and `routepack.replay`: `Window`, its routing-replay
constructors (flat, verl, slime) and its files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, List

import numpy as np
import routepack as rp
from routepack import replay

from test_window_fuzz import routed_inputs, window_inputs
from fuzzlib.engine import Case, Target, both, hyp_gen, mixed
from fuzzlib.inputs import SAME_VALUES, bad_for, mutate_array, pick
from fuzzlib.checks import check_window
from fuzzlib.files import file_load_case, other_type_case
from fuzzlib.t_model import tmp_path
from fuzzlib.valid import consistent_window


# ------------------------------------------------------------------ Window
def window_hyp_case(x: Any) -> Case:
    seq, tokens, top_k = x
    return Case("malformed", rp.Window, (seq, tokens, top_k), check=lambda w: check_window(w, seq, tokens))


def window_rng_case(rng: np.random.Generator) -> Case:
    w = consistent_window(rng)
    seq, tokens = w.seq_lens.copy(), w.expert_tokens.copy()
    r = rng.random()
    kind, note, expect = "valid", "", "ok"
    if r < 0.2:
        kind = "edge"
        choice = int(rng.integers(5))
        if choice == 0:  # no expert tokens at all
            tokens[:] = 0
            note = "all counts zero"
        elif choice == 1:  # one sample, one layer, one expert
            seq, tokens = seq[:1], tokens[:1, :1, :1]
            note = "S = L = E = 1"
        elif choice == 2:  # long samples: counts up to int32's max
            seq = np.full_like(seq, 2**31 - 1)
            tokens = np.minimum(tokens.astype(np.int64) * 2**24, 2**31 - 1).astype(np.int32)
            note = "lengths 2**31 - 1"
        elif choice == 3:  # lengths whose sum overflows int64
            seq = np.full_like(seq, 2**61)
            note = "lengths 2**61 (their sum passes 2**63)"
            expect = None
        else:
            seq = seq.astype(np.uint16) if seq.max() < 2**16 else seq
            tokens = tokens.astype(np.uint8) if tokens.max() < 256 else tokens
            note = "small unsigned dtypes"
    elif r < 0.45:
        label, mutated = mutate_array(rng, tokens, only_same=True)
        kind, note, tokens = "edge", f"expert_tokens {label}", mutated
        if label == "list":
            expect = None
    elif r < 0.55:
        kind, note, expect = "malformed", "a count above its sample's length", "error"
        s, l, e = (int(rng.integers(n)) for n in tokens.shape)
        tokens[s, l, e] = int(seq[s]) + int(rng.integers(1, 10**6))
    elif r < 0.85:
        kind, expect = "malformed", None
        which = "expert_tokens" if rng.random() < 0.5 else "seq_lens"
        if which == "expert_tokens":
            label, tokens = mutate_array(rng, tokens)
        else:
            label, seq = mutate_array(rng, seq)
        note = f"{which} {label}"
        if label in SAME_VALUES and label != "list":
            kind, expect = "edge", "ok"
    else:
        kind, expect = "malformed", "error"
        if rng.random() < 0.5:
            seq = bad_for(rng, 1)
        else:
            tokens = pick(rng, [None, "x", {}, 3, [[[1]]] * 0, [1, 2], {"a": np.zeros((1, 1, 1))}])
        note = "not an array"
    return Case(kind, rp.Window, (seq, tokens), check=lambda w: check_window(w, seq, tokens), expect=expect, note=note)


# ------------------------------------------------------------------ from_routed_experts
def check_routed(routed: Any, cu: Any, E: Any, plus: int = 0):
    def check(w: Any) -> None:
        r = np.asarray(routed).astype(np.int64)
        c = np.asarray(cu).astype(np.int64)
        check_window(w, np.diff(c) + plus, None)
        assert w.expert_tokens.shape == (len(c) - 1, r.shape[1], int(E)), "shape"
        for s in range(len(c) - 1):
            part = r[c[s] : c[s + 1]]
            for l in range(r.shape[1]):
                ref = np.bincount(part[:, l].ravel(), minlength=int(E))
                assert np.array_equal(w.expert_tokens[s, l], ref), f"counts of sample {s}, layer {l} differ"
            srt = np.sort(part, axis=2)
            dup = (srt[..., 1:] == srt[..., :-1]).any() if part.shape[2] > 1 else False
            assert not dup, f"accepted a token routed twice to one expert (sample {s})"

    return check


def routed_ids(rng: np.random.Generator, T: int, L: int, k: int, E: int) -> np.ndarray:
    """Distinct top-k ids per token (what a router gives)."""
    keys = rng.random((T, L, E))
    return np.argsort(keys, axis=2)[..., :k]


def routed_rng_case(rng: np.random.Generator) -> Case:
    S = int(rng.integers(1, 10))
    lens = rng.integers(1, 12, size=S)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    L, E = int(rng.integers(1, 4)), int(rng.choice([1, 2, 8, 64, 256]))
    k = int(rng.integers(1, min(E, 8) + 1))
    dtype = np.uint8 if E <= 256 and rng.random() < 0.5 else rng.choice([np.int16, np.int32, np.int64])
    routed = routed_ids(rng, int(cu[-1]), L, k, E).astype(dtype)
    kind, note, expect = "valid", "", "ok"
    r = rng.random()
    if r < 0.3:
        label, routed = mutate_array(rng, routed, only_same=True)
        kind, note = "edge", f"routed {label}"
        expect = "ok" if label not in ("list", "int64", "uint64") else None
    elif r < 0.45 and k >= 2:
        kind, note, expect = "malformed", "a token with a duplicated top-k id", "error"
        t = int(rng.integers(routed.shape[0]))
        routed[t, 0, 1] = routed[t, 0, 0]
    elif r < 0.7:
        kind, expect = "malformed", None
        if rng.random() < 0.5:
            note, routed = mutate_array(rng, routed)
            note = "routed " + note
        else:
            note, cu = mutate_array(rng, cu)
            note = "cu_seqlens " + note
    elif r < 0.85:
        kind, expect = "malformed", "error"
        E = pick(rng, [0, -1, 1.5, None, "8", True, 2**64, 2**31, np.float64(8.0)])
        note = "num_experts"
        if E == 2**31:
            kind, expect = "absurd", None
    else:
        kind, expect = "malformed", "error"
        cu = cu.copy()
        cu[int(rng.integers(len(cu)))] += int(rng.choice([-1, 1, 1000]))
        note = "cu_seqlens not matching routed"
        if cu[0] == 0 and cu[-1] == routed.shape[0] and (np.diff(cu) > 0).all():
            expect = None
    return Case(
        kind,
        rp.Window.from_routed_experts,
        (routed, cu, E),
        check=check_routed(routed, cu, E),
        expect=expect,
        note=note,
    )


def routed_hyp_case(x: Any) -> Case:
    routed, cu, E = x
    return Case("malformed", rp.Window.from_routed_experts, (routed, cu, E), check=check_routed(routed, cu, E))


# ------------------------------------------------------------------ verl, slime
def verl_case(fn: Any):
    def make(rng: np.random.Generator) -> Case:
        B, T, L = int(rng.integers(1, 6)), int(rng.integers(1, 12)), int(rng.integers(1, 3))
        E = int(rng.choice([2, 8, 16]))
        k = int(rng.integers(1, min(E, 4) + 1))
        routed = routed_ids(rng, B * T, L, k, E).reshape(B, T, L, k).astype(rng.choice([np.uint8, np.int32]))
        mask = (rng.random((B, T)) < 0.7).astype(rng.choice([np.int64, np.bool_, np.uint8]))
        mask[np.arange(B), rng.integers(0, T, size=B)] = 1
        kind, note, expect = "valid", "", "ok"
        r = rng.random()
        args: List[Any] = [routed, mask, E]
        if r < 0.2:
            kind, note = "edge", "left padding"
            m = np.zeros((B, T), dtype=np.int64)
            for b in range(B):
                m[b, int(rng.integers(T)) :] = 1
            args[1] = m
        elif r < 0.6:
            kind, expect = "malformed", None
            i = int(rng.integers(3))
            if i == 2:
                args[2] = pick(rng, [0, -1, 1.5, None, "8", True])
                expect = "error"
                note = "num_experts"
            else:
                note, args[i] = mutate_array(rng, args[i])
                note = ("routed_experts " if i == 0 else "attention_mask ") + note
        elif r < 0.8:
            kind, expect = "malformed", "error"
            m = mask.astype(np.int64)
            choice = int(rng.integers(3))
            if choice == 0:
                m[0] = 0
                note = "a row with no real tokens"
            elif choice == 1:
                m[0, 0] = 2
                note = "a mask entry of 2"
            else:
                m = m[:, :-1] if T > 1 else m[:0]
                note = "mask shape differs"
            args[1] = m
        else:
            kind, note, expect = "malformed", "a token with a duplicated top-k id", "error" if k >= 2 else "ok"
            if k >= 2:
                b = 0
                t = int(np.flatnonzero(mask[0])[0])
                routed = routed.copy()
                routed[b, t, 0, 1] = routed[b, t, 0, 0]
                args[0] = routed

        def check(w: Any) -> None:
            rr, mm = np.asarray(args[0]), np.asarray(args[1]).astype(bool)
            flat = rr[mm]
            cu = np.concatenate([[0], np.cumsum(mm.sum(axis=1))])
            check_routed(flat, cu, args[2])(w)

        return Case(kind, fn, tuple(args), check=check, expect=expect, note=note)

    return make


def slime_case(fn: Any):
    def make(rng: np.random.Generator) -> Case:
        S, L, E = int(rng.integers(1, 6)), int(rng.integers(1, 3)), int(rng.choice([2, 8, 32]))
        k = int(rng.integers(1, min(E, 4) + 1))
        dtype = rng.choice([np.uint8, np.int16, np.int32, np.int64])
        per = [routed_ids(rng, int(rng.integers(1, 9)), L, k, E).astype(dtype) for _ in range(S)]
        add: Any = bool(rng.random() < 0.7)
        kind, note, expect = "valid", "", "ok"
        r = rng.random()
        seq: Any = per
        if r < 0.15:
            kind, note = "edge", "a tuple / a generator of arrays"
            seq = tuple(per) if rng.random() < 0.5 else (a for a in per)
            expect = "ok"
        elif r < 0.5:
            kind, expect = "malformed", None
            i = int(rng.integers(S))
            label, per[i] = mutate_array(rng, per[i])
            note = f"per_sample[{i}] {label}"
        elif r < 0.7:
            kind, expect = "malformed", "error"
            seq = pick(rng, [[], None, {}, {0: per[0]}, "abc", per[0], 3])
            note = "per_sample not a list of arrays"
        elif r < 0.85:
            kind, expect, note = "malformed", "error", "add_last_token not a bool"
            add = pick(rng, ["yes", "", 1, 0, None, 2.5, [True]])
        else:
            kind, expect, note = "malformed", "error", "num_experts"
            E = pick(rng, [0, -1, 1.5, None, "8", True, 2**64])
        items = per  # what the check counts (seq is per, a tuple or a generator of it, or junk)
        call_seq = seq

        def check(w: Any) -> None:
            arrs = [np.asarray(a) for a in items]
            cu = np.concatenate([[0], np.cumsum([a.shape[0] for a in arrs])])
            check_routed(np.concatenate(arrs), cu, E, plus=int(bool(add)))(w)

        return Case(kind, fn, (call_seq, E), {"add_last_token": add}, check=check, expect=expect, note=note)

    return make


# ------------------------------------------------------------------ files
def window_save_case(rng: np.random.Generator) -> Case:
    w = consistent_window(rng)
    r = rng.random()
    if r < 0.6:
        target: Any = tmp_path("win") if rng.random() < 0.6 else Path(tmp_path("win"))
        if rng.random() < 0.3:
            target = io.BytesIO()

        def check(_: Any) -> None:
            src = target
            if isinstance(src, io.BytesIO):
                src.seek(0)
            back = rp.Window.load(src)
            assert back == w, "Window.load(Window.save(w)) != w"

        return Case("valid", w.save, (target,), check=check, expect="ok")
    bad = pick(rng, [None, 3.5, {}, [], 2**40, -1, "", object(), b"\0"])
    return Case("malformed", w.save, (bad,), note="path of a wrong type")


def window_load_gen() -> Any:
    return mixed((9, file_load_case(rp.Window, consistent_window, "win")), (1, other_type_case))


TARGETS = [
    Target(
        "Window",
        rp.Window,
        both(hyp_gen(window_inputs(), window_hyp_case), mixed((1, window_rng_case)), 0.4),
        weight=4,
        names=("window",),
    ),
    Target(
        "Window.from_routed_experts",
        rp.Window.from_routed_experts,
        both(hyp_gen(routed_inputs(), routed_hyp_case), mixed((1, routed_rng_case)), 0.4),
        weight=4,
    ),
    Target("Window.from_verl", rp.Window.from_verl, mixed((1, verl_case(rp.Window.from_verl))), weight=2),
    Target("replay.from_verl", replay.from_verl, mixed((1, verl_case(replay.from_verl))), weight=1),
    Target("Window.from_slime", rp.Window.from_slime, mixed((1, slime_case(rp.Window.from_slime))), weight=2),
    Target("replay.from_slime", replay.from_slime, mixed((1, slime_case(replay.from_slime))), weight=1),
    Target("Window.save", rp.Window.save, mixed((1, window_save_case)), weight=1),
    Target("Window.load", rp.Window.load, window_load_gen(), weight=3, names=("window file",)),
]
