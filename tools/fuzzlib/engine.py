"""Cases, targets, the outcome of one call, and the schedule that orders them.

A `Target` is one public function (or constructor, or method) of routepack with a generator
of `Case` batches. A case is a call with its arguments, its kind (``valid``, ``edge``,
``malformed``, ``tampered``, ``damaged``, ``absurd``), an optional check of the result and an
optional expectation (``ok``: the input is valid, so it must succeed; ``error``: it is
invalid, so it must be refused).

`run_case` classifies one call:

* ``valid``: it returned, the expectation allowed it and the result passed its check;
* ``clean_named`` / ``clean_unnamed``: a `routepack.RoutepackError` (not the internal one)
  whose message does / does not name an argument (`names_argument`);
* ``other``: anything else: another exception (a panic's ``PanicException`` is a
  BaseException and is caught too), `routepack.RoutepackInternalError`, a refused valid
  input, an accepted invalid one, a result that fails its check, or output on stderr /
  stdout during the call (a Rust panic message). A hang or an abort of the interpreter is
  classified by the parent (`fuzz_campaign.py`), which watches the worker process.

Everything a batch holds is a pure function of ``(campaign seed, target, batch number)``
(`batch_seed`), so a campaign runs the same cases in the same order for a seed, and a worker
restarted after a crash resumes at the next case.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import routepack as rp

OUTCOMES = ("valid", "clean_named", "clean_unnamed", "other")
KINDS = ("valid", "edge", "malformed", "tampered", "damaged", "absurd")


class Refused(Exception):
    """Raised by a case's ``setup`` when the library itself refused the tampering (a read-only
    array): the library defended itself, so the case counts as ``valid``."""


@dataclass
class Case:
    """One call. ``setup``, when given, runs first (inside the classification) and returns the
    ``(args, kwargs)`` to call ``fn`` with (files to write, objects to tamper with)."""

    kind: str
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: Dict[str, Any] = field(default_factory=dict)
    check: Optional[Callable[[Any], None]] = None
    expect: Optional[str] = None
    note: str = ""
    names: Tuple[str, ...] = ()
    setup: Optional[Callable[[], Tuple[tuple, Dict[str, Any]]]] = None
    #: a refusal counts as named only when it names one of these (not any identifier of the
    #: target) and matches ``pattern``: what the memory-limit cases ask of a refusal (the
    #: argument that sized the allocation, and the bytes)
    require: Tuple[str, ...] = ()
    pattern: Optional[str] = None


Generator = Callable[[int, int], List[Case]]


@dataclass
class Target:
    """A public callable: its name in the table, the callable whose parameters name its
    arguments, a generator ``gen(seed, n) -> [Case]`` and how many cases a round gives it."""

    name: str
    public: Any
    gen: Generator
    weight: int = 2
    names: Tuple[str, ...] = ()
    batch: int = 32
    #: the stderr of a call is the product's (the CLI prints its errors there)
    stderr_ok: bool = False

    def identifiers(self) -> Tuple[str, ...]:
        cached = self.__dict__.get("_identifiers")
        if cached is not None:
            return cached
        public = self.public
        if isinstance(public, str):  # "module:attribute", imported on first use
            import importlib

            module, _, attr = public.partition(":")
            public = getattr(importlib.import_module(module), attr)
        self.__dict__["_identifiers"] = tuple(dict.fromkeys(signature_names(public) + tuple(self.names)))
        return self.__dict__["_identifiers"]


def signature_names(fn: Any) -> Tuple[str, ...]:
    """Parameter names of ``fn`` (not self/cls, not ``*args``/``**kwargs``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ()
    return tuple(
        p.name
        for p in sig.parameters.values()
        if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )


# ------------------------------------------------------------------ naming an argument
_PATTERNS: Dict[str, "re.Pattern[str]"] = {}


def _pattern(ident: str) -> "re.Pattern[str]":
    pat = _PATTERNS.get(ident)
    if pat is None:
        e = re.escape(ident)
        if re.fullmatch(r"[A-Za-z]+", ident):
            # a plain word (window, plan, seed, topo): only as an identifier, i.e. followed by
            # ':', '.', '[', '=' or quoted, never as an English word inside a sentence
            pat = re.compile(rf"(?<![\w.-]){e}(?=\s*[:\[=]|\.\w)|['`\"]{e}['`\"]")
        else:
            # anything with '_', '.', '[' or '--' is an identifier wherever it stands
            pat = re.compile(rf"(?<![\w-]){e}(?![\w-])")
        _PATTERNS[ident] = pat
    return pat


def names_argument(message: str, identifiers: Iterable[str]) -> bool:
    """True when ``message`` names one of ``identifiers``: a parameter name, a dotted field of
    one (``cost.a_quad``, ``topo.dp``), an option name, a file path, a CLI flag. A plain word
    counts only in identifier position (``window: ...``, ``policy.packing``, ``'seed'``);
    identifiers with ``_``, ``.``, ``[`` or ``--`` count anywhere as a whole word."""
    return any(_pattern(i).search(message) for i in identifiers if i)


# ------------------------------------------------------------------ buckets and reprs
_NUM = re.compile(r"(?<![A-Za-z_])-?(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)")


def normalise(message: str, limit: int = 110) -> str:
    """A message with its numbers as N (so one root cause is one bucket), on one line."""
    s = " ".join(str(message).split())
    # the offending value's type is not the cause: "'dict' object has no attribute", "not list"
    s = re.sub(r"'[\w.]+' object", "'T' object", s)
    s = re.sub(r"instances of '[\w.]+' and '[\w.]+'", "instances of 'T' and 'T'", s)
    s = re.sub(r", not (?:<class '[\w.]+'>|[\w.]+)$", ", not T", s)
    s = re.sub(r"type '[\w.]+'", "type 'T'", s)
    s = _NUM.sub("N", s)
    s = re.sub(r"N(?:[\s,;:]+N)+", "N…", s)
    s = re.sub(r"'/tmp/[^']*'|/tmp/\S+", "PATH", s)
    s = re.sub(r"at 0x[0-9a-f]+", "at ADDR", s)
    return s[:limit]


def where(tb: Any) -> str:
    """``file:line`` of the innermost frame inside the routepack package (else the innermost)."""
    frames = traceback.extract_tb(tb)
    inside = [f for f in frames if f"{os.sep}routepack{os.sep}" in f.filename and "fuzzlib" not in f.filename]
    f = (inside or frames or [None])[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno}" if f is not None else "?"


def assertion_source(e: BaseException) -> str:
    """A bare ``assert``'s own line (its message is empty)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "assertion failed"
    f = frames[-1]
    return f"{(f.line or 'assert').strip()} ({os.path.basename(f.filename)}:{f.lineno})"


def describe(case: Case, limit: int = 1500) -> str:
    """The call as text: ``fn(args, kwargs)  # kind: note`` (arrays abbreviated)."""
    name = getattr(case.fn, "__qualname__", None) or repr(case.fn)
    with np.printoptions(threshold=48, edgeitems=3, linewidth=160):
        parts = [_short(a) for a in case.args] + [f"{k}={_short(v)}" for k, v in case.kwargs.items()]
    text = f"{name}({', '.join(parts)})  # {case.kind}" + (f": {case.note}" if case.note else "")
    return text if len(text) <= limit else text[:limit] + " …"


def _short(v: Any) -> str:
    try:
        r = repr(v)
    except Exception as e:  # noqa: BLE001 (a broken repr is still described)
        r = f"<{type(v).__name__}: repr raised {type(e).__name__}>"
    if isinstance(v, np.ndarray):
        flags = [] if v.flags.c_contiguous else ["non-contiguous"]
        if not v.dtype.isnative:
            flags.append("byte-swapped")
        if not v.flags.writeable:
            flags.append("read-only")
        if flags:
            r += f" [{', '.join(flags)}]"
    return r if len(r) <= 600 else r[:600] + "…"


# ------------------------------------------------------------------ one call
def _captured(since: int) -> str:
    """What was written to fds 1/2 (one capture file in a worker) since offset ``since``."""
    try:
        size = os.fstat(2).st_size
    except OSError:
        return ""
    if size <= since:
        return ""
    return os.pread(2, min(size - since, 4000), since).decode("utf-8", "replace")


def capture_offset() -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        return os.fstat(2).st_size
    except OSError:
        return 0


def run_case(target: Target, case: Case, capture: bool = True) -> Dict[str, Any]:
    """Runs ``case`` and classifies it: ``{outcome, bucket, secs, detail}``."""
    since = capture_offset() if capture else 0
    idents = case.require or (target.identifiers() + tuple(case.names))
    outcome, bucket, detail = "valid", "", ""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        try:
            args, kwargs = case.setup() if case.setup is not None else (case.args, case.kwargs)
            result = case.fn(*args, **kwargs)
        except Refused:
            result = Refused
        except KeyboardInterrupt:
            raise
        except rp.RoutepackError as e:
            msg = str(e)
            if case.expect == "ok":
                outcome, bucket = "other", f"refused a valid input: {type(e).__name__}: {normalise(msg)}"
            elif not msg:
                outcome, bucket = "other", f"{type(e).__name__} without a message"
            elif names_argument(msg, idents) and (case.pattern is None or re.search(case.pattern, msg)):
                outcome, bucket = "clean_named", f"{type(e).__name__}: {normalise(msg, 70)}"
            elif case.require:
                want = "/".join(case.require) + (f" and /{case.pattern}/" if case.pattern else "")
                outcome, bucket = "clean_unnamed", f"{type(e).__name__} without {want}: {normalise(msg)}"
            else:
                outcome, bucket = "clean_unnamed", f"{type(e).__name__}: {normalise(msg)}"
            detail = msg[:800]
            result = None
        except BaseException as e:  # noqa: BLE001 (PanicException is a BaseException)
            outcome = "other"
            bucket = f"{type(e).__name__}: {normalise(str(e))} @ {where(e.__traceback__)}"
            detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-1500:]
            result = None
        if outcome == "valid" and result is not Refused:
            if case.expect == "error":
                outcome, bucket = "other", "accepted an invalid input" + (f" ({case.note})" if case.note else "")
            elif case.check is not None:
                try:
                    case.check(result)
                except AssertionError as e:
                    msg = str(e) or assertion_source(e)
                    outcome, bucket = "other", f"wrong result: {normalise(msg)}"
                    detail = msg[:800]
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # noqa: BLE001
                    outcome = "other"
                    bucket = (
                        f"checking the result raised {type(e).__name__}: {normalise(str(e))} @ {where(e.__traceback__)}"
                    )
                    detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-1500:]
    secs = time.perf_counter() - t0
    out = _captured(since) if capture and not target.stderr_ok else ""
    if out.strip():
        first = next((ln for ln in out.splitlines() if ln.strip()), "")
        outcome, bucket = "other", f"output on stderr/stdout: {normalise(first)}"
        detail = (out[-800:] + "\n" + detail)[-1500:]
    return {"outcome": outcome, "bucket": bucket, "secs": round(secs, 4), "detail": detail}


