"""routepack's plans inside Megatron-Core under the interleaved pipeline schedule (virtual
pipeline, vpp > 1), on CPU with gloo, in configurations Megatron-LM's argument checks accept
(``validate_args``: the interleaved schedule needs ``overlap_p2p_comm``, Megatron-LM's default,
or pp > 2, "to avoid having multiple p2p sends and recvs between same 2 ranks per
communication batch"):

* 4 ranks as pp = 2 x vpp = 2 x ep = 2 with ``overlap_p2p_comm=True`` and ``batch_p2p_comm=False``
  (what Megatron-LM sets by default), 8 MoE layers in 4 model chunks of two (chunk ``v * pp +
  s`` of stage s: stage 0 holds layers {0, 1, 4, 5}, stage 1 {2, 3, 6, 7});
* 6 ranks as pp = 3 x vpp = 2 x ep = 2 with batched point-to-point ops (``--no-overlap-p2p-
  communication``), 6 MoE layers in 6 chunks of one.

tp = 1, dp = ep a stage; a small ``GPTModel`` (local spec, fp32, 8 experts top-2, the stock
all-to-all dispatcher, Megatron's DDP a chunk and one optimizer); every step run by Megatron's
own ``get_forward_backward_func()`` = ``forward_backward_pipelining_with_interleaving`` as
shipped (no stand-in for its point-to-point communication) over a multiple of pp microbatches
a DP rank (microbatches of different lengths: ``variable_seq_lengths``), each chunk's data
iterator passed as it is: the runner takes each chunk's microbatch from the
``current_microbatch`` Megatron's ``forward_step`` sets on the chunk's layers. Three windows of
plans by `routepack.plan_window` (EPLB placement with redundant experts, routepack's packing;
without replicas, and with ``hot_n`` replicas) migrate experts; next to it, the stock model
(Megatron's ``MoELayer``, static placement, the same chunks) on the same data:

* every plan validates (the planner and the runner check) and runs a multiple of pp
  microbatches; one digest per window on all ranks; each stage's runner holds its own
  (non-adjacent) MoE layers and applies exactly the plan's migration rows of those layers;
* every rank's experts receive the tokens the plan predicts in every (microbatch, layer) cell
  of its stage (a chunk routed by another microbatch's table would not);
* losses per microbatch (the last stage, which holds the last chunk), grad norms and the
  logical weights of every chunk equal the stock model's to 1e-5;
* with replicas: the same, every copy computed the tokens the plan's flow table sends it (a
  replica row may carry none: then its layer's copies compute nothing), and the runner put
  earlier microbatches' copies back before their experts' backward;
* refused at once: both chunks given as one module where topo says vpp = 2, a topo with vpp = 1;
  with the runner's hooks removed, `finish_step` raises (no chunk ran a planned microbatch).

CUDA-only calls are stood in for by tests/megatron_cpu.py (the only place; each with its reason)."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core (pip install --no-deps megatron-core) not importable")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron_cpu  # noqa: E402
import routepack as rp  # noqa: E402
from routepack.torch.spawn import run_ranks  # noqa: E402

TOL = 1e-5
#: (pp, vpp, ep, MoE layers a chunk, overlap_p2p_comm): the configurations run (module docstring)
CONFIGS = {"pp2-vpp2-ep2-overlap": (2, 2, 2, 2, True), "pp3-vpp2-ep2": (3, 2, 2, 1, False)}
POLICIES = {
    rep: rp.Policy(placement="eplb", packing="routepack", replication=rep, loads="window") for rep in ("none", "hot_n")
}


def _case(config, replica_slots):
    import megatron_selfcheck as ms

    pp, vpp, ep, per_chunk, overlap = CONFIGS[config]
    return ms.MegatronCase(
        dp=ep,
        ep=ep,
        gpus_per_node=ep,
        pp=pp,
        vpp=vpp,
        layers=pp * vpp * per_chunk,
        slots_per_rank=5,
        replica_slots=replica_slots,
        replicas=replica_slots > 0,
        token_cap=24,
        samples=8 if pp == 2 else 16,  # a multiple of pp microbatches a DP rank, each non-empty
        overlap_p2p_comm=overlap,
    )


def stage_layers(config, stage):
    """The MoE layers stage ``stage`` holds: those of its chunks ``v * pp + stage``."""
    pp, vpp, _, n, _ = CONFIGS[config]
    return [(v * pp + stage) * n + j for v in range(vpp) for j in range(n)]


def _raised(fn):
    try:
        fn()
    except rp.RoutepackError as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"OTHER {type(e).__name__}: {e}"
    return "nothing"


def check_interleaved(rank, world, device, config, replication):
    megatron_cpu.install(optimizers=True)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    import megatron_selfcheck as ms
    from routepack.integrations import megatron as rm
    from routepack.integrations.megatron.tables import cell_rows
    from routepack.torch import flow_table
    from routepack.torch.broadcast import digest_int
    from routepack.torch.routes import cell_origins

    pp, vpp, ep, _, _ = CONFIGS[config]
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep
    )
    case = _case(config, 3 if replication != "none" else 0)
    dp_rank = parallel_state.get_data_parallel_rank()
    plans = ms.planned(case, POLICIES[replication])  # each plan validated against its window
    keys = "digests num_micro rows expected_rows received_ok copy_tokens bytes replica_layers copies_ok"
    seen = {k: [] for k in keys.split()}

    def record(w, ddp, opt, runner):
        plan = runner.plan
        mine = [m.moe_index for m in runner.layers]
        seen["layers"] = mine
        seen["digests"].append(digest_int(plan))
        seen["num_micro"].append(plan.num_micro)
        seen["rows"].append(0 if runner.last_migration is None else runner.last_migration.rows)
        seen["expected_rows"].append(int(np.isin(plan.migration["layer"], mine).sum()))
        r = plan.replicas[np.isin(plan.replicas["layer"], mine)]
        seen["replica_layers"].append(sorted({int(l) for l in r["layer"]}))
        for i, m in enumerate(runner.layers):
            assert np.array_equal(m.phy2log, plan.placement.phy2log[mine[i]])
        runner.recording = True
        runner.restores = 0

    def after(w, ddp, opt, runner):
        pred = runner.predicted_received()[:, seen["layers"]]
        got = np.zeros_like(pred)
        copies = {}
        for (m, l), counts in runner.received.items():
            got[m, seen["layers"].index(l)] = sum(counts)
            copies[(m, l)] = sum(counts[case.slots_per_rank :])
        seen["received_ok"].append(bool(np.array_equal(got, pred)) and len(runner.received) == pred.size)
        seen["copy_tokens"].append(sorted(copies.items()))
        # the copies' tokens on this rank against the plan's flow table of each cell
        plan, origins = runner.plan, cell_origins(runner.plan, runner._window, runner.group_index, case.ep)
        want = {}
        for m, l in copies:
            rows = cell_rows(plan, runner.group_index, m, l)
            flows = flow_table(
                np.ascontiguousarray(origins[m, :, l]), plan.placement.phy2log[l], ms.topology(case), rows
            )
            want[(m, l)] = int(flows["count"][(flows["replica"] >= 0) & (flows["dst_rank"] == runner.ep_rank)].sum())
        seen["copies_ok"].append(want == copies)
        ex = runner.exchange
        seen["bytes"].append((0, 0, 0) if ex is None else (ex.sent_bytes, ex.received_bytes, runner.restores))

    static = ms.train(case, False, dp_rank, plans=plans)
    planned = ms.train(case, True, dp_rank, plans=plans, before_step=record, after_window=after)
    out = {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "cmp": ms.compare(static, planned),
        "losses": [len(w) for w in planned["losses"]],
        "interleaved": get_forward_backward_func() is forward_backward_pipelining_with_interleaving,
        "weights": len(planned["weights"]),
    }
    out.update(seen)
    if replication == "none":  # refusals, at once
        topo = ms.topology(case)
        chunks = ms.build_model(case, True)
        # both chunks in one module: the runner cannot tell which chunk's forward is running
        out["one_chunk"] = _raised(lambda: rm.MegatronRunner(torch.nn.ModuleList(chunks), topo))
        bad = dataclasses.replace(topo, vpp=1)  # layers built for it too: Megatron's vpp = 2 refuses it
        for m in (m for c in chunks for m in c.modules() if isinstance(m, rm.PlanMoELayer)):
            m.topo = bad
        out["no_vpp"] = _raised(lambda: rm.MegatronRunner(chunks, bad))
        # without the runner's hooks the chunks' forwards run no planned microbatch: finish_step says so
        from routepack.plan import Placement
        from routepack.torch.replay import rank_microbatches

        chunks = ms.build_model(case, True)
        ddps, opt = ms.wrap(chunks, case)
        runner = rm.MegatronRunner(ddps, topo)
        plan, _, window, routed, cu = plans(0, Placement.static(case.layers, case.experts, topo))
        runner.begin_window(plan, window, opt)
        for h in runner._hooks:
            h.remove()
        mbs = rank_microbatches(plan, routed, dp_rank, cu, dp=case.dp)
        out["unhooked"] = _raised(lambda: ms.run_step(case, 0, ddps, opt, mbs, cu, runner, "cpu"))
    return out


@pytest.mark.parametrize(
    "config, replication",
    [("pp2-vpp2-ep2-overlap", "none"), ("pp2-vpp2-ep2-overlap", "hot_n"), ("pp3-vpp2-ep2", "hot_n")],
)
def test_interleaved_plans_equal_stock_model(config, replication):
    pp, vpp, ep, _, _ = CONFIGS[config]
    out = run_ranks(check_interleaved, pp * ep, config, replication, join_timeout_s=900, pg_timeout_s=300)
    digests = {tuple(f["digests"]) for f in out.values()}
    assert len(digests) == 1 and len(set(next(iter(digests)))) == 3, digests  # one plan a window, all ranks
    assert sorted({f["stage"] for f in out.values()}) == list(range(pp))
    for rank, f in sorted(out.items()):
        c = f["cmp"]
        assert f["interleaved"], rank
        assert c["missing"] == 0 and c["loss"] <= TOL and c["weights"] <= TOL and c["grad_norm"] <= TOL, (rank, c)
        assert f["layers"] == stage_layers(config, f["stage"]), (rank, f["layers"])
        assert all(m >= pp and m % pp == 0 for m in f["num_micro"]), (rank, f["num_micro"])
        assert f["losses"] == (f["num_micro"] if f["stage"] == pp - 1 else [0, 0, 0]), (rank, f["losses"])
        assert f["rows"] == f["expected_rows"] and sum(f["rows"]) > 0, (rank, f["rows"])
        assert f["received_ok"] == [True] * 3, (rank, f["received_ok"])
        print(f"rank {rank} stage {f['stage']}: {c}, micro {f['num_micro']}, rows {f['rows']}, bytes {f['bytes']}")
    if replication == "none":
        for f in out.values():
            assert f["one_chunk"].startswith("RoutepackError: model: 1 model chunk(s); topo.vpp=2"), f["one_chunk"]
            assert f["no_vpp"].startswith(
                "RoutepackError: topo: pp=2, vpp=1; Megatron runs pipeline_model_parallel_size=2 with 2 model chunk"
            ), f["no_vpp"]
            want = "AuditError: finish_step: a planned microbatch never ran: microbatch 0 on DP rank 0 of pipeline"
            assert f["unhooked"].startswith(want) and "no current_microbatch" in f["unhooked"], f["unhooked"]
        return
    for rank, f in sorted(out.items()):
        sent, received, restores = zip(*f["bytes"])
        assert all(b > 0 for b in sent + received), (rank, f["bytes"])
    assert any(r > 0 for f in out.values() for _, _, r in f["bytes"]), "no copies put back"
    for stage in range(pp):  # every window the stage's copies computed tokens, only in replicated layers
        ranks = [f for f in out.values() if f["stage"] == stage]
        for w in range(3):
            tokens = {l: 0 for l in ranks[0]["layers"]}
            for f in ranks:
                for (m, l), n in f["copy_tokens"][w]:
                    tokens[l] += n
            planned = ranks[0]["replica_layers"][w]
            assert planned and sum(tokens.values()) > 0, (stage, w, planned, tokens)
            assert all(tokens[l] == 0 for l in tokens if l not in planned), (stage, w, planned, tokens)
        for f in ranks:  # every copy computed the tokens the plan's flow table sends it
            assert f["copies_ok"] == [True] * 3, (stage, f["copies_ok"])
