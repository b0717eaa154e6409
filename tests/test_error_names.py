"""Every error names an argument the caller passed, in the caller's words (issue 33, class 4).

An error message leads with what it is about (``window.seq_lens: ...``); that subject must be
rooted at an argument this call passed (not one left to its default, not a name of the core's
such as ``num_groups`` or ``loads``), or at the object a method or constructor belongs to
(``plan.report['token_cap']``, ``topo: dp=6 ...``). A message about a file may name the path
instead. Checked three ways over the public API:

* a sweep: each argument of a valid call of every public function, replaced in turn by
  wrong values; whatever it raises must be a `RoutepackError` whose subject passes the rule;
* fields set after construction (a `Window`'s, a `Placement`'s, a plan's report), read by
  every public function that takes the object;
* the cases the issue lists, with the exact subject each must lead with.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import re
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

import routepack as rp
from routepack import compare, placement, policies, replay
from routepack.integrations import megatron, verl
from routepack.errors import RoutepackError, RoutepackFileError
from routepack.stages.registry import STAGES

# ------------------------------------------------------------------ the rule
#: The name a method's or constructor's errors may use for the object itself, and its fields.
OWNERS: Dict[type, Tuple[str, Tuple[str, ...]]] = {
    rp.Topology: ("topo", ("dp", "ep", "gpus_per_node", "slots_per_rank")),
    rp.ModelShape: ("model", ()),
    rp.Hardware: ("hardware", ()),
    rp.CostModel: ("cost", ()),
    rp.Window: ("window", ("seq_lens", "expert_tokens", "counts", "top_k")),
    rp.Placement: ("placement", ("phy2log", "num_experts", "slots_per_rank")),
    rp.Plan: (
        "plan",
        ("placement", "sample_rank", "sample_micro", "num_micro", "replicas", "migration", "report", "policy"),
    ),
}
#: Functions whose errors may lead with a word of their own: the thing they look up.
ALSO: Dict[Callable, Tuple[str, ...]] = {rp.traces.profile: ("profile",)}
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def subject(message: str) -> str:
    """What the message is about: the text before its first ``": "`` ('' when it has none)."""
    head, sep, _ = message.partition(": ")
    return head if sep else ""


def passed_names(fn: Callable, args: tuple, kwargs: dict) -> Tuple[set, List[str]]:
    """(the names this call passed, the str forms of the paths it passed)."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except TypeError:
        bound = dict(kwargs)
    names = set()
    for name, value in bound.items():
        kind = inspect.signature(fn).parameters[name].kind
        names |= set(value) if kind is inspect.Parameter.VAR_KEYWORD else {name}
    paths = [
        str(v) for v in list(args) + list(kwargs.values()) if isinstance(v, Path) or (isinstance(v, str) and "/" in v)
    ]
    return names, paths


def owner_of(fn: Callable) -> Optional[type]:
    if isinstance(fn, type):
        return fn
    obj = getattr(fn, "__self__", None)
    if obj is not None:
        return obj if isinstance(obj, type) else type(obj)
    qual = getattr(fn, "__qualname__", "")
    return next((cls for cls in OWNERS if qual.startswith(cls.__name__ + ".")), None)


def allowed_roots(fn: Callable, args: tuple, kwargs: dict) -> Tuple[set, List[str]]:
    names, paths = passed_names(fn, args, kwargs)
    names |= set(ALSO.get(fn, ()))
    cls = owner_of(fn)
    if cls in OWNERS:
        own, fields = OWNERS[cls]
        names |= {own, *fields}
    return names - {"self", "cls"}, paths


def check_names_what_was_passed(fn: Callable, args: tuple = (), kwargs: Optional[dict] = None) -> Optional[str]:
    """Calls ``fn``; returns None when it returns, else the error's message after checking
    that it is a `RoutepackError` leading with an argument the call passed (or the object's
    name, or naming a path it passed)."""
    kwargs = kwargs or {}
    roots, paths = allowed_roots(fn, args, kwargs)
    try:
        fn(*args, **kwargs)
    except RoutepackError as e:
        message, kind = str(e), type(e).__name__
    except OSError as e:
        # a path that cannot be opened raises the usual OSError (documented), naming the path
        assert str(e.filename) in paths or any(isinstance(v, str) for v in args + tuple(kwargs.values())), e
        return str(e)
    else:
        return None
    head = subject(message)
    root = IDENT.match(head)
    ok = (root is not None and root.group(0) in roots) or any(p and p in message for p in paths)
    if not head:  # a sentence: it must still name a passed argument as an identifier
        ok = ok or any(re.search(rf"(?<![\w.]){re.escape(r)}(?=\s*[:=\[]|\.\w)", message) for r in roots)
    where = getattr(fn, "__qualname__", repr(fn))
    assert ok, f"{where}: {kind} {message!r} names none of the arguments passed {sorted(roots)}"
    return message


