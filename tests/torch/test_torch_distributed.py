"""routepack.torch across 4 processes (gloo, spawn): 2 nodes × 2 ranks, Topology(dp=4, ep=4,
gpus_per_node=2, slots_per_rank=3), 8 experts (4 redundant slots), 2 MoE layers, 2
microbatches per rank. The checks themselves live in tests/torch/selfcheck (the GPU script
runs the same ones); here they are run and their figures asserted. Every run is
bounded: process-group timeout 60 s, join timeout, stragglers killed."""

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import selfcheck as sc  # noqa: E402

WORLD = 4
TOL = 1e-5


@pytest.fixture(scope="module")
def windows():
    return sc.run_ranks(sc.check_windows, WORLD, join_timeout_s=300)


@pytest.fixture(scope="module")
def faults():
    return sc.run_ranks(sc.check_faults, WORLD, join_timeout_s=300)


def test_plans_exercise_migration_and_replication(windows):
    f = windows[0]
    assert f["moved_rows"] > 0 and f["replica_rows"] > 0
    assert sum(g["replica_tokens"] for g in windows.values()) > 0  # copies really computed tokens
    assert f["weights_changed"] > 1e-3  # the training steps move the weights, so equality is not trivial


@pytest.mark.parametrize("key", ["out", "x_grad", "expert_grad", "router_grad", "static_out", "static_expert_grad"])
def test_forward_and_gradients_match_dense_reference(windows, key):
    worst = max(f[key] for f in windows.values())
    assert worst <= TOL, f"{key}: relative error {worst:.3g}"


def test_migration_moves_weights_and_optimizer_state_bit_for_bit(windows):
    assert all(f["migration_identical"] for f in windows.values())
    assert all(f["copies_identical"] for f in windows.values())


def test_training_with_rebalancing_equals_training_without(windows):
    f = windows[0]
    assert f["trained_vs_static"] <= TOL
    assert f["trained_vs_dense"] <= TOL and f["router_vs_dense"] <= TOL


def test_ids_other_than_the_precomputed_replay_are_refused_on_every_rank(windows):
    for rank, f in windows.items():
        # the audit names the rank, the layer and the microbatch on every rank, the other EP group's too
        msg = f["mismatch"]
        assert "routes differ from the plan's: DP rank 3 fed MoE layer 0 top-k ids other than the replayed" in msg, (
            rank,
            msg,
        )
        assert "is router replay on" in msg and "DP rank 2" not in msg, (rank, msg)


def test_received_load_is_the_plans_prediction(windows):
    for f in windows.values():
        assert f["loads_equal"], (f["received"], f["predicted"])
        assert f["imbalance_equal"]


@pytest.mark.parametrize(
    "name",
    [
        "other_topology",
        "missing_slot",
        "share_above_one",
        "share_negative",
        "migration_from_other_placement",
        "different_plan_on_rank0",
    ],
)
def test_bad_plans_are_refused_before_any_transfer(faults, name):
    for rank, f in faults.items():
        r = f["bad_plans"][name]
        assert r["raised"] == "InvalidPlanError", (rank, r)
        assert r["intact"] and r["transfers"] == 0, (rank, r)


@pytest.mark.parametrize("point", ["checked", "packed", "staged", "verified", "commit"])
def test_fault_on_one_rank_leaves_every_rank_intact(faults, point):
    for rank, f in faults.items():
        r = f["faults"][point]
        assert r["raised"] == "MigrationError", (rank, r)
        assert r["intact"], (rank, r)
    assert faults[0]["commit_fault_rank_rows"] >= 1


def test_migration_succeeds_after_faults(faults):
    for f in faults.values():
        c = f["clean"]
        assert c["raised"] is None and c["bit_identical"] and c["placement_is_plan"] and c["moved_rows"] > 0
        assert c["extra_state_moved"]  # e.g. fp32 master weights passed as extra_state


def test_broadcast_plan_gives_every_rank_the_same_plan(faults):
    assert all(f["broadcast_same"] for f in faults.values())


def test_a_rank_dying_mid_migration_hangs_nobody():
    out = sc.run_ranks(sc.check_peer_death, WORLD, join_timeout_s=180, may_die=[3])
    assert sorted(out) == [0, 1, 2]
    for f in out.values():
        assert f["raised"] == "MigrationError" and f["intact"]
        assert f["seconds"] < 60


def test_two_ep_groups_match_dense_reference():
    """dp=4 over two EP groups of 2 (one node each): replicas per group, migration applied
    in each group, expert-data-parallel gradient sum across groups."""
    case = sc.Case(dp=4, ep=2, gpus_per_node=2, slots_per_rank=5, windows=2)
    out = sc.run_ranks(sc.check_windows, WORLD, case, join_timeout_s=300)
    for f in out.values():
        assert f["moved_rows"] > 0 and f["replica_rows"] > 0
        for key in ("out", "x_grad", "expert_grad", "router_grad", "trained_vs_static", "trained_vs_dense"):
            assert f[key] <= TOL, (key, f[key])
        assert f["migration_identical"] and f["copies_identical"]
        assert f["loads_equal"] and f["imbalance_equal"]
