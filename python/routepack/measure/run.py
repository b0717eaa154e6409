"""`measure` (the measured run, see `routepack.measure`), what it returns (`Measurement`),
the one-microbatch plans it predicts with (`micro_plan`) and the table it prints
(`format_table`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from routepack._checks import instance_of, positive_int, sequence
from routepack.errors import RoutepackError
from routepack.model import CostModel
from routepack.plan import Plan
from routepack.simulate import simulate
from routepack.window import Window
from routepack.measure.workload import Workload, make_plans


def micro_plan(plan: Plan, window: Window, m: int) -> Tuple[Plan, Window]:
    """Microbatch ``m`` of ``plan`` as a plan of its own (one step, its samples, its replicas,
    no migration) and the window of its samples."""
    idx = np.flatnonzero(plan.sample_micro == m)
    w = Window(window.seq_lens[idx], window.counts[idx], top_k=window.top_k)
    reps = plan.replicas[plan.replicas["micro"] == m].copy()
    reps["micro"] = 0
    return Plan(plan.placement, plan.sample_rank[idx], np.zeros(idx.size, dtype=np.int32), 1, reps), w


@dataclass
class Measurement:
    """What `measure` returns, per policy: measured and predicted seconds of each microbatch
    (``micro_s``, ``predicted_micro_s``; float lists ``[M]``), of ``finish_step``
    (``finish_s``), of the step (``step_s``, ``predicted_step_s``), and the speed-ups over
    ``static`` (``speedup``, ``predicted_speedup``); ``cost`` the model the predictions used."""

    workload: Workload
    cost: CostModel
    policies: Dict[str, Dict[str, Any]]
    calibration: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        return {
            "workload": asdict(self.workload),
            "cost_model": asdict(self.cost),
            "policies": self.policies,
            "calibration": self.calibration,
        }


def _calibrated(
    work: Workload, ranks: int, quick: bool, progress: bool, device: str = "cpu"
) -> Tuple[CostModel, Dict[str, Any]]:
    from routepack.calibrate import ALL_KERNELS, calibrate

    window, _, _ = work.window()
    most = int(window.counts.sum(axis=0, dtype=np.int64).max())  # the most tokens one expert gets in a layer
    # the longest sample a rank's microbatch holds bounds the origin sweep
    longest = max(work.token_cap(window), 128)
    cal = calibrate(
        model=work.model(),
        kernels=ALL_KERNELS,
        ranks=ranks,
        quick=quick,
        max_tokens_per_expert=max(8, most),
        expert_stack=work.slots_per_rank,
        progress=progress,
        threads=1 if device == "cpu" else None,
        device=device,
        dtype="float32",
        max_length=longest,
        attention_dense=False,
        links_clock="cpu" if device == "cpu" else "wall",
    )
    # the form committed and what bounds it (the expert fit's `call_curve_bound`), beside the error
    summary = {
        kind: {
            "max_rel_error": fit.max_rel_error,
            "coefficients": fit.coefficients,
            "formula": fit.formula,
            **{k: fit.extra[k] for k in ("curve_bound", "call_curve_bound", "cross_validation") if k in fit.extra},
            **({"expert_table": fit.cost_fields["expert_table"]} if fit.cost_fields.get("expert_table") else {}),
        }
        for kind, fit in cal.fits.items()
    }
    return cal.cost, summary


def measure(
    work: Optional[Workload] = None,
    *,
    cost: Optional[CostModel] = None,
    policies: Sequence[str] = ("static", "routepack"),
    overlap: str = "none",
    warmup: int = 1,
    repeats: int = 5,
    quick: bool = False,
    progress: bool = True,
    join_timeout_s: float = 1800,
    device: str = "cpu",
) -> Measurement:
    """Runs the measured comparison (see the module docs); returns a `Measurement`.

    Args:
        work: the workload (default `Workload()`: 2 ranks, 2 layers of 16 experts top-2,
            H = I = 256, 48 samples in 3 microbatches per rank).
        cost: the cost model to predict with (its ``a_lin``/``a_quad`` are zeroed: the run has
            no attention, and a given model's dense work is another layer's); None: calibrate
            one here first (``quick``: the smoke sweeps), its ``a_lin`` the MoE layers' own
            work at the origin rank.
        policies: presets to plan with; ``static`` is added first when missing (the speed-ups'
            reference).
        overlap: the predictions' `CostModel.overlap` (the run itself overlaps nothing:
            "none" is the model of what runs).
        warmup, repeats: untimed and timed steps per plan (each microbatch's median CPU time
            is kept, each step's drift divided out, as the calibration keeps its points':
            `routepack.calibrate.timing.polish`).
        device: "cpu" (gloo, one core per rank) or "cuda" (NCCL, one GPU per rank: needs
            ``work.ranks`` GPUs); the run is float32 either way.

    Spawns processes (``spawn``): call it under ``if __name__ == "__main__":`` in a script.
    """
    import torch  # the measured run needs torch: fail before calibrating

    from routepack.measure.execute import run_plan
    from routepack.torch.spawn import run_ranks

    work = instance_of(work, Workload, "work") if work is not None else Workload()
    if device not in ("cpu", "cuda"):
        raise RoutepackError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < work.ranks:
        raise RoutepackError(
            f"device: 'cuda' needs one GPU per rank ({work.ranks}), this machine has {torch.cuda.device_count()}"
        )
    names = list(sequence(policies, "policies", "policy names"))
    names = ["static"] + [n for n in names if n != "static"]
    warmup = positive_int(warmup, "warmup", minimum=0)
    repeats = positive_int(repeats, "repeats")
    calibration = None
    if cost is None:
        cost, calibration = _calibrated(work, work.ranks, quick, progress, device)
    else:
        cost = replace(instance_of(cost, CostModel, "cost"), a_lin=0.0)
    # the run is float32: 4 bytes per activation and weight, whatever the calibration's preset;
    # its layers have no attention (a_quad 0), a_lin is the MoE layers' origin work
    params = 3.0 * work.hidden * work.ffn
    cost = replace(
        cost,
        a_quad=[0.0] * work.layers,
        overlap=overlap,
        num_experts=work.experts,
        expert_groups=1,
        token_bytes=4.0 * work.hidden,
        expert_weight_bytes=4 * params,
        expert_grad_bytes=4 * params,
        expert_state_bytes=16 * params,
    )
    window, routed, cu = work.window()
    plans = make_plans(work, window, cost, tuple(names))
    got = run_ranks(
        run_plan,
        work.ranks,
        work,
        plans,
        window,
        routed,
        cu,
        warmup,
        repeats,
        backend="nccl" if device == "cuda" else "gloo",
        join_timeout_s=join_timeout_s,
        pg_timeout_s=300,
    )
    topo = work.topology()
    out: Dict[str, Dict[str, Any]] = {}
    for name, plan in plans.items():
        ranks = [got[r]["policies"][name] for r in range(work.ranks)]
        micro = np.max([np.array(rank["micro_s"]) for rank in ranks], axis=0)
        finish = max(float(rank["finish_s"]) for rank in ranks)
        wall = np.max([np.array(rank["wall_s"]) for rank in ranks], axis=0)
        pred = []
        whole = simulate(plan, window, topo, cost)
        for m in range(plan.num_micro):
            sub, sub_window = micro_plan(plan, window, m)
            r = simulate(sub, sub_window, topo, cost)
            # redundant experts' gradients are summed once a step, in the last microbatch's
            # backward (routepack.torch.slot_link): each one-step sub-plan prices that sum, the
            # run pays it in the last microbatch only
            last = m == plan.num_micro - 1
            pred.append(r.step_time - r.redundant_grads + (whole.redundant_grads if last else 0.0))
        step_pred = whole.step_time
        shared = micro + finish / plan.num_micro
        out[name] = {
            "num_micro": plan.num_micro,
            "micro_s": micro.tolist(),
            "finish_s": finish,
            "predicted_micro_s": pred,
            "step_s": float(micro.sum() + finish),
            "predicted_step_s": step_pred,
            "replicas": int(plan.replicas.size),
            "wall_micro_s": wall.tolist(),
            "per_rank_micro_s": [rank["micro_s"] for rank in ranks],
            "per_rank_steps_s": [rank["steps_s"] for rank in ranks],
            "per_rank_drift": [rank["drift"] for rank in ranks],
            "pinned_cores": [got[r]["pinned"] for r in range(work.ranks)],
            "micro_rel_error": [(p - s) / s for p, s in zip(pred, shared)],
        }
    base = out["static"]
    for rec in out.values():
        rec["speedup"] = base["step_s"] / rec["step_s"]
        rec["predicted_speedup"] = base["predicted_step_s"] / rec["predicted_step_s"]
        rec["speedup_rel_error"] = (rec["predicted_speedup"] - rec["speedup"]) / rec["speedup"]
    return Measurement(work, cost, out, calibration)


def format_table(result: Measurement) -> List[str]:
    """The lines `routepack measure` prints: per policy and microbatch, measured and predicted
    milliseconds and the relative error; then the step and the speed-ups."""
    lines = []
    for name, rec in result.policies.items():
        lines.append(
            f"{name}: {rec['num_micro']} microbatches per rank, {rec['replicas']} replicas, "
            f"finish_step {rec['finish_s'] * 1e3:.1f} ms"
        )
        for m, (s, p, e) in enumerate(zip(rec["micro_s"], rec["predicted_micro_s"], rec["micro_rel_error"])):
            lines.append(f"  micro {m}: measured {s * 1e3:8.1f} ms  predicted {p * 1e3:8.1f} ms  error {e:+.1%}")
        lines.append(f"  step: measured {rec['step_s'] * 1e3:.1f} ms  predicted {rec['predicted_step_s'] * 1e3:.1f} ms")
    for name, rec in result.policies.items():
        if name != "static":
            lines.append(
                f"speed-up {name} over static: measured {rec['speedup']:.3f}x  predicted "
                f"{rec['predicted_speedup']:.3f}x  (predicted/measured - 1 = {rec['speedup_rel_error']:+.1%})"
            )
    return lines
