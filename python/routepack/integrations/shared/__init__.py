"""What the trainer and backend packages of `routepack.integrations` share (internal):

* `arrays`: a trainer's tensors as numpy without importing torch, an optional framework
  imported with the extra that installs it named, a plan's cells in execution order;
* `trainer`: `TrainerPlanner` (one trainer step planned with the policy its backend runs),
  `backend_policy` / `backend_runs`, `step_metrics`;
* `layout`: the layouts a trainer dictates applied to a plan (`relayout`, `align_steps`,
  `fixed_size_layout`, `clamp_oversize`);
* `equal_counts`: equal sample counts per DP rank (verl's equal chunks).

numpy and the plan types only; it imports no trainer or backend package (the layering is in
`routepack.integrations`' docstring and tests/test_integrations_layering.py).
"""
