"""Allocation under a memory limit, as a class (issue 33, class 1).

Rust aborts the process when an allocation fails, and no caller can catch an abort. The core
refuses a table over its fixed 16 GiB ceiling (`sizes::MAX_TABLE_BYTES`; the ``ABSURD``
cases of the fuzz tests); below it, a process may still be unable to hold what a call needs:
an address-space limit (``RLIMIT_AS``) as containers and schedulers set. So every entry
point whose buffers an argument sizes reserves its estimate of what the whole call holds
(``sizes::check_call``: address space only, released at once) before it allocates anything,
and allocates fallibly.

* Each public entry point, called with sizes between the limit and the ceiling in its own
  interpreter under an 8 GiB ``RLIMIT_AS``: a RoutepackError naming the argument and the
  bytes, never an abort or a bare MemoryError.
* The estimates cover what the calls allocate: a call's estimate (read from its refusal under
  a tight limit) against its measured peak (``ru_maxrss``) when it runs without one.
* What the Python side allocates on the caller's behalf (a contiguous copy of the caller's
  array, a list of its items, a window a profile sizes) is refused the same way
  (``_checks.allocating``): ``HELD`` gives each public function an input the caller holds for
  free (a broadcast view: no memory behind it) whose copy the limit cannot hold.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import routepack as rp
from routepack._checks import allocating

from fuzzing import MEMORY_LIMIT, assert_absurd_size_fails_cleanly

#: name -> (call, the argument its refusal must name). Each asks for more than the limit
#: leaves and less than the ceiling (or, where noted, more), so its own estimate refuses it.
CASES = {
    # the placement [2^26, 10] and its tables: 2^26 layers × 8 experts (logcnt alone 2 GiB)
    "Placement.static(num_layers)": ("rp.Placement.static(2**26, 8, rp.Topology(4, 2, 2, 5))", "num_layers"),
    # 3 layers of 2^29 slots: 6 GiB of phy2log before its tables
    "Placement.static(slots_per_rank)": (
        "rp.Placement.static(3, 2, rp.Topology(2, 2, 2, 2**28))",
        "topo.slots_per_rank",
    ),
    # counts [2, 1, 2^31 - 1] and every worker's [L, E] counters (over the ceiling too)
    "Window.from_routed_experts(num_experts)": (
        "rp.Window.from_routed_experts(np.zeros((3, 1, 1), np.int32), [0, 2, 3], 2**31 - 1)",
        "num_experts",
    ),
    "Window.from_routed_experts(num_experts, 4 GiB)": (
        "rp.Window.from_routed_experts(np.zeros((3, 1, 1), np.int32), [0, 2, 3], 2**30)",
        "num_experts",
    ),
    # EPLB's per-layer tables for 2^26 replicas (8.6 GB), and for 2^27 (over the ceiling)
    "rebalance_experts(num_replicas)": (
        "__import__('routepack.placement').placement.rebalance_experts(np.ones((2, 8)), 2**26, 4, 2, 4)",
        "num_replicas",
    ),
    "rebalance_experts(num_replicas, over the ceiling)": (
        "__import__('routepack.placement').placement.rebalance_experts(np.ones((2, 8)), 2**27, 4, 2, 4)",
        "num_replicas",
    ),
    # the chunk demand [L, E, B] of 2^28 layers × 4 experts: 8 GiB of float64
    "chunk_demand(placement_chunks)": (
        "_core.chunk_demand(np.array([3]), np.zeros((1, 2**28, 4), np.uint8), 1)",
        "placement_chunks",
    ),
    # issue 40, finding 5: about 2^30 pipeline chunks gave a bare MemoryError() naming nothing;
    # 2^29 chunks (8 GiB of bounds) is under the ceiling and over the limit, 2^30 over both
    "Topology.chunk_bounds(num_layers)": (
        "rp.Topology(2, 2, 2, 2, pp=2, vpp=2**28).chunk_bounds(2**29)",
        "num_layers",
    ),
    "Topology.chunk_bounds(num_layers, over the ceiling)": (
        "rp.Topology(2, 2, 2, 2, pp=2, vpp=2**29).chunk_bounds(2**30)",
        "num_layers",
    ),
    "Topology.stage_layers(num_layers)": (
        "rp.Topology(2, 2, 2, 2, pp=2, vpp=2**28).stage_layers(1, 2**29)",
        "num_layers",
    ),
    "Topology.stage_layers(num_layers, over the ceiling)": (
        "rp.Topology(2, 2, 2, 2, pp=2, vpp=2**29).stage_layers(1, 2**30)",
        "num_layers",
    ),
}
# every placement policy on a topology of 2^30 slots a rank (a 4 GiB placement a layer; the
# policies' working tables over the ceiling), and on one whose slots put each policy's call
# between the limit and the ceiling
for _policy, _slots in (
    ("static", 30),
    ("eplb_oracle", 30),
    ("eplb_hierarchical_oracle", 30),
    ("relibra", 30),
    ("hot_n", 30),
    ("routepack", 30),
    ("eplb_oracle", 27),
    ("relibra", 29),
    ("routepack", 26),
):
    CASES[f"plan_window({_policy}, slots_per_rank=2**{_slots})"] = (
        f"rp.plan_window(window, rp.Topology(1, 1, 1, 2**{_slots}), cost, token_cap=10, policy={_policy!r})",
        "topo.slots_per_rank",
    )


#: A window the caller holds (zero pages: no memory behind its counts until written) of
#: ``S`` samples x ``L`` layers x ``E`` experts, on 2 DP x 2 EP ranks, a static plan of 2
#: samples a microbatch, and a cost model: what `simulate` is given (its buffers grow with
#: the window's L x E once per exchange, not with any single argument).
HELD_WINDOW = (
    "S, L, E = {S}, {L}, {E}; w = rp.Window(np.full(S, 4), np.zeros((S, L, E), np.uint8)); "
    "t = rp.Topology(2, 2, 2, E // 2); c = rp.CostModel(1e-9, [0.0] * L, 1e-9, 1e-6, 10.0, 1e9, 1e8, 1e3, 1e3, 1e3); "
    "p = rp.Plan(rp.Placement.static(L, E, t), np.arange(S) % 2, np.arange(S) // 4, S // 4)"
)
CASES["simulate(window held by the caller)"] = (
    HELD_WINDOW.format(S=128, L=256, E=65536) + "; rp.simulate(p, w, t, c)",
    "window",
)
CASES["plan_window(static, window held by the caller)"] = (
    HELD_WINDOW.format(S=128, L=256, E=65536) + "; rp.plan_window(w, t, c, token_cap=8, policy='static')",
    "window",
)


@pytest.mark.parametrize("name", list(CASES))
def test_sizes_over_the_limit_are_refused_naming_the_argument_and_the_bytes(name):
    call, arg = CASES[name]
    out = assert_absurd_size_fails_cleanly(f"from routepack import _core; {call}", MEMORY_LIMIT, (arg,))
    assert re.search(r"\d{9,} bytes", out), f"no byte count in {out!r}"


#: name -> (call, the argument its refusal must name): each input a view of 12-24 GiB that
#: costs the caller nothing (``view(shape, dtype)``: np.broadcast_to), so the package's copy
#: of it, or its list of the items, is what the limit refuses.
VIEW = "view = lambda shape, dtype=np.int32, v=0: np.broadcast_to(np.array(v, dtype=dtype), shape); "
HELD = {
    "Window(expert_tokens)": ("rp.Window(view((3 << 20,), np.int64, 1), view((3 << 20, 32, 32)))", "expert_tokens"),
    "Window(seq_lens)": ("rp.Window(view((3 << 30,), np.int64, 1), view((3 << 30, 1, 1)))", "seq_lens"),
    "Window(expert_tokens, narrowed)": (
        "rp.Window(view((3 << 20,), np.int64, 9), view((3 << 20, 64, 64), np.int64, 1))",
        "expert_tokens",
    ),
    "Placement(phy2log)": ("rp.Placement(view((2**31, 2), np.int64), 1, 2)", "phy2log"),
    "Plan(sample_rank)": (
        "rp.Plan(plan.placement, view((2**31,), np.int64), view((2**31,), np.int64), 1)",
        "sample_rank",
    ),
    "Window.from_routed_experts(routed)": (
        "rp.Window.from_routed_experts(view((2**31, 2, 1)), [0, 2**31], 4)",
        "routed",
    ),
    "Window.from_slime(per_sample)": ("rp.Window.from_slime([view((2**31, 2, 1))], 4)", "per_sample"),
    "Window.from_verl(routed_experts)": (
        "rp.Window.from_verl(view((2**16, 2**15, 2, 1), np.int16), view((2**16, 2**15), np.int64, 1), 4)",
        "routed_experts",
    ),
    "Window.from_verl(attention_mask)": (
        "rp.Window.from_verl(view((2**16, 2**17, 1, 1), np.int16), view((2**16, 2**17), np.int64, 1), 4)",
        "attention_mask",
    ),
    "rebalance_experts(weight)": (
        "__import__('routepack.placement').placement.rebalance_experts(view((2**20, 2**11), np.float64, 1.0), 2**11, 1, 1, 1)",
        "weight",
    ),
    "imbalance_lower_bound(loads)": (
        "__import__('routepack.placement').placement.imbalance_lower_bound(view((2**20, 2**11), np.float64, 1.0), topo)",
        "loads",
    ),
    "CostModel(a_quad)": (
        "rp.CostModel(1e-9, view((2**31,), np.float64, 0.0), 1e-9, 1e-6, 10.0, 1e9, 1e8, 1e3, 1e3, 1e3)",
        "cost.a_quad",
    ),
    "traces.synthetic(profile_name.samples)": (
        "import dataclasses; next(rp.traces.synthetic(dataclasses.replace(rp.traces.profile('tiny'), samples=2**34)))",
        "profile_name",
    ),
}


@pytest.mark.parametrize("name", list(HELD))
def test_copies_of_what_the_caller_holds_are_refused_naming_the_argument_and_the_bytes(name):
    call, arg = HELD[name]
    out = assert_absurd_size_fails_cleanly(VIEW + call, MEMORY_LIMIT, (arg,))
    assert re.search(r"\d{9,} bytes", out), f"no byte count in {out!r}"
    assert "MemoryError" not in out


def test_allocating_turns_a_memory_error_into_one_naming_the_argument():
    with pytest.raises(rp.RoutepackError, match=r"^weight: a copy would take 24 bytes, which this process cannot"):
        with allocating("weight", "a copy", 24):
            raise MemoryError()

    # numpy's own error says what it asked for (its shape and dtype), which wins over the estimate
    class ArrayMemoryError(MemoryError):
        shape, dtype = (2,), np.dtype(np.int64)

    with pytest.raises(rp.RoutepackError, match=r"^x: a copy would take 16 bytes"):
        with allocating("x", "a copy", 3):
            raise ArrayMemoryError()
    with pytest.raises(rp.RoutepackError, match=r"^x: a copy would take more memory than this process can allocate"):
        with allocating("x", "a copy"):
            raise MemoryError()


#: What measures a call: RSS before, the peak after, in bytes. The peak is this process's
#: own high-water mark (VmHWM), not ru_maxrss: Linux carries ru_maxrss across fork and exec,
#: so a child of a large test process would report its parent's peak.
MEASURE = """
import resource, numpy as np, routepack as rp
from routepack import _core
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
def vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
rp.Placement.static(2, 8, rp.Topology(4, 2, 2, 5))  # start the worker threads
{setup}
{before}
try:
    {call}
