"""Fitting measured kernel times to the cost model's coefficients, one module per kernel kind.

Each ``fit_<kind>`` takes that kind's measurement (``sweep``: one dict of sweep variables per
point; ``measured_s``: its median time) and returns a `KernelFit`: the coefficients, the
times the fitted model predicts at every point, which points were held out, and the
`CostModel` fields the coefficients set (``cost_fields``):

* `routepack.calibrate.fit.expert_gemm`: ``c_tok``, ``c_exp``, ``c_weights``, ``c_gemm``,
  ``c_call``, ``expert_table`` (the roofline, the GEMM step or the table);
* `routepack.calibrate.fit.attention`: ``a_lin``, ``a_quad``;
* `routepack.calibrate.fit.links`: ``bw_intra``, ``a2a_latency``, ``bw_reduce``, ``reduce_latency``;
* `routepack.calibrate.fit.exchange`: the layer's ``a2a_latency``, ``bw_intra`` and ``a_lin``,
  against what the others priced;
* `routepack.calibrate.fit.migration`: ``migration_latency`` and ``c_migrate``, against the
  link bandwidth the others priced;
* `routepack.calibrate.fit.replication`: ``c_replica``, against the link bandwidth the others
  priced;
* `routepack.calibrate.fit.common`: what they share (held-out points, the non-negative least
  squares on relative residuals, `KernelFit`).

`FITS` maps each kind to its function, so a richer model of one kernel replaces one entry and
leaves the others alone; `to_cost_model` merges the fields of whatever was fitted into
`CostModel.from_model`'s coefficients; `fit_all` fits every kind measured, the exchange last.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from routepack.calibrate.fit.attention import fit_attention
from routepack.calibrate.fit.common import COMPUTE_PASSES, KernelFit, holdout_mask
from routepack.calibrate.fit.exchange import fit_exchange
from routepack.calibrate.fit.expert_gemm import fit_expert_gemm
from routepack.calibrate.fit.links import LINK_OPS, fit_links
from routepack.calibrate.fit.migration import fit_migration
from routepack.calibrate.fit.replication import fit_replication
from routepack.errors import RoutepackError
from routepack.model import CostModel, Hardware, ModelShape

#: kernel kind -> its fitting function ``(measurement, holdout_every, model) -> KernelFit``.
FITS: Dict[str, Callable[[Mapping[str, Any], int, ModelShape], KernelFit]] = {
    "expert_gemm": fit_expert_gemm,
    "attention": fit_attention,
    "links": fit_links,
}


def fit_all(
    measurements: Mapping[str, Mapping[str, Any]],
    holdout_every: int,
    model: ModelShape,
    hardware: Optional[Hardware] = None,
    bw_inter: Optional[float] = None,
) -> Tuple[Dict[str, KernelFit], CostModel, Dict[str, str]]:
    """Every measured kind fitted (`FITS`), the cost model they give (`to_cost_model`) and
    where each field came from; then the ``exchange`` (where measured) against that model
    (`fit_exchange`), its fields in place, and the ``migration`` (where measured) against the
    link bandwidth so priced (`fit_migration`), and the ``replication`` likewise
    (`fit_replication`)."""
    fits = {kind: FITS[kind](m, holdout_every, model) for kind, m in measurements.items() if kind in FITS}
    cost, sources = to_cost_model(model, fits, hardware, bw_inter)
    if "exchange" in measurements:
        fits["exchange"] = fit_exchange(measurements["exchange"], holdout_every, model, cost)
        cost = replace(cost, **fits["exchange"].cost_fields)
        for name in fits["exchange"].cost_fields:
            sources[name] = "measured: exchange" + (f" (on {sources[name]})" if name == "a_lin" else "")
    if "migration" in measurements:
        fits["migration"] = fit_migration(measurements["migration"], holdout_every, model, cost)
        cost = replace(cost, **fits["migration"].cost_fields)
        for name in fits["migration"].cost_fields:
            sources[name] = "measured: migration"
    if "replication" in measurements:
        fits["replication"] = fit_replication(measurements["replication"], holdout_every, model, cost)
        cost = replace(cost, **fits["replication"].cost_fields)
        for name in fits["replication"].cost_fields:
            sources[name] = "measured: replication"
    return fits, cost, sources


def to_cost_model(
    model: ModelShape,
    fits: Mapping[str, KernelFit],
    hardware: Optional[Hardware] = None,
    bw_inter: Optional[float] = None,
    weight_bytes: float = 2,
) -> Tuple[CostModel, Dict[str, str]]:
    """`CostModel.from_model` (byte counts and whatever was not measured, from ``hardware``,
    default `Hardware.h200`) with the fitted fields in place, and where each field came
    from: ``measured: <kind>``, ``given`` (``bw_inter``) or ``preset <name>``."""
    hardware = hardware or Hardware.h200()
    base = CostModel.from_model(model, hardware, weight_bytes)
    sources = {name: f"preset {hardware.name}" for name in base.__dataclass_fields__}
    for name in (
        "token_bytes",
        "expert_weight_bytes",
        "expert_grad_bytes",
        "expert_state_bytes",
        "expert_groups",
        "num_experts",
    ):
        if name in sources:
            sources[name] = "model shape"
    fields: Dict[str, Any] = {}
    for kind, fit in fits.items():
        for name, value in fit.cost_fields.items():
            if name in fields:
                raise RoutepackError(f"fits: {kind} and {sources[name]} both set cost.{name}")
            fields[name] = value
            sources[name] = f"measured: {kind}"
    if bw_inter is not None:
        fields["bw_inter"] = bw_inter
        sources["bw_inter"] = "given (--bw-inter)"
    return replace(base, **fields), sources


__all__ = [
    "COMPUTE_PASSES",
    "FITS",
    "LINK_OPS",
    "KernelFit",
    "fit_all",
    "fit_attention",
    "fit_exchange",
    "fit_expert_gemm",
    "fit_links",
    "fit_migration",
    "fit_replication",
    "holdout_mask",
    "to_cost_model",
]
