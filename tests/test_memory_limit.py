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
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

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


@pytest.mark.parametrize("name", list(CASES))
def test_sizes_over_the_limit_are_refused_naming_the_argument_and_the_bytes(name):
    call, arg = CASES[name]
    out = assert_absurd_size_fails_cleanly(f"from routepack import _core; {call}", MEMORY_LIMIT, (arg,))
    assert re.search(r"\d{9,} bytes", out), f"no byte count in {out!r}"


#: What measures a call: RSS before, the peak after (ru_maxrss, KiB on Linux), in bytes.
MEASURE = """
import resource, numpy as np, routepack as rp
from routepack import _core
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
def vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
rp.Placement.static(2, 8, rp.Topology(4, 2, 2, 5))  # start the worker threads
{before}
try:
    {call}
except rp.RoutepackError as e:
    print("REFUSED", e)
else:
    print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start)
"""

#: Calls of a few hundred MB, each with its estimate's argument.
MEASURED = {
    "Placement.static": ("rp.Placement.static(2_000_000, 8, rp.Topology(4, 2, 2, 5))", "num_layers"),
    "Window.from_routed_experts": (
        "rp.Window.from_routed_experts(np.zeros((3, 1, 1), np.int32), [0, 2, 3], 2**24)",
        "num_experts",
    ),
}


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-500:]
    return proc.stdout


@pytest.mark.parametrize("name", list(MEASURED))
def test_the_estimate_covers_the_measured_peak(name):
    call, arg = MEASURED[name]
    # under a limit 64 MiB above what the process holds, the call's own estimate refuses it
    tight = "start = rss(); lim = vm() + (64 << 20); resource.setrlimit(resource.RLIMIT_AS, (lim, lim))"
    out = _run(MEASURE.format(before=tight, call=call))
    m = re.search(r"REFUSED (\S+): .* would take (\d+) bytes, which this process cannot allocate", out)
    assert m and m.group(1) == arg, out
    estimate = int(m.group(2))
    # without a limit: the peak the call adds to what the process held
    out = _run(MEASURE.format(before="start = rss()", call=call))
    peak = int(re.search(r"PEAK (-?\d+)", out).group(1))
    assert peak > (64 << 20), f"{name}: the call should allocate more than the headroom, peak {peak}"
    assert peak <= estimate, f"{name}: measured peak {peak} bytes above the estimate {estimate}"
    assert estimate <= 4 * peak, f"{name}: estimate {estimate} bytes over 4 x the measured peak {peak}"
