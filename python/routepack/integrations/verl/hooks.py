"""routepack in a running verl trainer: `install` hooks the two places verl balances.

* the driver's ``_balance_batch``, in verl's default v1 trainer (``PPOTrainer``, its batch in
  TransferQueue: `routepack.integrations.verl.v1`) and in the legacy ``RayPPOTrainer``
  (``trainer.use_v1=False``): plans each PPO mini-batch of the step from
  its routes (R3: this step's ``routed_experts``; R2: the routes the trainer recorded in the
  previous step's log-prob pass, captured from ``_compute_old_log_prob``), orders the batch
  so that verl's equal DP chunks and the workers' mini-batches are the planned ones, and
  ships the plans with the batch (`routepack.integrations.verl.plans`);
* the workers' ``verl.workers.engine.utils.prepare_micro_batches`` (and the name every
  loaded engine module bound it to): the planned microbatches of the mini-batch (or of the
  whole rank batch, in the log-prob passes), in every epoch.

Where a step cannot be planned, or a worker finds no plan, a stale one, or one its pass
cannot take, verl's own code runs and the reason is logged once per kind (logger
``routepack.integrations.verl``; `FALLBACKS` counts them). Under a DP group the ranks agree
first (one all-reduce), so they never take different paths. Config errors (an option routepack
cannot follow) raise at `install`, naming the option.

Ray runs the driver and the workers in processes of their own: pass
``routepack.integrations.verl.setup_process`` as Ray's ``worker_process_setup_hook`` (the
config line ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=...``) and the
settings in a ``routepack`` section of the trainer config (`install_from_config`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from typing import Any, Callable, Dict, Optional


from routepack._checks import positive_int
from routepack.routes.ids import renamed
from routepack.errors import RoutepackError
from routepack.integrations.shared.arrays import as_numpy, require
from routepack.integrations.shared.trainer import TrainerPlanner, plan_seconds, step_metrics, window_from_loads
from routepack.integrations.verl import megatron_engine as vm
from routepack.integrations.verl import v1
from routepack.integrations.verl.plans import PLAN_PREFIX, SAMPLE_KEY, NoPlan, StepPlans, micro_indices, step_plans
from routepack.integrations.verl.settings import _get, settings_from_config
from routepack.integrations.verl.split import balance_stats
from routepack.integrations.verl.window import window_from_verl
from routepack.routes.layers import MoELayers

LOG = logging.getLogger("routepack.integrations.verl")
#: Fallbacks to verl's own path in this process, by kind (`NoPlan.kind`).
FALLBACKS: Counter = Counter()
_LOGGED: set = set()
_ACTIVE: Optional["VerlInstall"] = None
_ORIGINALS: Dict[str, Any] = {}


def log_fallback(error: NoPlan, where: str) -> None:
    """Counts ``error`` in `FALLBACKS` and logs it the first time its kind occurs (INFO for a
    batch that was never planned, WARNING otherwise)."""
    FALLBACKS[error.kind] += 1
    if error.kind in _LOGGED:
        return
    _LOGGED.add(error.kind)
    level = logging.INFO if error.kind == "missing" else logging.WARNING
    path = "balancing (_balance_batch)" if where == "driver" else "microbatching (prepare_micro_batches)"
    LOG.log(level, "routepack (%s): %s; verl's own %s runs instead [logged once per kind]", where, error.message, path)


def reset_fallbacks() -> None:
    """Clears `FALLBACKS` and the kinds already logged (each logs again once)."""
    FALLBACKS.clear()
    _LOGGED.clear()


class VerlInstall:
    """What `install` returns: the planner, the settings read from the config, the state kept
    between steps (R2's previous routes, the last step's plans) and `report`/`uninstall`."""

    def __init__(
        self, planner: TrainerPlanner, settings: Dict[str, Any], force_group_size: int = 1, layers: Any = None
    ) -> None:
        self.planner, self.settings = planner, settings
        self.force_group_size = positive_int(force_group_size, "force_group_size")
        #: the model's MoE layers (`routepack.routes.MoELayers`), or None: every route row counted
        self.layers: Optional[MoELayers] = layers
        self.previous: Any = None  # R2: the previous step's routes (a Window)
        self.last: Optional[StepPlans] = None

    def report(self) -> Dict[str, Any]:
        """Which parts of a plan run (schedule, placement, replicas, and why not), the policy,
        and the settings read from verl's config."""
        return {"policy": self.planner.policy_name, "runs": self.planner.runs.as_dict(), **self.settings}

    def describe(self) -> str:
        """One line for a log: what runs and what does not."""
        runs = self.planner.runs
        parts = ["schedule: runs"] + [
            f"{p}: {'runs' if getattr(runs, p) else 'does not run'}" for p in ("placement", "replicas")
        ]
        note = "" if runs.placement and runs.replicas else f" ({runs.why})"
        return f"routepack on verl ({self.settings.get('trainer', 'legacy')} trainer, {runs.backend}, policy {self.planner.policy_name!r}, {self.settings['mode']}): {'; '.join(parts)}{note}"

    def plan_step(self, batch: Any, dp: int, step: int) -> StepPlans:
        """The step's `StepPlans`, or `NoPlan` where verl's own balancing must run."""
        fields = batch.batch
        s = self.settings
        try:
            if s["mode"] == "R3":
                if "routed_experts" not in fields.keys():
                    raise NoPlan(
                        "no_routes",
                        "R3: the batch has no 'routed_experts' (actor_rollout_ref.rollout.enable_rollout_routing_replay=True "
                        "records them)",
                    )
                window = window_from_verl(
                    fields, num_experts=self.planner.num_experts, mode="R3", moe_layers=self.moe_rows(fields)
                )
            else:
                if self.previous is None:
                    raise NoPlan(
                        "r2_first",
                        "R2: no routes recorded yet (the first step); later steps plan from the previous one's",
                    )
                mask = as_numpy(fields["attention_mask"], "batch['attention_mask']")
                window = window_from_loads(mask.reshape(mask.shape[0], -1).sum(axis=1), self.previous)
            plans = step_plans(
                self.planner,
                window,
                dp,
                s["minibatch_size"],
                s["token_cap"],
                step,
                self.force_group_size,
                s["multiple"],
                pack=self.planner.runs.backend == "megatron",
            )
        except RoutepackError as e:
            raise NoPlan(
                "planner",
                f"cannot plan step {step}: {e} (token_cap: actor_rollout_ref.actor.ppo_max_token_len_per_gpu times the "
                f"sequence-parallel size = {s['token_cap']})",
            ) from None
        self.last = plans
        return plans

    def moe_rows(self, fields: Any) -> Any:
        """The ``moe_layers`` of a batch's ``routed_experts`` (its row count on the layer axis)."""
        if self.layers is None:
            return None
        return self.layers.moe_layers(int(fields["routed_experts"].shape[-2]))

    def uninstall(self) -> None:
        """Restores verl's functions in this process (every module that bound the hook too)."""
        global _ACTIVE
        unpatch()
        _ACTIVE = None


