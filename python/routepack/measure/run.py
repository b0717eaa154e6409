"""`measure` (the measured run, see `routepack.measure`), what it returns (`Measurement`) and
the predictions it compares with (`predict`, on the one-microbatch plans of `micro_plan`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from routepack._checks import instance_of, positive_int, sequence
from routepack.errors import RoutepackError
from routepack.model import CostModel, Topology
from routepack.plan import Plan
from routepack.simulate import simulate
from routepack.window import Window
from routepack.measure.workload import Workload, history, plan_windows

#: The cost-model terms a microbatch's prediction is the sum of (`SimResult.breakdown`'s,
#: migration apart: it is the window's, measured at ``begin_window``).
TERMS = ("attention", "all_to_all", "expert", "replication", "redundant_grads")


def micro_plan(plan: Plan, window: Window, m: int) -> Tuple[Plan, Window]:
    """Microbatch ``m`` of ``plan`` as a plan of its own (one step, its samples, its replicas,
    no migration) and the window of its samples."""
    idx = np.flatnonzero(plan.sample_micro == m)
    w = Window(window.seq_lens[idx], window.counts[idx], top_k=window.top_k)
    reps = plan.replicas[plan.replicas["micro"] == m].copy()
    reps["micro"] = 0
    return Plan(plan.placement, plan.sample_rank[idx], np.zeros(idx.size, dtype=np.int32), 1, reps), w


def predict(plan: Plan, window: Window, topo: Topology, cost: CostModel) -> Dict[str, Any]:
    """The cost model's figures of one window's step under ``plan``: the step (``step_s``,
    `simulate`'s ``step_time``: migration included), the migration (``migration_s``), and per
    microbatch its seconds (``micro_s``) and their terms (``terms``: `TERMS` → seconds). The
    redundant experts' gradient sum, once a step, is put in the last microbatch, whose backward
    does it (`routepack.torch.slot_link`): each one-step sub-plan prices it, the run pays it
    once."""
    whole = simulate(plan, window, topo, cost)
    micro, terms = [], []
    for m in range(plan.num_micro):
        sub, sub_window = micro_plan(plan, window, m)
        r = simulate(sub, sub_window, topo, cost)
        last = m == plan.num_micro - 1
        parts = {t: getattr(r, t) for t in TERMS}
        parts["redundant_grads"] = whole.redundant_grads if last else 0.0
        parts["hidden"] = -r.hidden
        terms.append(parts)
        micro.append(r.step_time - r.redundant_grads + parts["redundant_grads"])
    return {"step_s": whole.step_time, "migration_s": whole.migration, "micro_s": micro, "terms": terms}


@dataclass
class Measurement:
    """What `measure` returns. ``policies``: policy → its figures: ``windows`` (one record per
    window: measured and predicted seconds of each microbatch, ``micro_s`` /
    ``predicted_micro_s``, of ``finish_step`` (``finish_s``), of the migration at the window's
    start (``migration_s`` / ``predicted_migration_s``) and of the step (``step_s`` /
    ``predicted_step_s``: migration + microbatches + finish), the per-part profile of each
    microbatch (``parts``, slowest rank per part, with ``parts_spread``) beside the predicted
    terms (``predicted_terms``), and every rank's figures), the run's totals over the windows
    (``step_s``, ``predicted_step_s``), and ``speedups``: reference policy → {"measured",
    "predicted", "rel_error"} (the reference's step over this policy's; ``speedup`` /
    ``predicted_speedup`` / ``speedup_rel_error`` the ones over ``static``). ``cost`` is the
    model the predictions used; ``calibration`` the fits' summary (None for a given model)."""

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


def run_cost(work: Workload, cost: CostModel, overlap: str, device: str = "cpu") -> CostModel:
    """``cost`` as the measured run's layers pay it: float32 (4 bytes per activation and weight;
    a migration moves the weights with Adam's two fp32 moments, ``expert_state_bytes`` 12 a
    parameter), no attention (``a_quad`` 0), every link local (the "nodes" are one machine's
    processes, so ``bw_inter`` is the measured ``bw_intra``), ``overlap`` as given (the run
    overlaps nothing: "none" is the model of what runs), and on CPU replication exposed in full
    (``replica_prefetch`` False: the run is judged by each rank's CPU time, which counts the
    transfers' work whenever it runs)."""
    params = 3.0 * work.hidden * work.ffn
    return replace(
        cost,
        a_quad=[0.0] * work.layers,
        overlap=overlap,
        num_experts=work.experts,
        expert_groups=1,
        bw_inter=cost.bw_intra,
        token_bytes=4.0 * work.hidden,
        expert_weight_bytes=4 * params,
        expert_grad_bytes=4 * params,
        expert_state_bytes=12 * params,
        replica_prefetch=device != "cpu",
    )


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
    calibration: Optional[str | Path] = None,
    profile: bool = True,
) -> Measurement:
    """Runs the measured comparison (see the module docs); returns a `Measurement`.

    Args:
        work: the workload (default `Workload()`: 2 ranks, 2 layers of 16 experts top-2,
            H = I = 256, 48 samples in 3 microbatches per rank, one window).
        cost: the cost model to predict with (its ``a_lin``/``a_quad`` are zeroed: the run has
            no attention, and a given model's dense work is another layer's); None: calibrate
            one here first (``quick``: the smoke sweeps), its ``a_lin`` the MoE layers' own
            work at the origin rank.
        calibration: a file holding this workload's calibration: read where it exists (an
            earlier run of the same shapes wrote it), else calibrated and written there.
        policies: presets to plan with; ``static`` is added first when missing (the speed-ups'
            reference).
        overlap: the predictions' `CostModel.overlap` (the run itself overlaps nothing:
            "none" is the model of what runs).
        warmup, repeats: untimed and timed steps per plan and window (each microbatch's
            median CPU time is kept, each step's drift divided out, as the calibration keeps
            its points': `routepack.calibrate.timing.polish`).
        device: "cpu" (gloo, one core per rank) or "cuda" (NCCL, one GPU per rank: needs
            ``work.ranks`` GPUs); the run is float32 either way.
        profile: time every microbatch's parts (`routepack.torch.profile`).

    Spawns processes (``spawn``): call it under ``if __name__ == "__main__":`` in a script.
    """
    import torch  # the measured run needs torch: fail before calibrating

    from routepack.measure.calibration import calibrated, load_or_calibrate
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
    names = ["static"] + [n for n in dict.fromkeys(names) if n != "static"]
    warmup = positive_int(warmup, "warmup", minimum=0)
    repeats = positive_int(repeats, "repeats")
    summary = None
    if cost is not None:
        cost = replace(instance_of(cost, CostModel, "cost"), a_lin=0.0)
    elif calibration is not None:
        cost, summary, _ = load_or_calibrate(calibration, work, quick, progress, device)
    else:
        cost, summary = calibrated(work, quick, progress, device)
    cost = run_cost(work, cost, overlap, device)
    windows = [work.window(w) for w in range(work.windows)]
    plans = plan_windows(work, [w[0] for w in windows], cost, tuple(names), history(work))
    got = run_ranks(
        run_plan,
        work.ranks,
        work,
        plans,
        windows,
        warmup,
        repeats,
        profile,
        backend="nccl" if device == "cuda" else "gloo",
        join_timeout_s=join_timeout_s,
        pg_timeout_s=300,
    )
    topo = work.topology()
    out = {
        name: _policy_record(
            [got[r]["policies"][name] for r in range(work.ranks)],
            plans[name],
            [w[0] for w in windows],
            topo,
            cost,
        )
        for name in plans
    }
    for rec in out.values():
        rec["pinned_cores"] = [got[r]["pinned"] for r in range(work.ranks)]
        rec["speedups"] = {
            ref: {
                "measured": base["step_s"] / rec["step_s"],
                "predicted": base["predicted_step_s"] / rec["predicted_step_s"],
            }
            for ref, base in out.items()
            if base is not rec
        }
        for s in rec["speedups"].values():
            s["rel_error"] = (s["predicted"] - s["measured"]) / s["measured"]
        rec["speedup"] = out["static"]["step_s"] / rec["step_s"]
        rec["predicted_speedup"] = out["static"]["predicted_step_s"] / rec["predicted_step_s"]
        rec["speedup_rel_error"] = (rec["predicted_speedup"] - rec["speedup"]) / rec["speedup"]
    return Measurement(work, cost, out, summary)


def _lockstep(per: List[Dict[str, Any]], num_micro: int) -> Optional[np.ndarray]:
    """float ``[M]``: each microbatch's Σ over the segments between the group's collectives of
    the slowest rank's seconds (``segments`` of every rank's `run_plan` record, each segment's
    median over the timed steps first): the time of ranks that meet at every all-to-all and
    all-reduce, each on a core of its own. The busiest rank's own total (``micro_s``' max over
    ranks) is less wherever the slowest rank changes from one segment to the next (a plan
    whose hot rank differs by layer): it misses the waits. The medians come before the max,
    so a step's noise on one rank's segment does not add up over the segments (the max of two
    noisy figures is biased up). None where a rank has no segments or the collectives do not
    line up (between ranks or steps)."""
    if not all("segments" in r for r in per):
        return None
    out = np.zeros(num_micro)
    for m in range(num_micro):
        medians = []
        for r in per:
            steps = [np.asarray(step[m]) for step in r["segments"]]
            if not steps or len({s.size for s in steps}) != 1 or steps[0].size == 0:
                return None
            medians.append(np.median(np.stack(steps), axis=0))
        if len({a.size for a in medians}) != 1:
            return None
        out[m] = float(np.max(np.stack(medians), axis=0).sum())
    return out


def _policy_record(
    ranks: List[List[Dict[str, Any]]], plans: Sequence[Plan], windows: Sequence[Window], topo: Topology, cost: CostModel
) -> Dict[str, Any]:
    """One policy's figures: every window's measured (slowest rank) and predicted ones, and the
    run's totals. ``ranks``: per rank, its `run_plan` records per window."""
    recs = []
    for w, (plan, window) in enumerate(zip(plans, windows)):
        per = [rank[w] for rank in ranks]
        busiest = np.max([np.array(r["micro_s"]) for r in per], axis=0)
        lockstep = _lockstep(per, plan.num_micro)
        micro = busiest if lockstep is None else lockstep
        finish = max(float(r["finish_s"]) for r in per)
        migration = max(float(r["migration_s"]) for r in per)
        routes = max(float(r.get("routes_s", 0.0)) for r in per)
        opening = max(float(r.get("opening_s", 0.0)) for r in per)
        pred = predict(plan, window, topo, cost)
        shared = micro + finish / plan.num_micro
        rec: Dict[str, Any] = {
            "num_micro": plan.num_micro,
            "replicas": int(plan.replicas.size),
            "migration_rows": int(plan.migration.size),
            "redundant_slots": int(
                sum(int((row >= 0).sum()) - np.unique(row[row >= 0]).size for row in plan.placement.phy2log)
            ),
            "micro_s": micro.tolist(),
            "micro_clock": "busiest rank" if lockstep is None else "lockstep",
            "busiest_rank_micro_s": busiest.tolist(),
            "finish_s": finish,
            "migration_s": migration,
            "routes_s": routes,
            "opening_s": opening,
            "predicted_migration_s": pred["migration_s"],
            "predicted_micro_s": pred["micro_s"],
            "predicted_terms": pred["terms"],
            "step_s": float(migration + micro.sum() + finish),
            "predicted_step_s": pred["step_s"],
            "micro_rel_error": [(p - s) / s for p, s in zip(pred["micro_s"], shared)],
            "micro_spread": np.max([r["micro_spread"] for r in per], axis=0).tolist(),
            "wall_micro_s": np.max([np.array(r["wall_s"]) for r in per], axis=0).tolist(),
            "per_rank_micro_s": [r["micro_s"] for r in per],
            "per_rank_steps_s": [r["steps_s"] for r in per],
            "per_rank_drift": [r["drift"] for r in per],
            "per_rank_unit_tokens": [r["unit_tokens"] for r in per],
        }
        if all("parts" in r for r in per):
            # the slowest rank of each part (the cost model prices each term's slowest rank)
            rec["parts"] = [
                {p: max(r["parts"][m][p] for r in per) for p in per[0]["parts"][m]} for m in range(plan.num_micro)
            ]
            rec["parts_spread"] = [
                {p: max(r["parts_spread"][m][p] for r in per) for p in per[0]["parts"][m]}
                for m in range(plan.num_micro)
            ]
            rec["per_rank_parts"] = [r["parts"] for r in per]
        recs.append(rec)
    return {
        "windows": recs,
        "step_s": float(sum(r["step_s"] for r in recs)),
        "predicted_step_s": float(sum(r["predicted_step_s"] for r in recs)),
    }
