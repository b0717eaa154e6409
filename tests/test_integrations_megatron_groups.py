"""`MegatronGroups` (the runner's process groups), `groups_from_parallel_state` and the runner's
`MicrobatchState`, without a model: what they read, what they refuse, how the per-step state
moves. The runner over real groups, given or read, is tests/test_integrations_megatron_pp.py's
and the other Megatron tests'."""

import dataclasses
import sys

import pytest

from routepack.errors import RoutepackError
from routepack.integrations import megatron as rm
from routepack.model import Topology


class FakeParallelState:
    """The seven getters of ``megatron.core.parallel_state`` that `groups_from_parallel_state` reads."""

    def __init__(self, pp=1, vpp=None, pp_rank=0, dp=4, dp_rank=1):
        self.pp, self.vpp, self.pp_rank, self.dp, self.dp_rank = pp, vpp, pp_rank, dp, dp_rank
        self.calls = []

    def _log(self, name, value):
        self.calls.append(name)
        return value

    def get_expert_model_parallel_group(self):
        return self._log("ep", "EP")

    def get_pipeline_model_parallel_world_size(self):
        return self._log("pp_size", self.pp)

    def get_pipeline_model_parallel_group(self):
        return self._log("pp", "PP")

    def get_pipeline_model_parallel_rank(self):
        return self._log("pp_rank", self.pp_rank)

    def get_virtual_pipeline_model_parallel_world_size(self):
        return self._log("vpp", self.vpp)

    def get_data_parallel_rank(self):
        return self._log("dp_rank", self.dp_rank)

    def get_data_parallel_world_size(self):
        return self._log("dp_size", self.dp)


def test_groups_from_parallel_state_reads_megatrons_getters():
    assert rm.groups_from_parallel_state(FakeParallelState()) == rm.MegatronGroups("EP", None, 0, 1, 1, 1, 4)
    ps = FakeParallelState(pp=2, vpp=3, pp_rank=1)
    assert rm.groups_from_parallel_state(ps) == rm.MegatronGroups("EP", "PP", 1, 2, 3, 1, 4)
    assert {"ep", "pp", "pp_rank", "vpp", "dp_rank", "dp_size"} <= set(ps.calls)


def test_importing_the_groups_needs_no_framework():
    """`rm.MegatronGroups` is served by the numpy-only package (no torch, no Megatron)."""
    assert "routepack.integrations.megatron.groups" in sys.modules
    assert rm.MegatronGroups.__module__ == "routepack.integrations.megatron.groups"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"ep": None}, "groups.ep: the expert-parallel process group is required"),
        ({"pp_size": 2}, "groups.pp: a pipeline group exactly when pp_size > 1"),
        ({"pp": "PP"}, "groups.pp: a pipeline group exactly when pp_size > 1"),
        ({"pp": "PP", "pp_size": 2, "pp_rank": 2}, "groups: pp_rank=2 of pp_size=2"),
        ({"dp_rank": 4}, "dp_rank=4 of dp_size=4"),
        ({"dp_size": 0}, "groups.dp_size: expected an int >= 1, got 0"),
        ({"vpp_size": True}, "groups.vpp_size: expected an int >= 1, got True"),
        ({"pp_rank": -1}, "groups.pp_rank: expected an int >= 0, got -1"),
    ],
)
def test_groups_that_contradict_themselves_are_refused(change, message):
    good = rm.MegatronGroups("EP", dp_rank=1, dp_size=4)
    assert good.check() is good
    with pytest.raises(RoutepackError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(good, **change).check()


def test_the_groups_check_the_plans_topology():
    topo = Topology(dp=4, ep=2, gpus_per_node=2, slots_per_rank=4, pp=2, layers_per_stage=(1, 3))
    groups = rm.MegatronGroups("EP", "PP", pp_rank=1, pp_size=2, dp_rank=3, dp_size=4)
    assert groups.pipeline_stage(topo, 4, [1, 2, 3]) == (1, "PP")
    assert groups.ep_group_index(topo, 1) == 1
    with pytest.raises(RoutepackError, match=r"gives pipeline stage 1 MoE layers \[1, 2, 3\].*holds \[2, 3\]"):
        groups.pipeline_stage(topo, 4, [2, 3])
    with pytest.raises(RoutepackError, match=r"topo: pp=2, vpp=1; Megatron runs pipeline_model_parallel_size=1"):
        rm.MegatronGroups("EP", dp_rank=3, dp_size=4).pipeline_stage(topo, 4, [0, 1, 2, 3])
    with pytest.raises(RoutepackError, match=r"this rank DP 3, EP 0 \(routepack's EP groups are consecutive"):
        groups.ep_group_index(topo, 0)
    with pytest.raises(RoutepackError, match=r"topo: dp=4, ep=2; Megatron has DP size 2"):
        dataclasses.replace(groups, dp_rank=1, dp_size=2).ep_group_index(topo, 1)
    flat = Topology(dp=4, ep=2, gpus_per_node=2, slots_per_rank=4)
    assert rm.MegatronGroups("EP", dp_rank=2, dp_size=4).pipeline_stage(flat, 4, [0, 1, 2, 3]) == (0, None)


def test_the_microbatch_state_keeps_copies_from_forward_to_backward():
    torch = pytest.importorskip("torch")
    from routepack.integrations.megatron.microbatch import MicrobatchState

    st = MicrobatchState(2, restores=5)
    assert st.micro is None and st.restores == 5 and st.backwards == [0, 0] and st.completed == [0, 0]
    received = []
    written = []

    def receive(tag):
        received.append(tag)
        return [torch.full((1,), float(tag))]

    st.start(0)
    st.keep(0, 7, 1, lambda: receive(0))
    st.keep(0, 7, 1, lambda: receive(99))  # a recomputed forward finds them kept
    assert received == [0] and st.micro == 0
    assert st.load(1, 0, written.append) and not st.load(1, 0, written.append)  # loaded once
    st.start(1)  # micro 1's forward refills the buffers ...
    st.keep(1, 7, 1, lambda: receive(1))
    assert st.load(1, 1, written.append)
    assert st.load(1, 0, written.append)  # ... micro 0's backward puts its own copies back
    assert [float(w[0]) for w in written] == [0.0, 1.0, 0.0]
    st.drop(0, 1)
    assert not st.load(1, 0, written.append) and (1, 1) in st.copies
    st.leave()
    assert st.micro is None and st.copies == {} and st.loaded == {}


def test_the_microbatch_state_counts_each_layers_backwards():
    pytest.importorskip("torch")
    from routepack.integrations.megatron.microbatch import MicrobatchState

    st = MicrobatchState(2)
    assert [st.count_backward(0, 3) for _ in range(3)] == [False, False, True]
    assert st.backwards == [0, 0] and st.completed == [1, 0]
    assert st.count_backward(1, 3) is False
    assert st.part_way([4, 5]) == {5: 1}
    assert st.take_idle([4, 5]) == [5] and st.completed == [0, 0]
    assert st.take_idle([4, 5]) == [4, 5]
