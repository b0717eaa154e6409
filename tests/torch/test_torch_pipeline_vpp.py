"""`routepack.torch.PlanRunner` under the interleaved pipeline schedule (``vpp`` > 1): 4 gloo
ranks as pp = 2 x ep = 2 with vpp = 2 model chunks a stage, 4 MoE layers of one layer a chunk
(chunk ``v * pp + s`` of stage s: stage 0 holds MoE layers {0, 2}, stage 1 {1, 3}; each stage
one EP group of 2 and dp = 2). Every step runs a hand-written interleaved 1F1B schedule
(Megatron's rule: virtual microbatches in groups of ``pp`` microbatches a chunk, warm-up
``2 (pp - s - 1) + (vpp - 1) pp`` forwards, then one forward and one backward alternating,
then the remaining backwards, a backward visiting the chunks in reverse), so activations run
stage 0 chunk 0 -> stage 1 chunk 0 -> stage 0 chunk 1 -> stage 1 chunk 1 and their
gradients back, by torch.distributed send/recv, with several (microbatch, chunk) forwards in
flight on each stage; the trainer calls ``start_micro(m)`` before each chunk's forward. 3
windows of `routepack.plan_window` plans (EPLB placement with redundant experts, routepack's
packing) migrate experts with Adam's state; windows 0 and 2 with routes precomputed from the
replayed microbatches, window 1 routed in the forward:

* the plans run a multiple of ``pp`` microbatches (Megatron's rule under vpp);
* one digest per window on all 4 ranks; each stage applies exactly the plan's migration rows
  of its own (non-adjacent) layers, holds their placement rows, and receives the rows the plan
  predicts in every (micro, layer) cell of the stage; no replica transfer is left posted at
  the end of a step (``start_micro`` twice for one microbatch posts each cell once);
* each microbatch's loss (on stage 1, which holds the last chunk), the final logical expert
  weights and routers equal the unsharded model's (`test_torch_pipeline.reference`) to 1e-5;
* the same with intra-batch replicas on both stages in every window (hot_n, relibra), and
  with hot_n replicas on 6 MoE layers in chunks of 1, 2, 2, 1 (``layers_per_stage``: stage 0
  holds {0, 3, 4}, stage 1 {1, 2, 5});
* a stage holding its contiguous share of the layers ({0, 1} / {2, 3}: the split without
  interleaving) is refused on every rank, naming the layers ``topo`` gives it;
* the hand-written order equals Megatron-Core's (``get_schedule_table`` and
  ``get_pp_rank_microbatches``) where megatron-core is installed."""

import datetime
import sys
from itertools import accumulate
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.plan import Placement  # noqa: E402
from routepack.torch import EPMoE, PlanRunner  # noqa: E402
from routepack.torch.broadcast import digest_int  # noqa: E402
from routepack.torch.replay import rank_microbatches  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_torch_pipeline import E, EP, H, I, K, L, LR, SLOTS, TOL, WINDOWS  # noqa: E402
from test_torch_pipeline import _rel, block, initial, make_window, reference, tokens  # noqa: E402

PP, VPP = 2, 2
CAP = 16  # 4 microbatches a DP rank: every stage alternates forwards and backwards in its steady state
POLICIES = {
    rep: rp.Policy(placement="eplb", packing="routepack", replication=rep, loads="window")
    for rep in ("none", "hot_n", "relibra")
}


#: layout → (MoE layers, `Topology.layers_per_stage`, each stage's layers, each stage's chunks):
#: "even" one layer a chunk; "uneven" 6 layers in chunks of 1, 2, 2, 1 (chunk 2 = stage 0's
#: second, two adjacent layers after a gap)
LAYOUTS = {
    "even": (L, None, [[0, 2], [1, 3]], [[[0], [2]], [[1], [3]]]),
    "uneven": (6, (1, 2, 2, 1), [[0, 3, 4], [1, 2, 5]], [[[0], [3, 4]], [[1, 2], [5]]]),
}


def topology(layout="even"):
    return rp.Topology(EP, EP, EP, SLOTS, pp=PP, vpp=VPP, layers_per_stage=LAYOUTS[layout][1])


def windows(policy, layout="even"):
    """The 3 training windows under ``topology(layout)``, each planned (and validated) from
    the placement the one before left: (plan, window, routed, cu, x, r) each."""
    nl, topo = LAYOUTS[layout][0], topology(layout)
    shape = rp.ModelShape(num_layers=nl, num_experts=E, top_k=K, hidden=H, expert_ffn=I, attention=["full"] * nl)
    cost = rp.CostModel.from_model(shape, rp.Hardware.h200())
    out, prev = [], Placement.static(nl, E, topo)
    for w in range(WINDOWS):
        window, routed, cu, x, r = make_window(w, nl)
        plan = rp.plan_window(window, topo, cost, token_cap=CAP, previous=prev, seed=w, policy=policy)
        out.append((plan.validate(window, topo, CAP), window, routed, cu, x, r))
        prev = plan.placement
    return out


