"""Golden digests of plan bytes: a plan is a pure function of its inputs, seed and move budget.

For fixed windows of `tiny` and of a small `flash`-shaped profile (flash's 512 experts top-8,
ep 32 over 4 nodes, two EP groups; fewer layers and samples so the test stays short), every
preset plans a first window and then the next one from the first plan's placement (so
migration-aware placement runs too). The sha256 of ``sample_rank``, ``sample_micro``,
``num_micro``, ``phy2log``, ``replicas`` and ``migration`` must match the committed digest.

A change that alters any plan byte must change these digests on purpose and say why in its
commit. To print the current digests: ``python tests/test_golden_digest.py``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest

import routepack as rp

PRESETS = (
    "static",
    "eplb",
    "eplb_oracle",
    "eplb_hierarchical",
    "eplb_hierarchical_oracle",
    "hot_n",
    "relibra",
    "routepack_placement",
    "routepack_packing",
    "routepack_no_replication",
    "routepack",
)

PROFILES = {
    "tiny": rp.traces.profile("tiny"),
    "flash_small": replace(
        rp.traces.profile("flash"),
        name="flash_small",
        num_layers=6,
        attention=("linear",) * 5 + ("full",),
        samples=1024,
    ),
}

#: sha256 of the plan bytes of the second window, per (profile, preset).
GOLDEN = {
    ("flash_small", "static"): "a36a77358d1aed7c93ea50fe3f0d05604b64f5d5ff2a83c73fc3eb761088911d",
    ("flash_small", "eplb"): "baae47c33d55529c265e8c3f8889727e7a647ce1a9ec7d52dd641c5093061605",
    ("flash_small", "eplb_oracle"): "8d0bc1ed2f10a9b2c8ae403277e2eab0df15e27075225b10675bfb5973451d05",
    # EPLB's hierarchical policy with one group per node: what `eplb`/`eplb_oracle` planned before
    # they took the model's own expert groups (issue 12); the same bytes as then
    ("flash_small", "eplb_hierarchical"): "9a9bbe25bd29481c7be3073c55a34fb11c245460e0c24b97c826daaeca23ee32",
    ("flash_small", "eplb_hierarchical_oracle"): "7f85d430abeb2057e407fecd695664de333999f5a8a00454e07499e26da1a3d6",
    ("flash_small", "hot_n"): "e2aa4a1571485686b606215f7948b1afa1bfdf7d2ff09117a849a23a20a505b5",
    ("flash_small", "relibra"): "6fc0b73ade04677ee92b621875fbb00de0dd915d914cdd647eee6d9b6a0a5505",
    ("flash_small", "routepack_placement"): "6cae07aa28b1cf2907f7f5c29e1fec77a577da1f6ceed7b685f68f17ef9650f1",
    # routepack's packing across nodes no longer anneals by default (DEFAULT_ANNEAL_MOVES_ACROSS_NODES):
    # these three changed then, on purpose; tiny (one node per EP group) did not
    ("flash_small", "routepack_packing"): "ec1e29d7db2d04d7ea493bfa0f1656b8daa9b83c68aa3c8b00650991f05d95ba",
    ("flash_small", "routepack_no_replication"): "4691d2d91110be859ad5a34e0f5f02b8a3f530cb71a695906719fa2998c7f314",
    ("flash_small", "routepack"): "ecc816cae64d697681b1bed4eeffbcf7ec6eae477b671367df792dd60651a49c",
    ("tiny", "static"): "dcf16d8cc09a3d9633b572a65e471184c70eb9f2697f2d9aca532bcaf78b420d",
    ("tiny", "eplb"): "5401bd3b3ec76d390e8efa1c20d57f5876d8d76221a479d1716788044f2656f6",
    ("tiny", "eplb_oracle"): "348d6b522a5b3fd9b0d54f8ae50d7003fad805ff5ecdedfea3be9be1c5457a3e",
    ("tiny", "eplb_hierarchical"): "5401bd3b3ec76d390e8efa1c20d57f5876d8d76221a479d1716788044f2656f6",
    ("tiny", "eplb_hierarchical_oracle"): "348d6b522a5b3fd9b0d54f8ae50d7003fad805ff5ecdedfea3be9be1c5457a3e",
    ("tiny", "hot_n"): "65a3f1497c041aa86a1018401723f2405b50b9a6fa89c1cca7d8e8ec2186bfe6",
    ("tiny", "relibra"): "c450944ea34eba45c6b608a191ed96354e63da9982574feeafed1ed1f37d7eab",
    ("tiny", "routepack_placement"): "7364e7342e93d097c88081c048debb17e620c0cd6bc34eb88c129ec6f5307c3e",
    ("tiny", "routepack_packing"): "ca8b4c3ff335bd7768d0caf7296c1568c1b19170b5783a71dc244054e87044a0",
    ("tiny", "routepack_no_replication"): "f4f0d22813f5694ca2db5ae61d191b49a6d23434d675504ac46c118e1aecef3d",
    ("tiny", "routepack"): "4de22f2fd80e1c0f88aa6e820b0f0e47a979acb06f92003ac7fd0fd2c39e90dd",
}


def plan_digest(plan: rp.Plan) -> str:
    """sha256 of the plan's bytes (`Plan.digest`): equal digests, equal plans."""
    return plan.digest()


@lru_cache(maxsize=None)
def _windows(profile: str):
    return tuple(rp.traces.synthetic(PROFILES[profile], 2, seed=11))


def digest(profile: str, preset: str) -> str:
    prof = PROFILES[profile]
    w0, w1 = _windows(profile)
    topo, cost, cap = prof.topology(), prof.cost(), prof.token_cap
    first = rp.plan_window(w0, topo, cost, token_cap=cap, policy=preset, previous_window=w0, seed=1)
    first.validate(w0, topo, cap)
    plan = rp.plan_window(
        w1, topo, cost, token_cap=cap, policy=preset, previous=first.placement, previous_window=w0, seed=2
    )
    plan.validate(w1, topo, cap)
    return plan_digest(plan)


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("preset", PRESETS)
def test_plan_bytes_match_the_golden_digest(profile: str, preset: str) -> None:
    assert digest(profile, preset) == GOLDEN[(profile, preset)], (
        f"plan bytes of {preset} on {profile} changed; if on purpose, update GOLDEN and say why"
    )


if __name__ == "__main__":
    for p in sorted(PROFILES):
        for name in PRESETS:
            print(f"    ({p!r}, {name!r}): {digest(p, name)!r},", flush=True)