except rp.RoutepackError as e:
    print("REFUSED", e)
else:
    print("PEAK", hwm() - start)
"""

#: Calls of a few hundred MB, each with its estimate's argument (and what they are given).
MEASURED = {
    "Placement.static": ("rp.Placement.static(2_000_000, 8, rp.Topology(4, 2, 2, 5))", "num_layers", ""),
    "Window.from_routed_experts": (
        "rp.Window.from_routed_experts(np.zeros((3, 1, 1), np.int32), [0, 2, 3], 2**24)",
        "num_experts",
        "",
    ),
    "simulate": ("rp.simulate(p, w, t, c)", "window", HELD_WINDOW.format(S=32, L=64, E=16384)),
}


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-500:]
    return proc.stdout


@pytest.mark.parametrize("name", list(MEASURED))
def test_the_estimate_covers_the_measured_peak(name):
    call, arg, setup = MEASURED[name]
    # under a limit 64 MiB above what the process holds, the call's own estimate refuses it
    tight = "start = rss(); lim = vm() + (64 << 20); resource.setrlimit(resource.RLIMIT_AS, (lim, lim))"
    out = _run(MEASURE.format(setup=setup, before=tight, call=call))
    m = re.search(r"REFUSED (\S+): .* would take (\d+) bytes, which this process cannot allocate", out)
    assert m and m.group(1) == arg, out
    estimate = int(m.group(2))
    # without a limit: the peak the call adds to what the process held
    out = _run(MEASURE.format(setup=setup, before="start = rss()", call=call))
    peak = int(re.search(r"PEAK (-?\d+)", out).group(1))
    assert peak > (64 << 20), f"{name}: the call should allocate more than the headroom, peak {peak}"
    assert peak <= estimate, f"{name}: measured peak {peak} bytes above the estimate {estimate}"
    assert estimate <= 4 * peak, f"{name}: estimate {estimate} bytes over 4 x the measured peak {peak}"