def _trainer_class() -> Any:
    return require("verl.trainer.ppo.ray_trainer", "routepack.integrations.verl.install", "verl").RayPPOTrainer


# ----------------------------------------------------------------------- driver
def _balance_batch(
    self: Any, batch: Any, metrics: Dict[str, Any], logging_prefix: str = "global_seqlen", keep_minibatch: bool = False
) -> None:
    """In place of ``RayPPOTrainer._balance_batch``: the planned order, sample ids, plans and
    metrics; verl's own on `NoPlan`."""
    original = _ORIGINALS["RayPPOTrainer:_balance_batch"]
    inst = _ACTIVE if _ACTIVE is not None else _lazy_install(self)
    if inst is None:
        return original(self, batch, metrics, logging_prefix, keep_minibatch)
    torch = require("torch", "routepack.integrations.verl", "verl")
    try:
        plans = inst.plan_step(
            batch, self._get_dp_size(self.actor_rollout_wg, "actor"), int(getattr(self, "global_steps", 0))
        )
    except NoPlan as e:
        log_fallback(e, "driver")
        metrics["routepack/planned"] = 0.0
        return original(self, batch, metrics, logging_prefix, keep_minibatch)
    mask = batch.batch["attention_mask"]
    lens = mask.view(mask.shape[0], -1).sum(-1).tolist()
    batch.reorder(torch.tensor(plans.order, dtype=torch.long))
    batch.batch[SAMPLE_KEY] = torch.from_numpy(plans.sample_ids)
    batch.meta_info.update(plans.payload)
    metrics.update(balance_stats(lens, plans.partitions, logging_prefix))
    metrics.update(step_metrics(plans.plans, inst.settings["epochs"]))
    metrics["routepack/planned"] = 1.0
    metrics["timing_s/routepack_plan"] = plan_seconds(plans.plans)


