"""The parts of an MoE layer's work on a rank that `routepack.torch.profile` times apart, and
the cost-model term that prices each (`routepack.measure` puts them side by side). Torch-free,
so the measured run's report reads it without torch.

Parts (`PARTS`) and the cost-model term that prices each (`PRICED_BY`, docs/design.md):

* ``route``: the routing checks and remap (`remap.route_tokens`, or the precomputed route's
  checks): the exchange's fixed cost (``a2a_latency``, fitted on the whole layer);
* ``gather`` / ``combine``: the routed copies gathered in send order at the origin, and their
  gate-weighted sum: ``a_lin`` (the attention term's per-token part);
* ``all_to_all``: dispatch and combine, forward and backward: the all-to-all term;
* ``unit_sort``: received rows sorted by compute unit and back: ``a_lin`` (the exchange's
  ``a_lin_extra``);
* ``expert``: the rank's one grouped kernel call over its local slots and its replica copies:
  the expert term (``c_call`` per call, ``c_exp`` per active expert, ``c_tok`` per token);
* ``replica_fill``: replica weights posted, relayed and received: the replication term (forward);
* ``replica_grads``: replica gradients returned along their chains: the replication term
  (backward);
* ``redundant_sum``: the step's all-reduce of redundant experts' gradients: ``redundant_grads``;
* ``slot_grads``: completing the slots' gradients in fp32 (replica parts added, redundant
  slots kept back until the step's sum): not priced;
* ``other``: what the marks leave between layers (the caller's residual add, the loss).
"""

from __future__ import annotations

from typing import Dict, Optional

#: The parts, in a layer's forward order.
PARTS = (
    "route",
    "gather",
    "all_to_all",
    "replica_fill",
    "unit_sort",
    "expert",
    "combine",
    "replica_grads",
    "slot_grads",
    "redundant_sum",
    "other",
)
#: part -> the `SimResult` term that prices it (None: not priced).
PRICED_BY: Dict[str, Optional[str]] = {
    "route": "all_to_all",
    "gather": "attention",
    "all_to_all": "all_to_all",
    "replica_fill": "replication",
    "unit_sort": "attention",
    "expert": "expert",
    "combine": "attention",
    "replica_grads": "replication",
    "slot_grads": None,
    "redundant_sum": "redundant_grads",
    "other": None,
}
