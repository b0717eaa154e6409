"""Shared by the property tests `tests/test_<module>_fuzz.py`: random and malformed inputs to
every public function and constructor.

Each call either succeeds, and then its result is checked (plans through `Plan.validate` and
an independent numpy check of the invariants), or raises a clean error: a
`routepack.RoutepackError` (a `ValueError`; its subclass `RoutepackTypeError` is also a
`TypeError`). A Rust panic
(`RoutepackInternalError`, a RuntimeError, or pyo3's PanicException, a BaseException) or any
other exception fails the test. Where validity is easy to state, success must coincide with
it exactly (no false rejections either).

Sizes that feed allocations (numbers of experts, layers, slots, ranks, microbatches) stay
small here: absurd sizes are tried in `test_absurd_sizes_fail_cleanly`, each in its own
process, because an allocation failure aborts the interpreter.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import routepack as rp
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: ROUTEPACK_FUZZ_EXAMPLES=2000 ROUTEPACK_FUZZ_RANDOM=1 for a longer, randomized hunt; the
#: default run is short and reproducible.
FUZZ = settings(
    max_examples=int(os.environ.get("ROUTEPACK_FUZZ_EXAMPLES", "100")),
    deadline=None,
    derandomize=not os.environ.get("ROUTEPACK_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
#: Every input error is a RoutepackError (a ValueError; RoutepackTypeError is also a TypeError).
CLEAN = (rp.RoutepackError,)

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
OTHER_DTYPES = [np.float32, np.float64, np.bool_]
ROUTED_DTYPES = [np.uint8, np.int16, np.int32, np.int64]


def outcome(f, *args, **kwargs):
    """(result, None) on success, (None, error) for a clean error; anything else propagates."""
    try:
        return f(*args, **kwargs), None
    except CLEAN as e:
        assert str(e), f"{type(e).__name__} without a message"
        return None, e


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def fits(a: np.ndarray, dtype) -> bool:
    if a.size == 0:
        return True
    info = np.iinfo(dtype)
    return int(a.min()) >= info.min and int(a.max()) <= info.max


def int_array_ok(a: np.ndarray, ndim: int, dtype) -> bool:
    return a.dtype.kind in "iu" and a.ndim == ndim and fits(a, dtype)


#: a scalar argument: small ints, boundaries, huge ints, and other types
def scalars(lo: int = -2, hi: int = 12, huge: bool = True):
    options = [st.integers(lo, hi), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=2)]
    if huge:
        options.append(st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 10**30]))
    return st.one_of(*options)


def numbers():
    """Float-like arguments: ordinary, zero, negative, nan/inf, huge ints, wrong types."""
    return st.one_of(
        st.floats(min_value=1e-12, max_value=1e12),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-3, 10**6),
        st.sampled_from([0, 0.0, -1.0, 10**400, float("nan"), float("inf")]),
        st.booleans(),
        st.none(),
        st.text(max_size=3),
    )


def finite_number_ok(v, strict: bool = False, upper: float = math.inf) -> bool:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        return False
    try:
        f = float(v)
    except OverflowError:
        return False
    return math.isfinite(f) and (f > 0 if strict else f >= 0) and f <= upper


def small_plan():
    """(topo, window, cost, plan): a valid two-sample plan to pass wrong arguments beside."""
    topo = rp.Topology(2, 1, 1, 2)
    window = rp.Window(np.array([3, 4]), np.ones((2, 1, 2), dtype=np.int32))
    cost = rp.CostModel(1e-9, [0.0], 1e-9, 1e-6, 10.0, 1e9, 1e8, 1e3, 1e3, 1e3)
    plan = rp.plan_window(window, topo, cost, token_cap=10, policy="static").validate(window, topo, 10)
    return topo, window, cost, plan


#: what every `ABSURD` call runs after: a valid one-sample plan, then the call, then whether it
#: was refused with a clean error
PRELUDE = """
import numpy as np, routepack as rp
topo = rp.Topology(1, 1, 1, 1)
window = rp.Window(np.array([3]), np.ones((1, 1, 1), dtype=np.int32))
cost = rp.CostModel(1e-9, [0.0], 1e-9, 1e-6, 10.0, 1e9, 1e8, 1e3, 1e3, 1e3)
plan = rp.plan_window(window, topo, cost, token_cap=10, policy="static").validate(window, topo, 10)
{limit}
try:
    {call}
except rp.RoutepackError as e:
    print("CLEAN", type(e).__name__, e)
else:
    print("ACCEPTED")
"""


#: The address-space limit (``RLIMIT_AS``) of the memory-limit class: what containers and
#: schedulers set, below the core's 16 GiB table ceiling, so a call between the two must be
#: refused by its estimate (``sizes::check_call``) or its fallible allocations, not abort.
MEMORY_LIMIT = 8 << 30


def run_in_own_interpreter(call: str, memory_limit: int | None = None) -> subprocess.CompletedProcess:
    """Runs `PRELUDE` with `call` in a fresh interpreter (an allocation failure aborts it),
    under an address-space limit of ``memory_limit`` bytes when given (set after the prelude,
    so only the call runs under it)."""
    limit = (
        ""
        if memory_limit is None
        else f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory_limit}, {memory_limit}))"
    )
    code = textwrap.dedent(PRELUDE).format(call=call, limit=limit)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RUST_BACKTRACE": "0"},
    )


def assert_wrong_type_is_clean(call) -> None:
    """A wrong type or an unrepresentable number given to ``call(topo, window, cost, plan)``
    raises a RoutepackError, not AttributeError/OverflowError."""
    try:
        call(*small_plan())
    except CLEAN as e:
        assert str(e), f"{type(e).__name__} without a message"
    else:
        raise AssertionError("accepted")


def assert_absurd_size_fails_cleanly(call: str, memory_limit: int | None = None, names: tuple = ()) -> str:
    """Sizes no machine can hold (or, with ``memory_limit``, more than that limit leaves) must
    be refused with a RoutepackError before anything is allocated (an allocation failure
    aborts the interpreter, so each runs in its own), its message naming each of ``names``.
    Returns the message."""
    proc = run_in_own_interpreter(call, memory_limit)
    assert proc.returncode == 0 and proc.stdout.startswith("CLEAN"), (
        f"rc={proc.returncode} stdout={proc.stdout[-300:]!r} stderr={proc.stderr[-300:]!r}"
    )
    for name in names:
        assert name in proc.stdout, f"{name!r} not named: {proc.stdout[-300:]!r}"
    return proc.stdout
