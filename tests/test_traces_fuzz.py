"""Property tests of `routepack.traces.synthetic`: bad arguments and odd `Profile` fields
(the method: see `fuzzing.py`)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import routepack as rp
from fuzzing import FUZZ, outcome, is_int, scalars


# ------------------------------------------------------------ traces.synthetic

SMALL_PROFILE = dataclasses.replace(
    rp.traces.profile("tiny"), num_layers=2, num_experts=16, samples=16, group_size=4, attention=("linear", "full")
)


@FUZZ
@given(
    name=st.one_of(st.sampled_from(["tiny", "flash", "", "TINY"]), st.none(), st.integers()),
    windows=st.one_of(st.integers(1, 2), scalars(-2, 3, huge=False)),
    seed=st.one_of(st.integers(0, 2**64), st.integers(-3, -1), st.floats(), st.none(), st.text(max_size=2)),
)
def test_synthetic_bad_args(name, windows, seed):
    # the real profiles take seconds per window: only their argument errors are exercised here
    assume(not (name in ("tiny", "flash") and is_int(windows) and windows >= 1 and is_int(seed) and seed >= 0))
    out, err = outcome(lambda: next(iter(rp.traces.synthetic(name, windows, seed))))
    assert out is None


PROFILE_FIELDS = [
    "num_layers",
    "num_experts",
    "top_k",
    "samples",
    "group_size",
    "prompt_median",
    "response_median",
    "max_response",
    "response_sigma",
    "difficulty_sigma",
    "num_topics",
    "topic_experts",
    "topic_strength",
    "sample_noise",
    "drift",
    "topic_drift",
    "token_cap",
]


@FUZZ
@given(
    tweaks=st.dictionaries(
        st.sampled_from(PROFILE_FIELDS),
        st.one_of(st.integers(-2, 40), st.floats(-2, 40), st.sampled_from([float("nan")])),
        max_size=2,
    ),
    windows=st.integers(1, 2),
    seed=st.integers(0, 2**64),
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # odd fields overflow numpy on the way to an error
def test_synthetic_custom_profiles(tweaks, windows, seed):
    """A `Profile` with odd field values: windows that satisfy the trace's promises, or a
    clean error."""

    def run():
        prof = dataclasses.replace(SMALL_PROFILE, **tweaks)  # a Profile may check its fields itself
        return prof, list(rp.traces.synthetic(prof, windows, seed))

    done, err = outcome(run)
    if done is not None:
        prof, out = done
        assert len(out) == windows
        for w in out:
            assert w.expert_tokens.shape[1:] == (prof.num_layers, prof.num_experts)
            assert (w.expert_tokens.sum(axis=2) == prof.top_k * w.seq_lens[:, None]).all()
            assert (w.expert_tokens <= w.seq_lens[:, None, None]).all()


MODEL_AND_TOPOLOGY_FIELDS = [
    "num_layers",
    "num_experts",
    "top_k",
    "hidden",
    "expert_ffn",
    "expert_groups",
    "attention",
    "dp",
    "ep",
    "gpus_per_node",
    "slots_per_rank",
]


@FUZZ
@given(
    tweaks=st.dictionaries(
        st.sampled_from(MODEL_AND_TOPOLOGY_FIELDS),
        st.one_of(st.integers(-2, 40), st.sampled_from([("full",), ("full", "nope"), 1.5, None])),
        min_size=1,
        max_size=2,
    )
)
def test_profile_errors_name_the_profile_field(tweaks):
    """A `Profile` builds its `ModelShape` and `Topology`: their refusals name the profile's
    field (``profile.num_layers``), never a ``model.`` or ``topo.`` argument the caller did
    not pass."""
    prof, err = outcome(dataclasses.replace, SMALL_PROFILE, **tweaks)
    if err is not None:
        assert str(err).startswith("profile") and not str(err).startswith(("model", "topo")), err
    else:
        assert prof.model().num_layers == prof.num_layers and prof.topology().dp == prof.dp
