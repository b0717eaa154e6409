"""`routepack measure`: executes the MoE layers of a sequence of windows' plans for real and
compares the measured times, part by part, with the cost model's predictions.

For a small MoE model (`Workload`: ``windows`` windows with recorded routing whose hot
experts drift, one EP group of ``ranks`` local processes in ``nodes`` "nodes", gloo on CPU,
one core each), `measure`:

1. calibrates the cost model on this machine for the workload's shapes (`routepack.calibrate`:
   the expert GEMM as a rank of `routepack.torch.EPMoE` runs it (`grouped_swiglu` over a
   stack of ``slots_per_rank`` slots), the MoE layer's work on its tokens at the origin rank
   (gather, gate-weighted combine, residual: the ``attention`` kernel without a dense layer,
   ``a_lin``; the layers have no attention), the links between ``ranks`` processes (the
   all-reduce's bandwidth and latency too), the exchange (one `EPMoE` layer on every rank,
   its time outside the expert kernel: the all-to-all's fixed cost in the layer,
   ``a2a_latency``, and the per-token work the origin sweep misses, added to ``a_lin``) and
   the migration (`routepack.torch.migrate` moving experts with their Adam state:
   ``migration_latency``, ``c_migrate``), on the clock the run is judged by (CPU time on
   CPU)); or reads the calibration an earlier run of the same shapes wrote (``calibration=``);
   or takes a given `CostModel`, whose attention and dense work are set to 0;
2. plans every window with each policy (default ``static`` and ``routepack``; any preset, e.g.
   ``eplb_oracle``) under that model, each window's plan migrating from the placement the
   policy left (`routepack.measure.workload.plan_windows`);
3. runs every plan's microbatches forward and backward through `EPMoE` layers driven by a
   `routepack.torch.PlanRunner` in ``ranks`` spawned processes (`routepack.measure.execute`):
   the migration at each window's start, the routes computed once from the replayed ids, the
   replicas and the redundant experts' sum as the plan asks; every microbatch cut into its
   parts (`routepack.torch.profile`, `routepack.parts`);
4. predicts each microbatch's time and terms with `routepack.simulate` on the plan cut to
   that microbatch (`micro_plan`, `predict`), and each window's step (migration included)
   with the whole plan.

Times are each rank's CPU time, the slowest rank's kept (`routepack.measure.execute` says
why: the wall clock of a shared machine measures its other work; it is reported too); the
prediction then prices replication exposed in full (``replica_prefetch`` off: the CPU time
counts the transfers' work whenever it runs). A window's measured step is its migration + Σ
microbatches + ``finish_step``; the per-microbatch comparison adds an equal share of
``finish_step`` to every microbatch, and puts the once-per-step sum of redundant experts'
gradients (`SimResult.redundant_grads`) in the last microbatch, whose backward does it. The
run's step is the sum over its windows; speed-ups are a reference policy's time over each
plan's (`format_table`), the per-part profile beside the terms (`parts_table`).
"""

from routepack.measure.report import format_table, parts_table
from routepack.measure.run import Measurement, measure, micro_plan
from routepack.measure.workload import Workload

__all__ = ["Measurement", "Workload", "format_table", "measure", "micro_plan", "parts_table"]