def _balance_batch_v1(
    self: Any, batch: Any, metrics: Dict[str, Any], logging_prefix: str = "global_seqlen", keep_minibatch: bool = False
) -> Any:
    """In place of the v1 ``PPOTrainer._balance_batch``: the planned order, sample ids and plans;
    verl's own on `NoPlan`. Returns the (padded, reordered) ``KVBatchMeta``, as verl's does."""
    original = _ORIGINALS["PPOTrainer:_balance_batch"]
    inst = _ACTIVE if _ACTIVE is not None else _lazy_install(self)
    if inst is None:
        return original(self, batch, metrics, logging_prefix, keep_minibatch)
    torch = require("torch", "routepack.integrations.verl", "verl")
    base = sys.modules[v1.MODULE]  # verl's own names (tq, padding) as the trainer module bound them
    worker_group = self.actor_rollout_wg
    if "actor" not in worker_group._dispatch_info:  # verl's lines: the actor's DP size
        worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
    dp = max(worker_group._dispatch_info["actor"]) + 1
    batch = base.upsample_batch_to_divisible_size(
        batch, self._get_required_batch_multiple(dp), self.tokenizer.eos_token_id
    )
    step = int(getattr(self, "global_steps", 0))
    try:
        fields = v1.route_fields(base.tq, batch)
        plans = inst.plan_step(v1.Fields(fields), dp, step)
    except NoPlan as e:
        log_fallback(e, "driver")
        metrics["routepack/planned"] = 0.0
        return original(self, batch, metrics, logging_prefix, keep_minibatch)
    lens = [int(tag["seq_len"]) for tag in batch.tags]
    batch.reorder([int(i) for i in plans.order])
    ids = torch.from_numpy(plans.sample_ids)
    base.tq.kv_batch_put(
        keys=batch.keys, partition_id=batch.partition_id, fields=base.TensorDict({SAMPLE_KEY: ids}, batch_size=len(ids))
    )
    if batch.extra_info is None:
        batch.extra_info = {}
    batch.extra_info.update(plans.payload)
    metrics.update(balance_stats(lens, plans.partitions, logging_prefix))
    metrics.update(step_metrics(plans.plans, inst.settings["epochs"]))
    metrics["routepack/planned"] = 1.0
    metrics["timing_s/routepack_plan"] = plan_seconds(plans.plans)
    return batch


def _compute_old_log_prob(self: Any, batch: Any) -> Any:
    """``RayPPOTrainer._compute_old_log_prob``, then (R2) the routes it recorded kept for
    the next step's plan."""
    out = _ORIGINALS["RayPPOTrainer:_compute_old_log_prob"](self, batch)
    inst = _ACTIVE
    if inst is not None and inst.settings["mode"] == "R2":
        try:
            routes = out[0].batch.get("routed_experts", None)
            if routes is not None:
                rows = None if inst.layers is None else inst.layers.moe_layers(int(routes.shape[-2]))
                inst.previous = _recorded_window(routes, batch.batch["attention_mask"], inst.planner.num_experts, rows)
        except RoutepackError as e:
            log_fallback(NoPlan("r2_routes", f"R2: the recorded routes cannot be read ({e})"), "driver")
    return out


def _recorded_window(routes: Any, attention_mask: Any, num_experts: int, moe_layers: Any = None) -> Any:
    """A `Window` of routes recorded by the trainer (R2): a jagged nested tensor of each
    sample's real tokens ``[B, j, L, k]``, or verl's padded ``[B, T, L, k]``."""
    from routepack.window import Window

    if getattr(routes, "is_nested", False):
        flat = as_numpy(routes.values(), "routed_experts")
        cu = as_numpy(routes.offsets(), "routed_experts")
        try:
            return Window.from_routed_experts(flat, cu, num_experts, moe_layers)
        except RoutepackError as e:  # named by the recorded sample and token, not the flattened array
            raise renamed(
                e, "routed_experts", lambda t, b: (f"routed_experts[{b}]", f"token {t - int(cu[b])} (sample {b})")
            ) from None
    return window_from_verl(
        routed_experts=routes, attention_mask=attention_mask, num_experts=num_experts, mode="R2", moe_layers=moe_layers
    )


