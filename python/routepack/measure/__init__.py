"""`routepack measure`: executes the MoE layers of a window's plans for real and compares the
measured times with the cost model's predictions.

For a small MoE model (`Workload`: its window with recorded routing, one EP group of
``ranks`` local processes, gloo on CPU, one core each), `measure`:

1. calibrates the cost model on this machine for the workload's shapes (`routepack.calibrate`:
   the expert GEMM as a rank of `routepack.torch.EPMoE` runs it (`grouped_swiglu` over a
   stack of ``slots_per_rank`` slots), the MoE layer's work on its tokens at the origin rank
   (gather, gate-weighted combine, residual: the ``attention`` kernel without a dense layer,
   ``a_lin``; the layers have no attention), the links between ``ranks`` processes and the
   exchange (one `EPMoE` layer on every rank, its time outside the expert kernel: the
   all-to-all's fixed cost in the layer, ``a2a_latency``, and the per-token work the origin
   sweep misses, added to ``a_lin``), on the clock the run is judged by (CPU time on CPU)),
   or takes a given `CostModel`, whose attention and dense work are set to 0 (only the MoE
   layers run);
2. plans the window with each policy (default ``static`` and ``routepack``) under that model;
3. runs every plan's microbatches forward and backward through `EPMoE` layers driven by a
   `routepack.torch.PlanRunner` in ``ranks`` spawned processes (`routepack.measure.execute`);
4. predicts each microbatch's time with `routepack.simulate` on the plan cut to that
   microbatch (`micro_plan`), and the step's with the whole plan.

Times are each rank's CPU time, the slowest rank's kept (`routepack.measure.execute` says
why: the wall clock of a shared machine measures its other work; it is reported too). The
measured step is Σ microbatches + ``finish_step``; the per-microbatch comparison adds an equal
share of ``finish_step`` to every microbatch, and puts the once-per-step sum of redundant
experts' gradients (`SimResult.redundant_grads`) in the last microbatch, whose backward does it. Speed-ups are static's time over each plan's.
"""

from routepack.measure.report import format_table, parts_table
from routepack.measure.run import Measurement, measure, micro_plan
from routepack.measure.workload import Workload

__all__ = ["Measurement", "Workload", "format_table", "measure", "micro_plan", "parts_table"]
