"""``MegatronRunner.metrics()`` on Megatron's own path (issue 45's acceptance): a small
``GPTModel`` trained by Megatron's ``forward_backward_func`` and optimizer on CPU with gloo
(2 ranks, EP 2, tests/megatron_selfcheck's case: `plan_window`'s plans),
two windows. After each window's step the runner's metrics go to a Megatron writer
(``add_scalar``, what ``get_tensorboard_writer()`` returns) and to verl's ``Tracking.log``
through `routepack.metrics.log_metrics`: every documented name with a finite value, the measured step time the runner's own timing
(`StepTimer`) and within the wall time of the step. CUDA-only calls are stood in for by
tests/megatron_cpu.py."""

import math
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core (pip install --no-deps megatron-core) not importable")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch"))  # tests/torch/selfcheck

import megatron_cpu  # noqa: E402
from routepack.metrics import NAMES, log_metrics  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402
from test_torch_metrics import Tracking, Writer, cost_model  # noqa: E402


def check_metrics(rank, world, device):
    megatron_cpu.install(optimizers=True)
    from megatron.core import parallel_state
    import megatron_selfcheck as ms

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    case = ms.MegatronCase(dp=world, ep=2, gpus_per_node=2, slots_per_rank=5, windows=2)
    tracking, writer = Tracking(), Writer()
    out = {"timer": [], "wall": []}
    real_step = ms.run_step

    def timed_step(*args, **kwargs):
        t0 = time.perf_counter()
        got = real_step(*args, **kwargs)
        out["wall"].append(time.perf_counter() - t0)
        return got

    def after_window(w, model, opt, runner):
        metrics = runner.metrics(cost_model(case.layers))
        log_metrics(writer, metrics, step=w)
        log_metrics(tracking, metrics, step=w)
        out["timer"].append(runner.timer.seconds())

    ms.run_step = timed_step
    try:
        trained = ms.train(case, True, rank, after_window=after_window)
    finally:
        ms.run_step = real_step
    out["tracking"], out["writer"], out["migrated"] = tracking.calls, writer.calls, trained["migrated"]
    return out


def test_megatron_runner_metrics_reach_the_writer():
    out = run_ranks(check_metrics, 2, join_timeout_s=600, pg_timeout_s=180)
    want = set(NAMES)
    for rank, f in out.items():
        assert [s for s, _ in f["tracking"]] == [0, 1], rank
        scalars = {(s, t): v for s, t, v in f["writer"]}
        for w, (step, data) in enumerate(f["tracking"]):
            assert set(data) == want, (rank, set(data) ^ want)
            assert all(math.isfinite(v) for v in data.values()), (rank, data)
            assert data["routepack/measured_step_s"] == f["timer"][w]
            assert 0 < data["routepack/measured_step_s"] <= f["wall"][w]
            assert all(scalars[(step, k)] == v for k, v in data.items())
        assert len(scalars) == 2 * len(want)
    # the plans' migration rows, as the trainer's totals count them
    moved = sum(data["routepack/experts_moved"] for _, data in out[0]["tracking"])
    assert moved == out[0]["migrated"]