# ----------------------------------------------------------------------- workers
def _prepare_micro_batches(
    data: Any,
    dp_group: Any = None,
    num_batches_divided_by: Any = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: Any = None,
    use_dynamic_bsz_balance: bool = True,
) -> Any:
    """In place of ``verl.workers.engine.utils.prepare_micro_batches``: the planned
    microbatches (``(list of TensorDict, index lists)``, as verl returns them), or verl's own."""
    tu = require("verl.utils.tensordict_utils", "routepack.integrations.verl", "verl")
    idx: Any = None
    try:
        idx = _planned(data, tu, num_batches_divided_by, min_num_micro_batch)
    except NoPlan as e:
        reason: Optional[NoPlan] = e
    else:
        reason = None
    if dp_group is not None and same_micro_num_in_dp:
        reason = _agree(idx, reason, dp_group)
    vm.LAST_PLANNED.update(data=id(data), idx=idx if reason is None else None)
    if reason is not None:
        log_fallback(reason, "worker")
        original = _ORIGINALS["verl.workers.engine.utils:prepare_micro_batches"]
        return original(
            data, dp_group, num_batches_divided_by, same_micro_num_in_dp, min_num_micro_batch, use_dynamic_bsz_balance
        )
    return [tu.index_select_tensor_dict(data, i) for i in idx], idx


def _planned(data: Any, tu: Any, divisible_by: Any, min_micro: Any) -> Any:
    payloads = {
        k: tu.get_non_tensor_data(data, k, None)
        for k in data.keys()
        if isinstance(k, str) and k.startswith(PLAN_PREFIX)
    }
    if payloads and not tu.get_non_tensor_data(data, "use_dynamic_bsz", True):
        raise NoPlan("static", "use_dynamic_bsz: False in this pass (verl's fixed micro_batch_size_per_gpu path)")
    ids = as_numpy(data[SAMPLE_KEY], SAMPLE_KEY) if SAMPLE_KEY in data.keys() else None
    input_ids = data.get("input_ids", None)
    if input_ids is not None and getattr(input_ids, "is_nested", False):
        lengths = as_numpy(input_ids.offsets().diff(), "input_ids")
    else:
        mask = as_numpy(data["attention_mask"], "attention_mask")
        lengths = mask.reshape(mask.shape[0], -1).sum(axis=1)
    cap = None
    if "max_token_len_per_gpu" in data.keys():
        cap = int(tu.get_non_tensor_data(data, "max_token_len_per_gpu", 0)) * int(
            tu.get_non_tensor_data(data, "sp_size", 1)
        )
    group = int(tu.get_non_tensor_data(data, "force_group_size", 1))
    idx = micro_indices(ids, payloads, lengths, cap, divisible_by, group)
    if min_micro is not None and len(idx) < int(min_micro):
        raise NoPlan(
            "min_micro", f"min_num_micro_batch: the plan has {len(idx)} microbatches, this pass needs {min_micro}"
        )
    return idx


def _agree(idx: Any, reason: Optional[NoPlan], dp_group: Any) -> Optional[NoPlan]:
    """One all-reduce over the DP group: every rank takes the plan (with the same count) or none does."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return reason
    from verl.utils.device import get_device_name

    count = len(idx) if idx is not None else 0
    device = "cpu" if dist.get_backend(dp_group) == "gloo" else get_device_name()
    flags = torch.tensor([0 if reason is None else 1, count, -count], dtype=torch.long, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=dp_group)
    if reason is None and (int(flags[0]) or int(flags[1]) != -int(flags[2])):
        return NoPlan(
            "disagree", "another DP rank of the group cannot take the plan (dp_group: every rank takes verl's path)"
        )
    return reason


# ----------------------------------------------------------------------- install
def _patch(owner: Any, name: str, new: Callable) -> None:
    """Sets ``owner.name`` to ``new``, keeping verl's original (once, for good) in `_ORIGINALS`."""
    key = f"{getattr(owner, '__name__', owner)}:{name}"
    current = getattr(owner, name)
    if current is not new:
        _ORIGINALS.setdefault(key, current)
    setattr(owner, name, new)