def test_the_rule_refuses_a_name_the_caller_did_not_pass():
    def capture(model, input_ids, attention_mask=None):
        raise RoutepackError("attention_mask: expected bool or integer, got dtype float32")

    with pytest.raises(AssertionError, match="names none of the arguments passed"):
        check_names_what_was_passed(capture, ("m", "ids"))
    assert check_names_what_was_passed(capture, ("m", "ids", "mask")).startswith("attention_mask")

    def plan(window, cost):
        raise RoutepackError("num_groups: num_experts = 128 is not a multiple of num_groups = 3")

    with pytest.raises(AssertionError):
        check_names_what_was_passed(plan, ("w", "c"))


# ------------------------------------------------------------------ valid calls of the public API
W = rp.Window(np.array([3, 4, 5, 6, 2, 7]), np.ones((6, 2, 4), np.int32), top_k=2)
TOPO = rp.Topology(2, 2, 2, 2)
MODEL = rp.ModelShape(2, 4, 1, 16, 8, attention=["linear", "full"])
COST = rp.CostModel.from_model(MODEL, rp.Hardware.h200())
CAP = 12


def a_plan(**kw: Any) -> rp.Plan:
    return rp.plan_window(W, TOPO, COST, CAP, policy=kw.pop("policy", "static"), **kw)


PLAN = a_plan()
#: the plan with equal sample counts per DP rank, as verl's split needs
EQUAL_PLAN = verl.equal_count_plan(PLAN, W, TOPO, CAP)
ROWS = compare.compare([W, W], TOPO, COST, CAP, policies=["static", "eplb_oracle"])


def synthetic(profile_name: Any, windows: Any = 1, seed: Any = 0) -> List[rp.Window]:
    """`routepack.traces.synthetic`, drawn (its checks run when the first window is)."""
    return list(rp.traces.synthetic(profile_name, windows, seed))


ROUTED = np.array([[[0]], [[1]], [[2]], [[3]], [[1]]], np.int32)