def interleaved(stage, n, pp=PP, vpp=VPP):
    """Stage ``stage``'s order of ("F" | "B", index into its microbatches, local chunk v)
    under interleaved 1F1B with ``n`` microbatches (a multiple of ``pp``): virtual
    microbatch k runs chunk ``table[k]``'s forward, groups of ``pp`` microbatches a chunk;
    ``2 (pp - stage - 1) + (vpp - 1) pp`` warm-up forwards, then forward ``k + warm`` and
    backward ``k`` alternating, then the remaining backwards; backward k visits chunk
    ``vpp - 1 - table[k].v``."""
    assert n % pp == 0, (n, pp)
    table = [(g * pp + i, v) for g in range(n // pp) for v in range(vpp) for i in range(pp)]
    total = len(table)
    warm = min(total, 2 * (pp - stage - 1) + (vpp - 1) * pp)
    fwd = [("F", m, v) for m, v in table]
    bwd = [("B", m, vpp - 1 - v) for m, v in table]
    out = fwd[:warm]
    for k in range(total - warm):
        out += [fwd[warm + k], bwd[k]]
    return out + bwd[total - warm :]


def _tag(kind, chunk, micro):
    """One message's tag: activations ("F") entering global chunk ``chunk``, or gradients
    ("B") leaving it backwards, of microbatch ``micro``."""
    return (2 * chunk + (kind == "B")) * 1000 + micro


def check_vpp(rank, world, device, policy="none", layout="even"):
    topo, L = topology(layout), LAYOUTS[layout][0]
    stage, d = divmod(rank, EP)
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group, pp_group = ep_groups[stage], pp_groups[d]
    rank_of = lambda s: s * EP + d  # noqa: E731 (this model replica's rank on stage s)
    bounds, chunks = topo.chunk_bounds(L), PP * VPP
    mine = topo.stage_layers(stage, L)
    data = windows(POLICIES[policy], layout)  # every rank plans alike
    w1, w2, router = initial(L)
    static = Placement.static(L, E, topo)
    layers = [EPMoE(l, E, H, I, topo, static.phy2log[l], group) for l in mine]
    for l, mod in zip(mine, layers):
        mod.load_logical(w1[l], w2[l])
    routers = [torch.nn.Parameter(router[l].clone()) for l in mine]
    # local chunk v: global chunk v * pp + stage, its (layer, router) pairs
    chunk_of = [
        [(m, rt) for m, rt in zip(layers, routers) if bounds[v * PP + stage] <= m.layer < bounds[v * PP + stage + 1]]
        for v in range(VPP)
    ]
    timeout = datetime.timedelta(seconds=60)
    runner = PlanRunner(layers, topo, group, dp_rank=d, timeout=timeout, pipeline_group=pp_group)
    opt = torch.optim.Adam([p for m in layers for p in (m.w1, m.w2)] + routers, lr=LR)
    out = {"stage": stage, "layers": mine, "chunks": [[m.layer for m, _ in c] for c in chunk_of]}
    for key in ("digests", "rows", "expected_rows", "placed", "received_ok", "num_micro", "replica_rows"):
        out[key] = []
    out.update({"order": [], "copy_bytes": [], "left_posted": [], "losses": {}})
    for w, (plan, window, routed, cu, x, r) in enumerate(data):
        mbs = rank_microbatches(plan, routed, d, cu, dp=EP)
        report = runner.begin_window(plan, window, opt, token_cap=CAP, microbatches=None if w == 1 else mbs)
        out["digests"].append(digest_int(plan))
        out["rows"].append(0 if report is None else report.rows)
        out["expected_rows"].append(int(np.isin(plan.migration["layer"], mine).sum()))
        out["placed"].append(all(np.array_equal(m.phy2log, plan.placement.phy2log[m.layer]) for m in layers))
        out["num_micro"].append(plan.num_micro)
        out["replica_rows"].append(int(np.isin(plan.replicas["layer"], mine).sum()))
        saved, sends = {}, []
        order = interleaved(stage, len(mbs))
        out["order"].append(order)
        for step, i, v in order:
            mb, c = mbs[i], v * PP + stage
            tok = tokens(mb, cu)
            n = tok.numel()
            if step == "B":
                h_in, end = saved.pop((i, v))
                if c == chunks - 1:
                    end.backward()
                else:
                    grad = torch.zeros(n, H)
                    if n:
                        dist.recv(grad, src=rank_of((c + 1) % PP), group=pp_group, tag=_tag("B", c + 1, mb.micro))
                    (end * grad).sum().backward()
                if c > 0 and n:
                    work = dist.isend(
                        h_in.grad.contiguous(), dst=rank_of((c - 1) % PP), group=pp_group, tag=_tag("B", c, mb.micro)
                    )
                    sends.append(work)
                continue
            runner.start_micro(mb.micro)  # before each chunk's forward: its layers route this micro
            ids = mb.routed.long()
            if c == 0:
                h_in = x[tok]
            else:
                h_in = torch.empty(n, H)
                if n:
                    dist.recv(h_in, src=rank_of((c - 1) % PP), group=pp_group, tag=_tag("F", c, mb.micro))
                h_in.requires_grad_(True)
            h = h_in
            for mod, rt in chunk_of[v]:
                h = block(h, ids[:, mod.layer], rt, mod)
            if c == chunks - 1:
                loss = (h * r[tok]).sum()
                out["losses"][(w, d, mb.micro)] = float(loss.detach())
                saved[(i, v)] = (h_in, loss)
            else:
                if n:  # not waited here: the next stage may send a gradient first
                    dst, tag = rank_of((c + 1) % PP), _tag("F", c + 1, mb.micro)
                    sends.append(dist.isend(h.detach().contiguous(), dst=dst, group=pp_group, tag=tag))
                saved[(i, v)] = (h_in, h)
        assert not saved, sorted(saved)
        for work in sends:
            work.wait()
        for p in routers:  # the trainer's DP reduction of the dense parameters (the stage's DP group)
            dist.all_reduce(p.grad, group=group)
        runner.finish_step()
        out["left_posted"].append(len(runner.exchange.posted))
        out["copy_bytes"].append(runner.exchange.received_bytes)
        out["received_ok"].append(bool(np.array_equal(runner.received, runner.predicted_received())))
        opt.step()
        opt.zero_grad()
    out["w1"] = {m.layer: m.export_logical()[0].numpy() for m in layers}
    out["w2"] = {m.layer: m.export_logical()[1].numpy() for m in layers}
    out["routers"] = {l: rt.detach().numpy().copy() for l, rt in zip(mine, routers)}
    if policy == "none" and layout == "even":
        # the split without interleaving (each stage a contiguous half): refused on every rank
        half = list(range(stage * L // PP, (stage + 1) * L // PP))
        fresh = [EPMoE(l, E, H, I, topo, runner.plan.placement.phy2log[l], group) for l in half]
        flat = PlanRunner(fresh, topo, group, dp_rank=d, timeout=timeout, pipeline_group=pp_group)
        plan, window = data[-1][0], data[-1][1]
        try:
            flat.begin_window(plan, window, optimizer_state="none", token_cap=CAP)
            out["contiguous"] = "nothing"
        except rp.RoutepackError as e:
            out["contiguous"] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(
    scope="module",
    params=[("none", "even"), ("hot_n", "even"), ("relibra", "even"), ("hot_n", "uneven")],
    ids=lambda p: "-".join(p),
)
def run(request):
    """(replication, layout, windows, results) of one 4-rank interleaved run."""
    rep, layout = request.param
    results = run_ranks(check_vpp, 4, rep, layout, join_timeout_s=300, pg_timeout_s=90)
    return rep, layout, windows(POLICIES[rep], layout), results


def test_interleaved_pipeline_equals_the_unsharded_model(run):
    rep, layout, data, results = run
    _, _, stage_layers, stage_chunks = LAYOUTS[layout]
    outs = [results[r] for r in range(4)]
    for w in range(WINDOWS):
        assert len({o["digests"][w] for o in outs}) == 1  # one plan per window on all 4 ranks
    for o in outs:
        # non-adjacent layers: chunk v of stage s is global chunk v * pp + s
        assert o["layers"] == stage_layers[o["stage"]], o["layers"]
        assert o["chunks"] == stage_chunks[o["stage"]], o["chunks"]
        assert all(n % PP == 0 and n >= PP for n in o["num_micro"]), o["num_micro"]  # Megatron's rule
        assert o["rows"] == o["expected_rows"], o  # exactly the plan's rows of the stage's layers
        assert all(n > 0 for n in o["expected_rows"]), o  # every window migrates on every stage
        assert all(o["placed"]) and all(o["received_ok"]), o
        assert o["left_posted"] == [0] * WINDOWS, o["left_posted"]
        for order in o["order"]:  # several (microbatch, chunk) forwards in flight, both chunks used
            assert max(accumulate(1 if step == "F" else -1 for step, _, _ in order)) >= 2, order
            assert {v for _, _, v in order} == set(range(VPP))
    if rep == "none":
        assert layout == "even"
        for o in outs:
            held = [0, 2] if o["stage"] == 0 else [1, 3]
            flat = [0, 1] if o["stage"] == 0 else [2, 3]
            assert o["contiguous"].startswith("InvalidPlanError: window has L=4 MoE layers, of which topo gives"), o
            assert o["contiguous"].endswith(
                f"pipeline stage {o['stage']} {held} (layers_per_stage=None); this stage holds {flat}"
            ), o["contiguous"]
    else:
        for o in outs:
            assert all(n > 0 for n in o["replica_rows"]), o["replica_rows"]  # every window, both stages
        for w in range(WINDOWS):
            for stage in range(PP):  # the copies moved: some rank of each stage received some
                assert sum(o["copy_bytes"][w] for o in outs if o["stage"] == stage) > 0, (w, stage)
    want, w1, w2, router = reference(data)
    got = {k: v for r in (2, 3) for k, v in results[r]["losses"].items()}
    assert set(got) == set(want)
    keys = sorted(want)
    loss_err = _rel([got[k] for k in keys], [want[k] for k in keys])
    weight_err = 0.0
    for o in outs:
        for l in o["layers"]:
            weight_err = max(weight_err, _rel(o["w1"][l], w1[l]), _rel(o["w2"][l], w2[l]))
            weight_err = max(weight_err, _rel(o["routers"][l], router[l]))
    copies = [sum(o["copy_bytes"]) for o in outs]
    print(
        f"pp=2 x vpp=2 x ep=2, {layout} chunks, {rep}, {len(keys)} microbatch losses: max rel diff {loss_err:.2e}; "
        f"weights {weight_err:.2e}; replica bytes received per rank {copies}"
    )
    assert loss_err <= TOL and weight_err <= TOL
    assert _rel(initial(len(w1))[0], w1) > 1e-3  # the weights moved


@pytest.mark.parametrize("n", [2, 4, 6])
@pytest.mark.parametrize("stage", range(PP))
def test_interleaved_order_is_megatrons(stage, n):
    """The hand-written order runs every (microbatch, chunk) forward and backward once, each
    backward after its forward, and equals Megatron-Core's own order."""
    order = interleaved(stage, n)
    fwd = [(m, v) for s, m, v in order if s == "F"]
    bwd = [(m, v) for s, m, v in order if s == "B"]
    cells = {(m, v) for m in range(n) for v in range(VPP)}
    assert sorted(fwd) == sorted(cells) == sorted(bwd)
    assert all(order.index(("F", m, v)) < order.index(("B", m, v)) for m, v in cells)
    pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from pipeline_reference import stage_order

    assert order == stage_order(PP, VPP, n, stage, "1f1b")


def test_prefetch_posts_each_cell_once_per_pass():
    """`ReplicaExchange.prefetch` under the interleaved schedule (``start_micro(m)`` before each
    chunk): the cells of an earlier chunk already taken, or of a later one already posted, are
    not posted again; once every layer of the microbatch took its copies, the next call (the
    next step of the window) posts them all again. Bookkeeping only: cells without rows post
    no transfer, so no process group is needed."""
    from types import SimpleNamespace

    from routepack.torch.replicate import ReplicaExchange

    layers = [SimpleNamespace(topo=topology(), ep_rank=0, w1=torch.zeros(2, H, 2 * I), w2=torch.zeros(2, I, H))]
    ex = ReplicaExchange(layers * 2, {}, datetime.timedelta(seconds=1))
    ex.prefetch(0)  # chunk 0 of micro 0: both layers' cells posted
    assert ex.posted == [(0, 0), (0, 1)]
    w1r, _ = ex.weights(0)  # chunk 0's layer takes its copies (none)
    assert w1r.shape == (0, H, 2 * I) and ex.posted == [(0, 1)]
    ex.prefetch(1)
    ex.prefetch(0)  # chunk 1 of micro 0: nothing posted again
    assert ex.posted == [(0, 1), (1, 0), (1, 1)]
    ex.weights(1)
    assert ex.posted == [(1, 0), (1, 1)]
    ex.prefetch(0)  # every layer of micro 0 took its copies: a new pass posts them all
    assert ex.posted == [(0, 0), (0, 1), (1, 0), (1, 1)]