def unpatch() -> None:
    """Puts verl's functions back wherever a hook of this module sits."""
    vm.unpatch_engine()
    hooks = {_prepare_micro_batches: "verl.workers.engine.utils:prepare_micro_batches"}
    for name, module in list(sys.modules.items()):
        if name.startswith("verl.workers.engine") and getattr(module, "prepare_micro_batches", None) in hooks:
            setattr(module, "prepare_micro_batches", _ORIGINALS[hooks[module.prepare_micro_batches]])
    base = sys.modules.get(v1.MODULE)
    if base is not None and base.PPOTrainer.__dict__.get("_balance_batch") is _balance_batch_v1:
        base.PPOTrainer._balance_batch = _ORIGINALS["PPOTrainer:_balance_batch"]
    trainer = sys.modules.get("verl.trainer.ppo.ray_trainer")
    if trainer is not None:
        cls = trainer.RayPPOTrainer
        for name, hook in (("_balance_batch", _balance_batch), ("_compute_old_log_prob", _compute_old_log_prob)):
            if cls.__dict__.get(name) is hook:
                setattr(cls, name, _ORIGINALS[f"RayPPOTrainer:{name}"])


def patch_workers() -> None:
    """Hooks ``prepare_micro_batches`` in this process: verl's engine utils and every loaded
    engine module that imported it (engines imported later take the hooked one)."""
    utils = require("verl.workers.engine.utils", "routepack.integrations.verl.install", "verl")
    _patch(utils, "prepare_micro_batches", _prepare_micro_batches)
    vm.patch_engine()
    original = _ORIGINALS["verl.workers.engine.utils:prepare_micro_batches"]
    for name, module in list(sys.modules.items()):
        if name.startswith("verl.workers.engine.") and getattr(module, "prepare_micro_batches", None) is original:
            setattr(module, "prepare_micro_batches", _prepare_micro_batches)


def patch_driver() -> Dict[str, str]:
    """Hooks the legacy ``RayPPOTrainer._balance_batch`` and ``_compute_old_log_prob`` and the
    v1 ``PPOTrainer._balance_batch`` in this process. Returns ``{"legacy"/"v1": "hooked" or why
    not}``; raises ImportError where neither trainer imports."""
    done: Dict[str, str] = {}
    for name, hook in (
        ("legacy", _patch_legacy),
        ("v1", lambda: _patch(v1.trainer_class(), "_balance_batch", _balance_batch_v1)),
    ):
        try:
            hook()
            done[name] = "hooked"
        except ImportError as e:
            done[name] = f"does not import here ({e})"
    if "hooked" not in done.values():
        raise ImportError(f"verl's trainers do not import: {done}")
    return done


def _patch_legacy() -> None:
    cls = _trainer_class()
    _patch(cls, "_balance_batch", _balance_batch)
    _patch(cls, "_compute_old_log_prob", _compute_old_log_prob)


