"""routepack.integrations.verl against verl's own code (verl 0.9.1 from PyPI, installed with
``--no-deps`` plus what ``verl.utils.seqlen_balancing`` imports: ray, msgpack, protobuf,
tensordict, pyvers, omegaconf, antlr4). Skipped where verl does not import.

Real verl objects and functions used: ``DataProto`` (``from_dict``, ``reorder``,
``chunk(dp)``, which asserts equal chunks), ``log_seqlen_unbalance`` (the metrics
``_balance_batch`` adds), ``get_seqlen_balanced_partitions`` and ``rearrange_micro_batches``
(what the adapter replaces: same return types), ``restore_dynamic_batch`` (the inverse verl
applies to the microbatch outputs) and ``tensordict_utils.index_select_tensor_dict``.
``RayPPOTrainer._balance_batch`` itself is not imported (its module needs torchdata and the
trainer's stack); its body is the KK partition + ``batch.reorder`` + ``log_seqlen_unbalance``
exercised here.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sb = pytest.importorskip("verl.utils.seqlen_balancing", reason="verl (pip install --no-deps verl) not importable")
torch = pytest.importorskip("torch")
import verl  # noqa: E402
from verl.protocol import DataProto  # noqa: E402

import routepack as rp  # noqa: E402
from routepack.integrations import verl as rv  # noqa: E402
from verl_batches import plan_for, verl_batch  # noqa: E402

TOPOS = [(2, 2, 2, 3), (4, 2, 2, 3), (4, 4, 4, 2)]


def test_verl_version_is_reported():
    assert verl.__version__  # the version these tests ran against is printed in -ra output
    print("verl", verl.__version__)


def data_proto(vb):
    b, t = vb.attention_mask.shape
    tensors = {
        "input_ids": torch.arange(b * t).reshape(b, t),
        "attention_mask": torch.from_numpy(vb.attention_mask),
        "response_mask": torch.from_numpy(vb.response_mask),
        "routed_experts": torch.from_numpy(vb.routed_experts),
    }
    return DataProto.from_dict(tensors, {"uid": np.array([f"s{i}" for i in range(b)], dtype=object)})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    topo_i=st.integers(0, len(TOPOS) - 1),
    per_rank=st.integers(1, 5),
    dtype=st.sampled_from([np.int16, np.uint8]),
    policy=st.sampled_from(["routepack", "eplb_oracle"]),
)
def test_balance_and_microbatches_match_verl(seed, topo_i, per_rank, dtype, policy):
    rng = np.random.default_rng(seed)
    dp, ep, gpn, spr = TOPOS[topo_i]
    topo = rp.Topology(dp=dp, ep=ep, gpus_per_node=gpn, slots_per_rank=spr)
    vb = verl_batch(rng, dp * per_rank, 6, 6, 2, 2, num_experts=5, dtype=dtype, truncate=True)
    data = data_proto(vb)
    window = rv.window_from_verl(data, num_experts=5)
    cap = int(max(12, vb.lens.max()))  # verl asserts max_token_len >= the padded length
    plan = plan_for(window, topo, cap, policy, seed % 100)

    # _balance_batch: verl's own KK partition has the same type and shape as ours
    parts = rv.balance_partitions(plan)
    workloads = sb.calculate_workload(torch.from_numpy(vb.lens))
    theirs = sb.get_seqlen_balanced_partitions(workloads.tolist(), k_partitions=dp, equal_size=True)
    assert type(parts) is type(theirs) and len(parts) == len(theirs)
    assert [len(p) for p in parts] == [len(p) for p in theirs]
    assert {type(i) for p in parts for i in p} == {type(i) for p in theirs for i in p} == {int}

    metrics = {}
    before = data.batch["attention_mask"].clone()
    rv.balance_batch(data, plan, metrics=metrics)
    assert metrics == sb.log_seqlen_unbalance(seqlen_list=vb.lens.tolist(), partitions=parts, prefix="global_seqlen")
    chunks = data.chunk(dp)  # verl's dispatch: asserts equal chunks
    for r, chunk in enumerate(chunks):
        assert torch.equal(chunk.batch["attention_mask"], before[parts[r]])
        assert list(chunk.non_tensor_batch["uid"]) == [f"s{i}" for i in parts[r]]

        # rearrange_micro_batches: same return types as verl's, on the same rank batch
        ours_mb, ours_idx = rv.rearrange_micro_batches(chunk.batch, cap, plan, r)
        their_mb, their_idx = sb.rearrange_micro_batches(chunk.batch, max_token_len=cap)
        assert type(ours_mb) is type(their_mb) and type(ours_idx) is type(their_idx)
        assert {type(m) for m in ours_mb} == {type(m) for m in their_mb}
        assert all(set(m.keys()) == set(chunk.batch.keys()) for m in ours_mb)
        assert sorted(j for i in ours_idx for j in i) == sorted(j for i in their_idx for j in i)
        assert len(ours_idx) == plan.num_micro and all(ours_idx)  # same count on every rank, none empty
        for m, idx in zip(ours_mb, ours_idx):
            assert int(m["attention_mask"].sum()) <= cap
            assert torch.equal(m["input_ids"], chunk.batch["input_ids"][idx])
        # verl's inverse puts per-microbatch outputs back in the rank's batch order
        out = torch.cat([m["input_ids"] for m in ours_mb])
        assert torch.equal(sb.restore_dynamic_batch(out, ours_idx), chunk.batch["input_ids"])

        # prepare_dynamic_batch: DataProto microbatches with their non-tensor fields
        dps, idx = rv.prepare_dynamic_batch(chunk, cap, plan, r)
        their_dps, _ = sb.prepare_dynamic_batch(chunk, max_token_len=cap)
        assert idx == ours_idx and {type(d) for d in dps} == {type(d) for d in their_dps} == {DataProto}
        for d, i in zip(dps, idx):
            assert list(d.non_tensor_batch["uid"]) == list(chunk.non_tensor_batch["uid"][i])


def test_cap_and_batch_mismatch_are_refused():
    rng = np.random.default_rng(1)
    topo = rp.Topology(dp=2, ep=2, gpus_per_node=2, slots_per_rank=3)
    vb = verl_batch(rng, 4, 6, 6, 2, 2, num_experts=5)
    data = data_proto(vb)
    cap = int(vb.lens.max()) * 2
    plan = plan_for(rv.window_from_verl(data, num_experts=5), topo, cap, "eplb_oracle", 0)
    rv.balance_batch(data, plan)
    chunk = data.chunk(2)[0]
    with pytest.raises(rp.RoutepackError, match="max_token_len"):
        rv.rearrange_micro_batches(chunk.batch, 1, plan, 0)
    with pytest.raises(rp.RoutepackError, match="batch: holds"):
        rv.rearrange_micro_batches(data.batch, cap, plan, 0)
    with pytest.raises(rp.RoutepackError, match="batch: holds"):
        rv.balance_batch(chunk, plan)