def valid_calls(tmp: Path) -> Dict[str, Tuple[Callable, tuple, dict]]:
    """name -> (function, args, kwargs) of a call that succeeds."""
    cost_path, win_path, plan_path = tmp / "cost.json", tmp / "w.npz", tmp / "p.npz"
    COST.save(cost_path)
    W.save(win_path)
    PLAN.save(plan_path)
    hw = rp.Hardware.h200()
    return {
        **OPTION_CALLS,
        "Topology": (rp.Topology, (2, 2, 2, 2), {}),
        "ModelShape": (rp.ModelShape, (2, 4, 1, 16, 8), {"attention": ["linear", "full"], "expert_groups": 2}),
        "Hardware": (rp.Hardware, (), dict(vars(hw))),
        "CostModel": (rp.CostModel, (), {f: getattr(COST, f) for f in COST.__dataclass_fields__}),
        "CostModel.from_model": (rp.CostModel.from_model, (MODEL, hw), {"weight_bytes": 2}),
        "CostModel.from_json": (rp.CostModel.from_json, (COST.to_json(),), {}),
        "CostModel.load": (rp.CostModel.load, (str(cost_path),), {}),
        "CostModel.save": (COST.save, (str(tmp / "c2.json"),), {}),
        "Window": (rp.Window, (W.seq_lens, W.expert_tokens), {"top_k": 2}),
        "Window.from_routed_experts": (rp.Window.from_routed_experts, (ROUTED, [0, 2, 5], 4), {}),
        "Window.from_verl": (rp.Window.from_verl, (ROUTED.reshape(1, 5, 1, 1), np.ones((1, 5), np.int64), 4), {}),
        "Window.from_slime": (rp.Window.from_slime, ([ROUTED[:2], ROUTED[2:]], 4), {"add_last_token": True}),
        "replay.from_slime": (replay.from_slime, ([ROUTED[:2], ROUTED[2:]], 4), {}),
        "Window.load": (rp.Window.load, (str(win_path),), {}),
        "Window.save": (W.save, (str(tmp / "w2.npz"),), {}),
        "Placement": (rp.Placement, (PLAN.placement.phy2log, 4, 2), {}),
        "Placement.static": (rp.Placement.static, (2, 4, TOPO), {}),
        "Placement.rank_experts": (PLAN.placement.rank_experts, (1, 1), {}),
        "Plan": (
            rp.Plan,
            (PLAN.placement, PLAN.sample_rank, PLAN.sample_micro, PLAN.num_micro),
            {"replicas": PLAN.replicas, "migration": PLAN.migration, "report": {}, "policy": "x"},
        ),
        "Plan.validate": (PLAN.validate, (W, TOPO, CAP), {}),
        "Plan.save": (PLAN.save, (str(tmp / "p2.npz"),), {}),
        "Plan.load": (rp.Plan.load, (str(plan_path),), {}),
        "Plan.same_as": (PLAN.same_as, (PLAN,), {}),
        "Plan.cell_samples": (PLAN.cell_samples, (1, 0), {}),
        "plan_window": (
            rp.plan_window,
            (W, TOPO, COST, CAP),
            {
                "policy": "routepack",
                "previous": PLAN.placement,
                "previous_window": W,
                "seed": 3,
                "anneal_moves": 50,
                "placement_chunks": 2,
                "replication_slots": 1,
            },
        ),
        "plan_window[eplb]": (
            rp.plan_window,
            (W, TOPO, COST, CAP),
            {"policy": "eplb", "previous_window": W, "eplb_num_groups": 2},
        ),
        "simulate": (rp.simulate, (PLAN, W, TOPO, COST), {"token_cap": CAP, "validate": True}),
        "placement.rebalance_experts": (placement.rebalance_experts, (np.ones((2, 4)), 8, 2, 1, 2), {}),
        "placement.aggregate_imbalance": (placement.aggregate_imbalance, (PLAN.placement, np.ones((2, 4))), {}),
        "placement.imbalance_lower_bound": (placement.imbalance_lower_bound, (np.ones((2, 4)), TOPO), {}),
        "traces.profile": (rp.traces.profile, ("tiny",), {}),
        "traces.synthetic": (synthetic, (replace(rp.traces.profile("tiny"), samples=8),), {"windows": 1, "seed": 2}),
        "policies.resolve": (policies.resolve, ("eplb",), {}),
        "compare.compare": (
            compare.compare,
            ([W, W], TOPO, COST, CAP),
            {"policies": ["static", "eplb"], "seed": 1, "progress": lambda label, n: None},
        ),
        "compare.summarise": (compare.summarise, (ROWS,), {"baseline": "static"}),
        "compare.format_table": (compare.format_table, (compare.summarise(ROWS),), {"baseline": "static"}),
        # the trainer integrations' numpy-only functions
        "verl.plan_batch": (verl.plan_batch, (W, TOPO, COST, CAP), {"policy": "static"}),
        "verl.equal_count_plan": (verl.equal_count_plan, (PLAN, W, TOPO, CAP), {"cost": COST}),
        "verl.balance_partitions": (verl.balance_partitions, ([EQUAL_PLAN, EQUAL_PLAN],), {}),
        "verl.balance_order": (verl.balance_order, (EQUAL_PLAN,), {}),
        "verl.balance_stats": (verl.balance_stats, (W.seq_lens, [[0, 1, 2], [3, 4, 5]]), {"prefix": "x"}),
        "verl.micro_batch_indices": (verl.micro_batch_indices, (EQUAL_PLAN, 1), {}),
        "megatron.num_moe_experts": (megatron.num_moe_experts, (PLAN,), {}),
        "megatron.local_experts": (megatron.local_experts, (PLAN.placement,), {}),
        "megatron.checkpoint_to_logical": (megatron.checkpoint_to_logical, (PLAN, 1), {}),
        "megatron.logical_to_checkpoint": (megatron.logical_to_checkpoint, (PLAN.placement, 0), {}),
    }


BAD = [None, "x", -1, 0, 2.5, float("nan"), 2**70, True, object(), [], {"a": 1}, np.zeros((2, 2))]


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    return valid_calls(tmp_path_factory.mktemp("names"))


#: Every stage's options dataclass, built with its defaults (each field in turn made wrong).
OPTION_CALLS = {
    f"stages.{stage.options.__name__}": (
        stage.options,
        (),
        {f.name: f.default for f in dataclasses.fields(stage.options)},
    )
    for table in STAGES.values()
    for stage in table.values()
    if dataclasses.fields(stage.options)
}

