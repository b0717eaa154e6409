"""Migration moves optimizer state for any torch.optim optimizer keyed by parameter, and
refuses, on every rank and naming the parameter or state key, state it cannot map (issue 16,
item 2). 2 gloo processes, 2 MoE layers, 4 experts in 6 slots (2 redundant).

For each optimizer: model A and its twin B step once with the same logical gradients; A
migrates to another placement; both step again. A's logical weights must equal B's bit for
bit: every per-slot state tensor moved with its expert, and per-parameter scalars (``step``,
ASGD's ``eta``/``mu``, NAdam's ``mu_product``) stayed."""

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import numpy as np  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.plan import Placement, Plan  # noqa: E402
from routepack.torch import EPMoE, migrate  # noqa: E402
import selfcheck as sc  # noqa: E402

L, E, H, I, SPR = 2, 4, 8, 4, 3
OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {"lr": 1e-2}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "SGD_momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "Adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "NAdam": (torch.optim.NAdam, {"lr": 1e-2}),
    "RAdam": (torch.optim.RAdam, {"lr": 1e-2}),
    "ASGD": (torch.optim.ASGD, {"lr": 1e-2}),
    "Rprop": (torch.optim.Rprop, {"lr": 1e-2}),
}
#: optimizers whose step couples the rows of a stacked parameter (Adafactor scales by the whole
#: tensor's RMS), so a placement change alters their trajectory whatever the glue does: for
#: them only the bytes are checked (every expert's weights and state identical, elsewhere)
COUPLED = {"Adafactor"}
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZERS["Adafactor"] = (torch.optim.Adafactor, {"lr": 1e-2})


def _placements(topo):
    rng = np.random.default_rng(7)
    rows = [rng.permutation(np.concatenate([np.arange(E), rng.choice(E, topo.num_slots - E)])) for _ in range(L)]
    return Placement.static(L, E, topo), Placement(np.stack(rows).astype(np.int32), E, SPR)


def _model(topo, placement, w1, w2):
    layers = [EPMoE(l, E, H, I, topo, placement.phy2log[l]) for l in range(L)]
    for l, mod in enumerate(layers):
        mod.load_logical(w1[l], w2[l])
    return layers


def _set_grads(layers, g1, g2):
    for l, mod in enumerate(layers):
        for s, e in enumerate(mod.local_experts().tolist()):
            mod.w1.grad = mod.w1.grad if mod.w1.grad is not None else torch.zeros_like(mod.w1)
            mod.w2.grad = mod.w2.grad if mod.w2.grad is not None else torch.zeros_like(mod.w2)
            mod.w1.grad[s] = g1[l, max(e, 0)]
            mod.w2.grad[s] = g2[l, max(e, 0)]


def _raised(fn):
    try:
        fn()
    except rp.RoutepackError as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"OTHER {type(e).__name__}: {e}"
    return "nothing"


def check_optimizers(rank, world, device):
    topo = rp.Topology(world, world, world, SPR)
    start, nxt = _placements(topo)
    plan = Plan(
        nxt,
        np.arange(world, dtype=np.int32),
        np.zeros(world, dtype=np.int32),
        1,
        migration=sc.migration_rows(start, nxt),
    )
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(L, E, H, 2 * I, generator=g), torch.randn(L, E, I, H, generator=g)
    grads = [(torch.randn(L, E, H, 2 * I, generator=g), torch.randn(L, E, I, H, generator=g)) for _ in range(2)]
    out = {"moved": int(plan.migration.size), "equal": {}, "moved_state": {}, "errors": {}}
    for name, (cls, kw) in OPTIMIZERS.items():
        a, b = _model(topo, start, w1, w2), _model(topo, start, w1, w2)
        oa = cls([p for m in a for p in (m.w1, m.w2)], **kw)
        ob = cls([p for m in b for p in (m.w1, m.w2)], **kw)
        for step, (g1, g2) in enumerate(grads):
            if step == 1:
                before = sc.fingerprints(a, oa)
                migrate(a, plan, oa)
                after = sc.fingerprints(a, oa)
                out["moved_state"][name] = (
                    set(after) == set(before)
                    and len(oa.state[a[0].w1]) > 0
                    and all(len(before[k]) == 1 and after[k] == before[k] for k in before)
                )
            for layers, opt in ((a, oa), (b, ob)):
                _set_grads(layers, g1, g2)
                opt.step()
        la, lb = sc.logical_weights(a), sc.logical_weights(b)
        out["equal"][name] = name in COUPLED or set(la) == set(lb) and all(np.array_equal(la[k], lb[k]) for k in lb)

    # state the glue cannot map: refused by every rank, nothing moved
    layers = _model(topo, start, w1, w2)
    masters = [p.detach().clone() for m in layers for p in (m.w1, m.w2)]  # a flat fp32 master copy
    out["errors"]["not_owned"] = _raised(lambda: migrate(layers, plan, torch.optim.Adam(masters)))
    opt = torch.optim.Adam([p for m in layers for p in (m.w1, m.w2)])
    _set_grads(layers, *grads[0])
    opt.step()
    if rank == world - 1:  # only one rank holds the odd entry: its peers must not hang
        opt.state[layers[1].w2]["flat_shard"] = torch.zeros(5)
    out["errors"]["odd_key"] = _raised(lambda: migrate(layers, plan, opt))
    out["errors"]["not_an_optimizer"] = _raised(lambda: migrate(layers, plan, {"state": {}}))
    out["intact"] = all(np.array_equal(m.phy2log, start.phy2log[l]) for l, m in enumerate(layers))
    return out


def test_any_torch_optimizer_state_moves_with_its_experts():
    out = sc.run_ranks(check_optimizers, 2, join_timeout_s=240, pg_timeout_s=60)
    assert out[0]["moved"] > 0
    for rank, f in out.items():
        assert all(f["equal"].values()), (rank, f["equal"])
        assert all(f["moved_state"].values()) and len(f["moved_state"]) == len(OPTIMIZERS), (rank, f["moved_state"])
        assert f["intact"], rank
        errs = f["errors"]
        assert errs["not_owned"].startswith("RoutepackError") and "layers[0].w1" in errs["not_owned"], errs
        if rank == 1:
            assert "layers[1].w2" in errs["odd_key"] and "'flat_shard'" in errs["odd_key"], errs
        else:
            assert errs["odd_key"].startswith("RoutepackError") and "EP rank(s) [1]" in errs["odd_key"], errs
        assert errs["not_an_optimizer"].startswith("RoutepackTypeError") and "optimizer" in errs["not_an_optimizer"], (
            errs
        )
