"""`calibrate` (measure and fit the cost model on this machine), `refit` (fit a report's
measurements anew) and what they return, `Calibration`; the kernel kinds they know
(`KERNELS`, `ALL_KERNELS`). See `routepack.calibrate` for the kinds and the modules that
measure and fit them."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from routepack._checks import finite_float, instance_of, positive_int, sequence
from routepack.calibrate.fit import LINK_OPS, KernelFit, fit_all
from routepack.calibrate.report import PLOT_HINT, build, plot, write_json
from routepack.calibrate.sweeps import Sweeps
from routepack.errors import RoutepackError
from routepack.model import CostModel, Hardware, ModelShape

#: The kernel kinds `calibrate` measures by default, in the order it measures them.
KERNELS = ("expert_gemm", "attention", "links")
#: Every kind it can measure: the defaults, then the ``exchange`` (a whole MoE layer on every
#: rank: minutes at a large profile's shapes on a CPU), the ``migration`` (experts moved with
#: their Adam state between ranks) and the ``replication`` (replica copies filled and their
#: gradients returned between two ranks).
ALL_KERNELS = KERNELS + ("exchange", "migration", "replication")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class Calibration:
    """What `calibrate` returns: the calibrated `CostModel`, the report document and the
    per-kernel fits."""

    cost: CostModel
    report: Dict[str, Any]
    fits: Dict[str, KernelFit]

    def save(
        self,
        out: Optional[str | Path] = None,
        report: Optional[str | Path] = None,
        plot_path: Optional[str | Path] = None,
    ) -> List[Path]:
        """Writes the cost model (``CostModel.save``), the report JSON and the figure (needs
        matplotlib) to whichever paths are given; returns the paths written."""
        written = []
        if out:
            self.cost.save(out)
            written.append(Path(out))
        if report:
            written.append(write_json(self.report, report))
        if plot_path:
            written.append(self.plot(plot_path))
        return written

    def plot(self, path: str | Path) -> Path:
        """The measured-vs-predicted figure (PNG); ImportError naming the extra without matplotlib."""
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise ImportError(f"the calibration figure needs matplotlib: {PLOT_HINT}") from e
        return plot(self.report, path)


def _model(profile: str, model: Optional[ModelShape], hidden: Optional[int], expert_ffn: Optional[int]) -> ModelShape:
    from routepack import traces

    base = instance_of(model, ModelShape, "model") if model is not None else traces.profile(profile).model()
    given = {k: positive_int(v, k) for k, v in (("hidden", hidden), ("expert_ffn", expert_ffn)) if v is not None}
    return replace(base, **given)


def _dtype(torch: Any, dtype: Optional[str], device: str) -> Any:
    name = dtype or ("float32" if device == "cpu" else "bfloat16")
    if name not in DTYPES:
        raise RoutepackError(f"dtype: expected one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def _kernels(kernels: Sequence[str]) -> List[str]:
    got = list(sequence(kernels, "kernels", "kernel kinds"))
    for k in got:
        if k not in ALL_KERNELS:
            raise RoutepackError(f"kernels: {k!r} is not one of {ALL_KERNELS}")
    if not got:
        raise RoutepackError("kernels: needs at least one kernel kind, got none")
    return [k for k in ALL_KERNELS if k in got]


def _bar(total: int, show: bool) -> Any:
    from routepack.progress import bar

    return bar(total, "point", "calibrate", show)


def calibrate(
    profile: str = "tiny",
    *,
    model: Optional[ModelShape] = None,
    hidden: Optional[int] = None,
    expert_ffn: Optional[int] = None,
    device: str = "cpu",
    dtype: Optional[str] = None,
    quick: bool = False,
    sweeps: Optional[Sweeps] = None,
    kernels: Sequence[str] = KERNELS,
    hardware: Optional[Hardware] = None,
    bw_inter: Optional[float] = None,
    ranks: int = 2,
    threads: Optional[int] = None,
    warmup: Optional[int] = None,
    repeats: Optional[int] = None,
    holdout_every: Optional[int] = None,
    max_tokens_per_expert: Optional[int] = None,
    max_length: Optional[int] = None,
    progress: bool = True,
    links_timeout_s: float = 600.0,
    expert_stack: Optional[int] = None,
    attention_dense: bool = True,
    links_clock: str = "wall",
) -> Calibration:
    """Measures and fits the cost model on this machine; returns a `Calibration`.

    Args:
        profile: built-in profile whose model shape is measured (`routepack.traces.PROFILES`),
            unless ``model`` is given; ``hidden`` / ``expert_ffn`` override its sizes.
        device: "cpu" or "cuda"; ``dtype``: "float32" (CPU default), "bfloat16" (CUDA default)
            or "float16".
        quick: a smoke run (small sweeps, few repeats; with small ``hidden`` /
            ``expert_ffn`` it takes seconds). ``sweeps`` replaces the sweeps altogether;
            ``warmup``, ``repeats``, ``holdout_every``, ``max_tokens_per_expert`` and
            ``max_length`` adjust the default ones.
        kernels: the kinds to measure (default `KERNELS`; `ALL_KERNELS` adds the
            ``exchange``); a coefficient of a kind not measured comes from ``hardware``'s preset.
        hardware: preset for what is not measured and for the report's comparison
            (default `Hardware.h200`); ``bw_inter``: the inter-node bandwidth to use, in the
            cost model's bytes/s (local processes cannot measure it).
        ranks: processes of the links and exchange measurements; ``threads``: torch CPU threads while
            measuring (restored afterwards; the spawned ranks use one each; the report's
            ``settings.threads``).
        progress: progress on stderr (a bar on a terminal, plain lines elsewhere).
        expert_stack: time the expert GEMMs in a stack of this many slots, ``active`` of them
            fed, as a rank of `routepack.torch.EPMoE` with that many slots runs them
            (`routepack.measure` does, to predict EPMoE runs); None (default): a stack of the
            active experts only.
        attention_dense: whether the ``attention`` kernel times the dense layer (projections,
            attention, shared experts) besides the MoE layer's work at the origin rank (gather,
            gate-weighted combine, residual); False: that origin work alone, for layers
            without attention (`routepack.measure`'s).
        links_clock: "wall" (default: waiting for the peer is a link's time) or "cpu" (each
            call's CPU time, gloo's threads included: what `routepack.measure` judges its
            run by; CPU devices only), for the links and the exchange.

    The links measurement starts processes with the ``spawn`` method, which re-imports the
    calling script: call `calibrate` from a script under ``if __name__ == "__main__":``.
    """
    from routepack._core import __version__
    from routepack.calibrate import attention, exchange, expert_gemm, links, migration, replication
    from routepack.calibrate.timing import AGGREGATE, clock, device_info, load_averages, require_torch, steady_heap

    if device not in ("cpu", "cuda"):
        raise RoutepackError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    shape = _model(profile, model, hidden, expert_ffn)
    kinds = _kernels(kernels)
    hardware = instance_of(hardware, Hardware, "hardware") if hardware is not None else Hardware.h200()
    if bw_inter is not None:
        bw_inter = finite_float(bw_inter, "bw_inter", strict=True)
    ranks = positive_int(ranks, "ranks", minimum=2)
    links_clock = links.check_clock(links_clock, device)  # before minutes of measuring
    if sweeps is None:
        sweeps = Sweeps.default(device, quick, max_tokens_per_expert, max_length)
    else:
        instance_of(sweeps, Sweeps, "sweeps")
    sweeps = sweeps.with_timer(warmup, repeats, holdout_every)
    torch = require_torch()
    if device == "cuda" and not torch.cuda.is_available():
        raise RoutepackError("device: 'cuda' but torch.cuda.is_available() is False")
    tdtype = _dtype(torch, dtype, device)
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(positive_int(threads, "threads"))
    t0 = time.perf_counter()
    load_start = load_averages()
    measurements: Dict[str, Dict[str, Any]] = {}
    skipped: Dict[str, str] = {}
    # at most: the short points' extra rounds are counted as if every point were short
    total = (
        (sweeps.repeats + sweeps.short_repeats)
        * (
            (len(sweeps.expert_grid()) if "expert_gemm" in kinds else 0)
            + (len(sweeps.lengths) if "attention" in kinds else 0)
        )
        + (len(LINK_OPS) * len(sweeps.message_bytes) if "links" in kinds else 0)
        + (len(sweeps.exchange_tokens) * len(exchange.ROUTINGS) if "exchange" in kinds else 0)
        + (len(sweeps.migration_moves) if "migration" in kinds else 0)
        + (len(sweeps.replication_copies) if "replication" in kinds else 0)
    )
    bar = _bar(total, progress)
    tick: Callable[[], None] = lambda: bar.update(1)  # noqa: E731
    try:
        info = device_info(device, tdtype)
        info["clock"] = clock(device)[0]
        with steady_heap(device) as info["steady_heap"]:
            if "expert_gemm" in kinds:
                bar.set_postfix_str("expert_gemm")
                stack = None if expert_stack is None else positive_int(expert_stack, "expert_stack")
                measurements["expert_gemm"] = expert_gemm.measure(shape, sweeps, device, tdtype, tick, stack)
            if "attention" in kinds:
                bar.set_postfix_str("attention")
                measurements["attention"] = attention.measure(
                    shape, sweeps, device, tdtype, tick, dense=bool(attention_dense)
                )
        if "links" in kinds:
            bar.set_postfix_str(f"links: {ranks} ranks")
            got = links.measure(sweeps, device, ranks, links_timeout_s, clock=links_clock)
            bar.update(len(LINK_OPS) * len(sweeps.message_bytes))
            if "skipped" in got:
                skipped["links"] = got["skipped"]
            else:
                measurements["links"] = got
        if "exchange" in kinds:
            bar.set_postfix_str(f"exchange: {ranks} ranks")
            got = exchange.measure(shape, sweeps, device, tdtype, ranks, links_timeout_s, clock=links_clock)
            bar.update(len(sweeps.exchange_tokens) * len(exchange.ROUTINGS))
            if "skipped" in got:
                skipped["exchange"] = got["skipped"]
            else:
                measurements["exchange"] = got
        if "migration" in kinds:
            bar.set_postfix_str(f"migration: {ranks} ranks")
            got = migration.measure(shape, sweeps, device, tdtype, ranks, links_timeout_s, clock=links_clock)
            bar.update(len(sweeps.migration_moves))
            if "skipped" in got:
                skipped["migration"] = got["skipped"]
            else:
                measurements["migration"] = got
        if "replication" in kinds:
            bar.set_postfix_str("replication: 2 ranks")
            got = replication.measure(shape, sweeps, device, tdtype, ranks, links_timeout_s, clock=links_clock)
            bar.update(len(sweeps.replication_copies))
            if "skipped" in got:
                skipped["replication"] = got["skipped"]
            else:
                measurements["replication"] = got
    finally:
        bar.close()
        torch.set_num_threads(saved_threads)
    fits, cost, sources = fit_all(measurements, sweeps.holdout_every, shape, hardware, bw_inter)
    if "links" not in fits:
        skipped.setdefault("links", "not requested")
    preset = CostModel.from_model(shape, hardware)
    settings = {
        **asdict(sweeps),
        "aggregate": AGGREGATE,
        "threads": info["threads"],
        "loadavg": {"start": load_start, "end": load_averages()},
        "quick": quick,
        "kernels": kinds,
        "ranks": ranks,
        "expert_stack": expert_stack,
        "attention_dense": bool(attention_dense),
        "links_clock": links_clock,
        "bw_inter": "given" if bw_inter is not None else f"preset {hardware.name} (local processes are one node)",
    }
    report = build(
        fits=fits,
        cost=cost,
        preset=preset,
        hardware=hardware,
        sources=sources,
        device=info,
        settings=settings,
        model=asdict(shape),
        profile=profile if model is None else "custom",
        skipped=skipped,
        elapsed_s=time.perf_counter() - t0,
        version=__version__,
    )
    return Calibration(cost, report, fits)


def refit(report: Dict[str, Any], hardware: Optional[Hardware] = None) -> Calibration:
    """A `Calibration` fitted anew from the measurements a report holds (its ``kernels``'
    sweeps and measured times), without measuring: what a change of the fitted model (say the
    roofline expert curve) gives on a machine measured before. ``hardware``: the preset for
    what was not measured (default `Hardware.h200`); ``bw_inter`` is the report's cost model's."""
    from routepack._core import __version__

    if not isinstance(report, dict) or not isinstance(report.get("kernels"), dict) or "model" not in report:
        raise RoutepackError("report: expected a calibration report (a dict with 'model' and 'kernels')")
    shape = ModelShape(**report["model"])
    hardware = instance_of(hardware, Hardware, "hardware") if hardware is not None else Hardware.h200()
    every = positive_int(report.get("settings", {}).get("holdout_every", 3), "report.settings.holdout_every", minimum=2)
    bw_inter = report.get("cost_model", {}).get("bw_inter")
    fits, cost, sources = fit_all(report["kernels"], every, shape, hardware, bw_inter)
    preset = CostModel.from_model(shape, hardware)
    out = build(
        fits=fits,
        cost=cost,
        preset=preset,
        hardware=hardware,
        sources=sources,
        device=report.get("device", {}),
        settings={**report.get("settings", {}), "refit": True},
        model=asdict(shape),
        profile=report.get("profile", "custom"),
        skipped=report.get("skipped", {}),
        elapsed_s=float(report.get("elapsed_s", 0.0)),
        version=__version__,
    )
    return Calibration(cost, out, fits)