#: The keys of `valid_calls` (parametrize needs them before a fixture makes the calls).
CALL_NAMES = [
    "Topology",
    "ModelShape",
    "Hardware",
    "CostModel",
    "CostModel.from_model",
    "CostModel.from_json",
    "CostModel.load",
    "CostModel.save",
    "Window",
    "Window.from_routed_experts",
    "Window.from_verl",
    "Window.from_slime",
    "replay.from_slime",
    "Window.load",
    "Window.save",
    "Placement",
    "Placement.static",
    "Placement.rank_experts",
    "Plan",
    "Plan.validate",
    "Plan.save",
    "Plan.load",
    "Plan.same_as",
    "Plan.cell_samples",
    "plan_window",
    "plan_window[eplb]",
    "simulate",
    "placement.rebalance_experts",
    "placement.aggregate_imbalance",
    "placement.imbalance_lower_bound",
    "traces.profile",
    "traces.synthetic",
    "policies.resolve",
    "compare.compare",
    "compare.summarise",
    "compare.format_table",
    "verl.plan_batch",
    "verl.equal_count_plan",
    "verl.balance_partitions",
    "verl.balance_order",
    "verl.balance_stats",
    "verl.micro_batch_indices",
    "megatron.num_moe_experts",
    "megatron.local_experts",
    "megatron.checkpoint_to_logical",
    "megatron.logical_to_checkpoint",
    *OPTION_CALLS,
]


def test_the_table_covers_every_call(calls):
    assert sorted(calls) == sorted(CALL_NAMES)


@pytest.mark.parametrize("name", CALL_NAMES)
def test_the_valid_call_succeeds(calls, name):
    fn, args, kwargs = calls[name]
    assert check_names_what_was_passed(fn, args, kwargs) is None


@pytest.mark.parametrize("name", CALL_NAMES)
def test_every_argument_wrong_names_itself(calls, name, tmp_path, monkeypatch):
    """Each argument in turn replaced by each of `BAD`: a refusal names what was passed."""
    monkeypatch.chdir(tmp_path)  # a wrong path may be a valid file name: written here
    fn, args, kwargs = calls[name]
    refused = 0
    for i in range(len(args)):
        for bad in BAD:
            a = list(args)
            a[i] = bad
            refused += check_names_what_was_passed(fn, tuple(a), dict(kwargs)) is not None
    for key in kwargs:
        for bad in BAD:
            refused += check_names_what_was_passed(fn, args, {**kwargs, key: bad}) is not None
    assert refused > 0


# ------------------------------------------------------------------ fields set after construction
def window_with(**fields: Any) -> rp.Window:
    w = rp.Window(W.seq_lens.copy(), W.expert_tokens.copy(), top_k=2)
    for k, v in fields.items():
        setattr(w, k, v)
    return w


def plan_with(placement: Optional[Dict[str, Any]] = None, report: Optional[Dict[str, Any]] = None) -> rp.Plan:
    p = copy.deepcopy(PLAN)
    for k, v in (placement or {}).items():
        setattr(p.placement, k, v)
    if report is not None:
        p.report = {**p.report, **report}
    return p


WINDOW_EDITS = {
    "float seq_lens": ({"seq_lens": W.seq_lens.astype(np.float64)}, "window.seq_lens"),
    "no samples": ({"seq_lens": np.zeros(0, np.int64)}, "window.seq_lens"),
    "a length of 0": ({"seq_lens": np.array([3, 0, 5, 6, 2, 7])}, "window.seq_lens"),
    "seq_lens None": ({"seq_lens": None}, "window.seq_lens"),
    "float counts": ({"counts": np.ones((6, 2, 4))}, "window.counts"),
    "counts of another shape": ({"counts": np.ones((5, 2, 4), np.int32)}, "window.counts"),
    "negative counts": ({"counts": -np.ones((6, 2, 4), np.int32)}, "window.expert_tokens"),
    "a count above its length": ({"counts": np.full((6, 2, 4), 9, np.int32)}, "window.expert_tokens"),
    "top_k 0": ({"top_k": 0}, "window.top_k"),
}


@pytest.mark.parametrize("edit", sorted(WINDOW_EDITS))
@pytest.mark.parametrize("call", ["plan_window", "simulate", "Plan.validate"])
def test_a_window_edited_after_construction_is_named(edit, call):
    fields, want = WINDOW_EDITS[edit]
    w = window_with(**fields)
    fn, args = {
        "plan_window": (rp.plan_window, (w, TOPO, COST, CAP)),
        "simulate": (rp.simulate, (PLAN, w, TOPO, COST)),
        "Plan.validate": (PLAN.validate, (w, TOPO, CAP)),
    }[call]
    message = check_names_what_was_passed(fn, args)
    assert message is not None and subject(message) == want, message


