"""Plan files as the glue reads them (`routepack.torch.load_plan`, in a gloo group of one rank;
the 4-rank cases are in test_torch_faults.py): whatever damage a saved plan file takes (cut
short, a byte changed anywhere, bytes deleted, inserted or zeroed), it is refused with
`RoutepackFileError` naming the path, or it still reads as the very plan that was saved (same
decisions, same digest): never as another plan."""

import datetime
import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.plan import Placement  # noqa: E402
from routepack.torch import load_plan, plan_digest  # noqa: E402
import selfcheck as sc  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture(scope="module", autouse=True)
def group():
    """A gloo group of world size 1 (created here unless one exists; destroyed if created)."""
    made = not dist.is_initialized()
    if made:
        store = os.path.join(tempfile.mkdtemp(prefix="rp_faults_"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=TIMEOUT)
    yield
    if made:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def plan():
    """Window 1's plan of the self-checks: migration rows, replicas, redundant slots."""
    case = sc.Case()
    plan0 = sc.make_plans(case, 0, Placement.static(case.layers, case.experts, case.topology()))[0]
    plan1 = sc.make_plans(case, 1, plan0.placement)[0]
    assert plan1.migration.size and plan1.replicas.size
    return plan1


def damage(raw: bytes, data) -> bytes:
    n = len(raw)
    kind = data.draw(st.sampled_from(["cut", "change", "delete", "insert", "zero"]), label="kind")
    at = data.draw(st.integers(0, n - 1), label="at")
    if kind == "cut":
        return raw[:at]
    if kind == "change":
        return raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255), label="xor")]) + raw[at + 1 :]
    length = data.draw(st.integers(1, 64), label="length")
    if kind == "delete":
        return raw[:at] + raw[at + length :]
    if kind == "insert":
        return raw[:at] + data.draw(st.binary(min_size=length, max_size=length), label="bytes") + raw[at:]
    return raw[:at] + bytes(min(length, n - at)) + raw[at + length :]


def test_a_saved_plan_file_arrives_whole(tmp_path, plan):
    path = tmp_path / "plan.npz"
    plan.save(path)
    got = load_plan(str(path), 0, timeout=TIMEOUT)
    assert got.same_as(plan) and plan_digest(got) == plan_digest(plan) and got.report == plan.report


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_a_damaged_plan_file_is_refused_or_reads_as_the_same_plan(tmp_path_factory, plan, data):
    path = tmp_path_factory.mktemp("plan") / "plan.npz"
    plan.save(path)
    damaged = damage(path.read_bytes(), data)
    path.write_bytes(damaged)
    try:
        got = load_plan(str(path), 0, timeout=TIMEOUT)
    except rp.RoutepackFileError as e:
        assert str(path) in str(e), str(e)
        return
    # damage in bytes nothing reads (zip slack, a comment) may leave the file valid: then it
    # must be the same plan, never another one
    assert got.same_as(plan) and plan_digest(got) == plan_digest(plan), "a damaged file read as another plan"