# ------------------------------------------------------------------ schedule and streams
def batch_seed(seed: int, target: str, batch: int) -> int:
    """A 63-bit seed for batch ``batch`` of ``target`` in a campaign seeded ``seed``."""
    h = hashlib.sha256(f"{seed}/{target}/{batch}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


class Schedule:
    """Position p of the campaign → (target, index in that target's stream). A round gives
    every target ``weight`` consecutive cases, in the order of the target list."""

    def __init__(self, targets: Sequence[Target]) -> None:
        self.targets = list(targets)
        self.round_len = sum(t.weight for t in self.targets)

    def at(self, pos: int) -> Tuple[Target, int]:
        r, off = divmod(pos, self.round_len)
        for t in self.targets:
            if off < t.weight:
                return t, r * t.weight + off
            off -= t.weight
        raise AssertionError("unreachable")


class Streams:
    """Each target's cases, generated a batch at a time (and only the batch in use kept)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.cache: Dict[str, Tuple[int, List[Case]]] = {}

    def case(self, target: Target, k: int) -> Case:
        b, off = divmod(k, target.batch)
        got = self.cache.get(target.name)
        if got is None or got[0] != b:
            cases = target.gen(batch_seed(self.seed, target.name, b), target.batch)
            if not cases:
                raise RuntimeError(f"{target.name}: generator returned no cases")
            got = (b, cases)
            self.cache[target.name] = got
        cases = got[1]
        return cases[off % len(cases)]


def rng_gen(make: Callable[[np.random.Generator], Case]) -> Generator:
    """A generator from ``make(rng) -> Case`` (numpy's generator, seeded per batch)."""

    def gen(seed: int, n: int) -> List[Case]:
        rng = np.random.default_rng(seed)
        return [make(rng) for _ in range(n)]

    return gen


def hyp_gen(strategy: Any, to_case: Callable[[Any], Case]) -> Generator:
    """A generator from a hypothesis strategy (the tests' strategies), drawn deterministically:
    ``@seed`` per batch, no database, generation only."""

    def gen(seed: int, n: int) -> List[Case]:
        return [to_case(x) for x in draw_examples(strategy, seed, n)]

    return gen


def draw_examples(strategy: Any, seed: int, n: int) -> List[Any]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    out: List[Any] = []

    @hseed(seed)
    @settings(
        max_examples=n,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
        report_multiple_bugs=False,
    )
    @given(strategy)
    def collect(x: Any) -> None:
        out.append(x)

    collect()
    return out


def mixed(*parts: Tuple[float, Callable[[np.random.Generator], Case]]) -> Generator:
    """A generator drawing each case from one of ``(weight, make)`` parts."""
    weights = np.array([w for w, _ in parts], dtype=float)
    weights /= weights.sum()

    def gen(seed: int, n: int) -> List[Case]:
        rng = np.random.default_rng(seed)
        return [parts[int(rng.choice(len(parts), p=weights))][1](rng) for _ in range(n)]

    return gen


def both(first: Generator, second: Generator, share: float = 0.5) -> Generator:
    """A batch drawn partly from ``first`` (a ``share`` of it), the rest from ``second``."""

    def gen(seed: int, n: int) -> List[Case]:
        k = max(1, int(round(n * share)))
        cases = first(seed, k) + second(seed ^ 0x5DEECE66D, max(1, n - k))
        order = np.random.default_rng(seed).permutation(len(cases))
        return [cases[i] for i in order]

    return gen