@pytest.mark.parametrize("edit", sorted(WINDOW_EDITS))
@pytest.mark.parametrize("policy", ["eplb", "eplb_hierarchical", "routepack"])
def test_a_previous_window_edited_after_construction_is_named(edit, policy):
    fields, want = WINDOW_EDITS[edit]
    pol = rp.Policy(rp.PRESETS[policy].placement, "sequential", "none", loads="previous")
    message = check_names_what_was_passed(
        rp.plan_window, (W, TOPO, COST, CAP), {"policy": pol, "previous_window": window_with(**fields)}
    )
    assert message is not None and subject(message) == "previous_" + want, message


PLACEMENT_EDITS = {
    "slots_per_rank 0": ({"slots_per_rank": 0}, "slots_per_rank"),
    "slots_per_rank 3": ({"slots_per_rank": 3}, "slots_per_rank"),
    "slots_per_rank float": ({"slots_per_rank": 2.0}, "slots_per_rank"),
    "num_experts -1": ({"num_experts": -1}, "num_experts"),
    "num_experts None": ({"num_experts": None}, "num_experts"),
    "phy2log floats": ({"phy2log": np.zeros((2, 4))}, "phy2log"),
}


@pytest.mark.parametrize("edit", sorted(PLACEMENT_EDITS))
@pytest.mark.parametrize("call", ["simulate", "Plan.validate", "Plan.digest", "Plan.save", "previous"])
def test_a_placement_edited_after_construction_is_named(edit, call, tmp_path):
    fields, field = PLACEMENT_EDITS[edit]
    p = plan_with(placement=fields)
    fn, args, kwargs, owner = {
        "simulate": (rp.simulate, (p, W, TOPO, COST), {}, "plan.placement"),
        "Plan.validate": (p.validate, (W, TOPO, CAP), {}, "placement"),
        "Plan.digest": (p.digest, (), {}, "placement"),
        "Plan.save": (p.save, (str(tmp_path / "p"),), {}, "placement"),
        "previous": (rp.plan_window, (W, TOPO, COST, CAP), {"previous": p.placement}, "previous"),
    }[call]
    message = check_names_what_was_passed(fn, args, kwargs)
    assert message is not None and subject(message) == f"{owner}.{field}", message


@pytest.mark.parametrize(
    "junk", ["abc", 3.5, [1], {"a": 1}, -5, 0, float("nan"), float("inf"), True, 2**70, "123", np.float64(7)]
)
def test_a_junk_token_cap_in_the_report_is_named(junk):
    message = check_names_what_was_passed(rp.simulate, (plan_with(report={"token_cap": junk}), W, TOPO, COST))
    assert message is not None and subject(message) == "plan.report['token_cap']", message


def test_a_report_token_cap_that_is_a_count_is_used():
    plain = rp.simulate(plan_with(report={"token_cap": None}), W, TOPO, COST)
    capped = rp.simulate(plan_with(report={"token_cap": np.int64(CAP)}), W, TOPO, COST)
    assert capped.summary() == rp.simulate(PLAN, W, TOPO, COST, token_cap=CAP).summary()
    assert plain.ideal_time >= capped.ideal_time


# ------------------------------------------------------------------ the cases issue 33 lists
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "text, want",
    [
        (DEEP, "nested too deeply"),
        ('{"a_quad": ' + "[" * 50_000 + "]" * 50_000 + "}", "nested too deeply"),
        ('{"a_lin": ' + "9" * 6000 + "}", "not readable JSON"),
    ],
)
def test_cost_json_that_python_cannot_read_is_a_routepack_error(tmp_path, text, want):
    message = check_names_what_was_passed(rp.CostModel.from_json, (text,))
    assert message is not None and subject(message) == "cost JSON" and want in message
    path = tmp_path / "deep.json"
    path.write_text(text)
    with pytest.raises(RoutepackFileError, match=want) as e:
        rp.CostModel.load(path)
    assert str(path) in str(e.value)