def install(
    config: Any,
    cost: Any,
    *,
    num_experts: Optional[int] = None,
    policy: Any = "auto",
    force_group_size: int = 1,
    driver: bool = True,
    workers: bool = True,
    model_config: Any = None,
    **planner_options: Any,
) -> VerlInstall:
    """Plans every step of a verl PPO run in this process (see the module docstring).

    Args:
        config:  verl's trainer config (``RayPPOTrainer.config``: OmegaConf or nested dicts);
                 read by `settings_from_config`, which refuses settings routepack cannot follow.
        cost:    the `routepack.CostModel`, or the path of one saved as JSON (a calibration).
        num_experts: E (default ``cost.num_experts``).
        policy:  ``"auto"`` (what the backend runs: the schedule alone on FSDP) or a policy the
                 backend runs (`backend_policy` refuses the others, naming them).
        force_group_size: consecutive samples that share a microbatch (verl's reward-model
                 pairs); plans keep them together.
        driver, workers: hook the driver's ``_balance_batch`` / the workers' microbatching.
        model_config: the model's config (transformers or Megatron), for which layers route
                 (`routepack.routes.MoELayers`: dense layers' zero rows are not counted, plans
                 are keyed by MoE layer); default: the transformers config in the local
                 checkpoint ``actor_rollout_ref.model.path``, where there is one; otherwise
                 every route row is an MoE layer.
        planner_options: `TrainerPlanner`'s (``ep``, ``gpus_per_node``, ``slots_per_rank``
                 override the config's; ``seed``, ``anneal_moves``, ``time_budget_s``, stage options).

    Returns the `VerlInstall` (``.report()``: which parts run; ``.uninstall()``).
    """
    global _ACTIVE
    settings = settings_from_config(config)
    opts = {"ep": settings["ep"], "gpus_per_node": settings["gpus_per_node"], **planner_options}
    blocked = dict(settings["blocked"])
    if settings["backend"] == "megatron":
        lay = settings["layout"]
        if "placement" not in blocked:  # the workers build the layout: plan for exactly it
            if opts.get("slots_per_rank") is None and lay["slots_per_rank"] is not None:
                opts["slots_per_rank"] = lay["slots_per_rank"]
            opts["replica_slots"] = lay["replica_slots"]
    ckpt = blocked.pop("optimizer_ckpt", None)
    planner = TrainerPlanner(cost, settings["backend"], num_experts=num_experts, policy=policy, blocked=blocked, **opts)
    if settings["backend"] == "megatron" and planner.runs.placement:
        built = settings["layout"]["slots_per_rank"] or -(-planner.num_experts // planner.ep)
        if planner.slots_per_rank != built:
            raise RoutepackError(
                f"slots_per_rank: {planner.slots_per_rank}, but the workers build {built} slots per EP rank "
                f"(actor_rollout_ref.actor.megatron.override_mcore_model_config.{vm.LAYOUT_KEY}.slots_per_rank); "
                "set it there"
            )
    extra_slots = planner.slots_per_rank * planner.ep > planner.num_experts or bool(planner.replica_slots)
    if ckpt is not None and planner.runs.placement and extra_slots:
        raise RoutepackError(ckpt + "; save ['model', 'extra'] or use slots_per_rank = E / ep and replica_slots = 0")
    inst = VerlInstall(planner, settings, force_group_size, _moe_layers(config, model_config))
    trainer = "v1" if v1.uses_v1(config) else "legacy"
    if driver:
        if trainer == "v1":
            v1.check_config(config, settings["mode"])
        hooked = patch_driver()
        if hooked[trainer] != "hooked":
            raise RoutepackError(f"trainer.use_v1={trainer == 'v1'}: verl's {trainer} trainer {hooked[trainer]}")
    settings["trainer"] = trainer
    if workers:
        patch_workers()
    _ACTIVE = inst
    LOG.info("%s", inst.describe())
    return inst


def _moe_layers(config: Any, model_config: Any) -> Optional[MoELayers]:
    """The model's `MoELayers`: from ``model_config``, else from the transformers config of the
    local checkpoint verl trains (``actor_rollout_ref.model.path``), else None."""
    if model_config is not None:
        return MoELayers.from_config(model_config)
    path = _get(config, "actor_rollout_ref.model.path")
    if not isinstance(path, str) or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    try:
        from transformers import AutoConfig  # type: ignore[import-untyped]
    except ImportError:
        return None
    trust = bool(_get(config, "actor_rollout_ref.model.trust_remote_code", False))
    return MoELayers.from_config(AutoConfig.from_pretrained(path, trust_remote_code=trust))


def install_from_config(config: Any) -> VerlInstall:
    """`install` with its arguments from the config's ``routepack`` section: ``cost`` (path of
    a `routepack.CostModel` JSON, required), and optionally ``num_experts``, ``policy``,
    ``slots_per_rank``, ``seed``, ``anneal_moves``, ``time_budget_s``."""
    section = _get(config, "routepack")
    if section is None or _get(section, "cost") is None:
        raise RoutepackError("routepack.cost: the trainer config has no routepack section with a cost model path")
    kwargs = {
        k: _get(section, k)
        for k in ("num_experts", "slots_per_rank", "seed", "anneal_moves", "time_budget_s")
        if _get(section, k) is not None
    }
    return install(config, str(_get(section, "cost")), policy=_get(section, "policy", "auto"), **kwargs)


_LAZY = False


def _lazy_install(trainer: Any) -> Optional[VerlInstall]:
    """Under `setup_process`: the installation, made from the trainer's config at its first step."""
    if not _LAZY:
        return None
    return install_from_config(trainer.config)


def setup_process() -> None:
    """For Ray's ``worker_process_setup_hook`` (runs in every Ray worker process): hooks the
    workers' microbatching and, where verl's trainer imports, the driver's balancing, which
    installs itself from the trainer config's ``routepack`` section at the first step."""
    global _LAZY
    _LAZY = True
    patch_workers()
    try:
        LOG.info("routepack: verl's trainers: %s", patch_driver())
    except ImportError as e:  # a worker process without the trainer's own dependencies
        LOG.info("routepack: verl's trainer does not import here (%s); only the workers are hooked", e)


def active() -> Optional[VerlInstall]:
    """The installation in force in this process, or None."""
    return _ACTIVE


__all__ = [
    "FALLBACKS",
    "VerlInstall",
    "active",
    "install",
    "install_from_config",
    "log_fallback",
    "patch_driver",
    "patch_workers",
    "reset_fallbacks",
    "settings_from_config",
    "setup_process",
]
