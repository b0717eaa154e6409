"""`routepack calibrate`: measures the cost model's coefficients on this machine.

`calibrate` (`routepack.calibrate.calibration`) times, with torch, the kernels the cost model prices (docs/design.md,
"Calibration"):

* ``expert_gemm`` (`routepack.calibrate.expert_gemm`): the routed experts of one EP rank in
  `routepack.torch.EPMoE`'s layout, forward + backward, over tokens per expert × active
  experts → ``c_tok``, ``c_exp``, ``c_weights``, ``c_gemm``, ``c_call``, ``expert_table``;
* ``attention`` (`routepack.calibrate.attention`): one full-attention layer (projections,
  causal SDPA, shared experts) and the MoE layer's work at the origin rank (gather, combine,
  residual) over sample lengths → ``a_lin``, ``a_quad``;
* ``links`` (`routepack.calibrate.links`): point-to-point, all-to-all and all-reduce between
  local processes (gloo on CPU, NCCL on CUDA) over message sizes → ``bw_intra``,
  ``a2a_latency``, ``bw_reduce``;
* ``exchange`` (`routepack.calibrate.exchange`, on request: `routepack.measure` asks for it):
  one MoE layer of `routepack.torch.EPMoE` between local processes, its time outside the
  expert kernel over tokens per rank and the share of them sent away → ``a2a_latency`` and
  ``bw_intra`` as the layer pays them (in place of the links') and what it adds to ``a_lin``;
* ``migration`` (`routepack.calibrate.migration`, on request: `routepack.measure` asks for it):
  experts with their Adam state swapped between two ranks by `routepack.torch.migrate`, over
  the experts moved → ``migration_latency`` and ``c_migrate`` (what a migration costs a rank
  beyond its bytes' link time).

`routepack.calibrate.fit` fits each kind with its own module (every k-th point held out
and only predicted; the exchange last, against what the others priced) and builds a
`CostModel`; whatever is not measured (``bw_inter``, the byte counts) comes from
`CostModel.from_model` with the hardware preset, or ``bw_inter`` as given. `routepack.calibrate.report` writes the report JSON and the figure. torch is
imported only when `calibrate` runs (``pip install 'routepack[torch]'``).
"""

from routepack.calibrate.calibration import ALL_KERNELS, KERNELS, Calibration, calibrate, refit
from routepack.calibrate.sweeps import Sweeps

__all__ = ["ALL_KERNELS", "Calibration", "KERNELS", "Sweeps", "calibrate", "refit"]