def test_a_plan_report_too_deep_for_json_is_named(tmp_path):
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    p = plan_with(report={"deep": deep})
    message = check_names_what_was_passed(p.save, (str(tmp_path / "p"),))
    assert message is not None and subject(message) == "report"
    # a plan file whose report is nested too deeply (written by hand) is a damaged file
    PLAN.save(tmp_path / "ok")
    with zipfile.ZipFile(tmp_path / "ok") as src, zipfile.ZipFile(tmp_path / "bad", "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "report.npy":
                buf = io.BytesIO()
                np.save(buf, np.array(DEEP))
                data = buf.getvalue()
            dst.writestr(info, data)
    with pytest.raises(RoutepackFileError, match="report: nested too deeply"):
        rp.Plan.load(tmp_path / "bad")


@pytest.mark.parametrize("policy, option", [("eplb_oracle", None), ("eplb_oracle", 3), ("eplb_hierarchical", 3)])
def test_eplb_groups_that_do_not_divide_the_experts_name_their_source(policy, option):
    cost = replace(COST, num_experts=None, expert_groups=3)
    kwargs: Dict[str, Any] = {"policy": policy, "previous_window": W}
    if option is not None:
        kwargs["eplb_num_groups"] = option
    message = check_names_what_was_passed(rp.plan_window, (W, TOPO, cost, CAP), kwargs)
    assert message is not None and subject(message) == ("eplb_num_groups" if option else "cost.expert_groups")
    assert "num_groups" not in message.replace("eplb_num_groups", "")


def test_a_verl_batch_that_does_not_split_over_the_ranks_names_the_window():
    # the plan_batch caller passed a window, not a plan: the message is about the window
    five = rp.Window(W.seq_lens[:5], W.counts[:5], top_k=2)
    message = check_names_what_was_passed(verl.plan_batch, (five, TOPO, COST, CAP), {"policy": "static"})
    assert message is not None and subject(message) == "window" and "topo.dp=2" in message


def test_an_expert_table_array_is_taken_as_its_knots():
    knots = ((1.0, 1e-6), (8.0, 3e-6))
    base = {f: getattr(COST, f) for f in COST.__dataclass_fields__}
    as_array = rp.CostModel(**{**base, "expert_table": np.array(knots)})
    assert as_array == rp.CostModel(**{**base, "expert_table": knots})
    message = check_names_what_was_passed(rp.CostModel, (), {**base, "expert_table": np.ones((2, 3))})
    assert message is not None and subject(message) == "cost.expert_table"


# ------------------------------------------------------------------ HF capture
@pytest.fixture(scope="module")
def hf_model():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    pytest.importorskip("routepack.integrations.hf")
    cfg = tf.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=24,
        max_position_embeddings=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        head_dim=8,
    )
    torch.manual_seed(0)
    return tf.Qwen3MoeForCausalLM(cfg).eval()


def _ids(kind: str) -> Tuple[Any, Any]:
    import torch

    ids = torch.randint(3, 60, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    return {
        "float ids": (ids.float(), None),
        "float ids, a mask": (ids.float(), mask),
        "bool ids": (ids.bool(), None),
        "an id above the vocabulary": (ids + 64, None),
        "a negative id": (ids - 70, mask),
        "an id above the vocabulary at padding": (torch.where(mask.bool() & (torch.arange(5) < 4), ids, 999), mask),
        "an empty batch": (torch.zeros(0, 5, dtype=torch.long), None),
        "zero-length rows": (torch.zeros(2, 0, dtype=torch.long), None),
        "zero-length rows, a mask": (torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)),
        "a 1-D tensor": (ids[0], None),
    }[kind]


@pytest.mark.parametrize(
    "kind",
    [
        "float ids",
        "float ids, a mask",
        "bool ids",
        "an id above the vocabulary",
        "a negative id",
        "an id above the vocabulary at padding",
        "an empty batch",
        "zero-length rows",
        "zero-length rows, a mask",
        "a 1-D tensor",
    ],
)
@pytest.mark.parametrize("fn", ["capture", "capture_routed"])
def test_hf_capture_names_input_ids(hf_model, kind, fn):
    from routepack.integrations import hf

    ids, mask = _ids(kind)
    args = (hf_model, ids) if mask is None else (hf_model, ids, mask)
    message = check_names_what_was_passed(getattr(hf, fn), args)
    assert message is not None and subject(message) == "input_ids", message


def test_hf_capture_still_blames_a_mask_it_was_given(hf_model):
    import torch

    from routepack.integrations import hf

    ids = torch.randint(3, 60, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1] = 0
    message = check_names_what_was_passed(hf.capture, (hf_model, ids, mask))
    assert message is not None and subject(message) == "attention_mask"
