"""Ranks without tokens (issue 16, finding 6) on 2 and 4 gloo processes: forward and backward
equal the dense reference over every rank's tokens, a zero-token rank returns ``[0, H]``, and
a bad argument on one rank makes every rank raise instead of leaving its peers waiting. The
checks live in `selfcheck.zero` (tests/torch/selfcheck); each run is bounded (`run_ranks`)."""

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is required", allow_module_level=True)

import selfcheck as sc  # noqa: E402

#: float64 throughout, except `sync_redundant_grads`, which sums a redundant expert's slots in fp32
TOL = {"out": 1e-10, "x_grad": 1e-10, "expert_grad": 1e-6}


@pytest.mark.parametrize("world,empty", [(2, 1), (4, 2)])
def test_zero_token_ranks_match_the_dense_reference_and_nobody_hangs(world, empty):
    out = sc.run_ranks(sc.check_zero_tokens, world, empty, join_timeout_s=240, pg_timeout_s=30)
    steps = sc.zero.token_counts(world, empty)
    for rank, f in out.items():
        for key, tol in TOL.items():
            assert f[key] <= tol, (rank, key, f[key])
        assert f["grads_set"], rank
        assert f["empty_shapes"] == [[0, sc.zero.H]] * sum(c[rank] == 0 for c in steps), (rank, f["empty_shapes"])
        for name, want in sc.expected_messages(rank, world - 1).items():
            got = f["bad_args"][name]
            assert not got.startswith(("OTHER", "nothing")) and any(w in got for w in want), (rank, name, got)
        assert f["after"] == [2, sc.zero.H], rank
