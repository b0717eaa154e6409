"""What a ``routepack bench`` run plans on: a built-in profile, or your own model, cluster and
hardware (``--model``, ``--topology``, ``--hardware``) for your own windows (``--npz``); and its
windows: the profile's synthetic trace, your files, or one of Megatron's imbalance workloads
(``--workload W0..W7``, `routepack.workloads`).

* ``--model PATH``: a Hugging Face ``config.json`` (`routepack.hf_config`: MoE layers, experts,
  top-k, hidden, expert FFN, shared experts, groups, attention kinds), or a JSON object of
  `ModelShape`'s fields.
* ``--topology SPEC``: ``dp=64,ep=32,gpus_per_node=8,slots_per_rank=17`` (and any other
  `Topology` field: ``nvlink_domain=72``, ``replica_slots=4``, ``pp=``, ``vpp=``), or a JSON file
  of those fields.
* ``--hardware NAME``: a `Hardware` preset the cost model is derived from (``h200``,
  ``gb200_nvl72``); ``--cost`` takes a calibrated cost model instead.

The run's profile is the built-in one (``--profile``) with these replaced: its trace statistics
drive synthetic windows; with ``--npz`` the windows are yours and must have the model's layers
and experts. `board_topology`: the topology every policy plans under holds MoonEP's ⌈E / ep⌉
prefetch buffers a rank where ``moonep`` runs, UltraEP's half of that where ``ultraep`` does (their
users' configurations; no other policy uses more than 3 with its defaults, so their plans are
unchanged; the lower bound, which relies on the buffer count, is taken with them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, Iterable, Sequence

from routepack.errors import RoutepackError
from routepack.model import Topology
from routepack.stages.replication_live import experts_per_rank
from routepack.traces import Profile
from routepack.workloads import WORKLOADS

#: `Topology` fields ``--topology`` takes.
TOPOLOGY_FIELDS = tuple(f.name for f in dataclasses.fields(Topology))
#: `Hardware` presets ``--hardware`` names.
HARDWARE = ("h200", "gb200_nvl72")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of this module, on a bench parser."""
    p.add_argument("--model", default=None, help="your model: a Hugging Face config.json (or ModelShape JSON)")
    p.add_argument(
        "--topology",
        default=None,
        help="your cluster: 'dp=64,ep=32,gpus_per_node=8,slots_per_rank=17[,nvlink_domain=72,...]' or a JSON file",
    )
    p.add_argument("--hardware", choices=HARDWARE, default=None, help="the Hardware preset (default: the profile's)")
    p.add_argument(
        "--break-even",
        action="store_true",
        dest="break_even",
        help="sweep max_vio x tokens per rank for moonep, ultraep and routepack over no balancing (break_even)",
    )
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default=None,
        help="Megatron's token-imbalance workload (PR 7488's W0-W7) on the profile's samples instead of its trace",
    )


def _topology_fields(spec: str) -> Dict[str, Any]:
    """``--topology``'s fields from ``k=v,...`` or a JSON file."""
    path = Path(spec)
    if "=" not in spec:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise RoutepackError(f"--topology {spec}: not 'field=value,...' nor a readable JSON file ({e})") from None
        if not isinstance(data, dict):
            raise RoutepackError(f"--topology {spec}: expected a JSON object of Topology fields")
        fields = dict(data)
    else:
        fields = {}
        for part in filter(None, spec.split(",")):
            key, sep, value = part.partition("=")
            if not sep:
                raise RoutepackError(f"--topology: {part!r} is not field=value")
            try:
                fields[key.strip()] = int(value)
            except ValueError:
                raise RoutepackError(f"--topology: {key.strip()}={value!r} is not an integer") from None
    unknown = sorted(set(fields) - set(TOPOLOGY_FIELDS))
    if unknown:
        raise RoutepackError(f"--topology: unknown field(s) {unknown}; known: {list(TOPOLOGY_FIELDS)}")
    return fields


def run_profile(args: argparse.Namespace, prof: Profile) -> Profile:
    """The profile a run plans on: ``prof`` with ``--model``, ``--topology``, ``--hardware``
    applied (errors name the flag)."""
    changes: Dict[str, Any] = {}
    if getattr(args, "model", None):
        from routepack.hf_config import load_model

        m = load_model(args.model)
        changes.update(
            num_layers=m.num_layers,
            num_experts=m.num_experts,
            top_k=m.top_k,
            hidden=m.hidden,
            expert_ffn=m.expert_ffn,
            attention=tuple(m.attention),
            shared_experts=m.shared_experts,
            expert_groups=m.expert_groups,
        )
    topo_fields: Dict[str, Any] = {}
    if getattr(args, "topology", None):
        topo_fields = _topology_fields(args.topology)
        Topology(**{**_topology_of(prof), **topo_fields})  # the topology's own checks, named topo.<field>
        for key in ("dp", "ep", "gpus_per_node", "slots_per_rank", "pp", "vpp", "nvlink_domain"):
            if key in topo_fields:
                changes[key] = topo_fields[key]
    if getattr(args, "hardware", None):
        changes["hardware"] = args.hardware
    if not changes:
        return prof
    name = prof.name if not (args.model or args.topology) else "custom"
    try:
        return dataclasses.replace(prof, name=name, **changes)
    except RoutepackError as e:
        flag = "--topology" if args.topology else "--model"
        raise RoutepackError(f"{flag}: {e}") from None


def _topology_of(prof: Profile) -> Dict[str, Any]:
    return {
        "dp": prof.dp,
        "ep": prof.ep,
        "gpus_per_node": prof.gpus_per_node,
        "slots_per_rank": prof.slots_per_rank,
        "pp": prof.pp,
        "vpp": prof.vpp,
        "nvlink_domain": prof.nvlink_domain,
    }


def board_topology(args: argparse.Namespace, topo: Topology, num_experts: int, policies: Sequence[str]) -> Topology:
    """``topo`` with the replica buffers the run's policies need: MoonEP's ⌈E / ep⌉ where it runs,
    UltraEP's half of that where it runs, at least what ``--topology replica_slots=`` sets."""
    fields = _topology_fields(args.topology) if getattr(args, "topology", None) else {}
    if "replica_slots" in fields:
        topo = dataclasses.replace(topo, replica_slots=fields["replica_slots"])
    per = experts_per_rank(num_experts, topo.ep)
    need = max([per] * ("moonep" in policies) + [-(-per // 2)] * ("ultraep" in policies), default=0)
    if topo.replica_slots < need:
        topo = dataclasses.replace(topo, replica_slots=need)
    return topo


def hardware_name(prof: Profile) -> str:
    """How the cost-model line names a profile's hardware preset."""
    return {"h200": "H200 datasheet-level, see routepack.Hardware.h200"}.get(
        prof.hardware, f"{prof.hardware} datasheet-level, see routepack.Hardware.{prof.hardware}"
    )


def check(args: argparse.Namespace) -> Iterable[str]:
    """Why the flags of this module do not go with the others (messages), none if they do."""
    if getattr(args, "workload", None) and args.npz:
        yield "--workload does not apply with --npz (the files are the windows)"
    if getattr(args, "break_even", False):
        for flag in ("npz", "workload", "policy", "sweep"):
            if getattr(args, flag, None):
                yield f"--{flag} does not apply with --break-even (it makes its own windows and runs its own policies)"
    if getattr(args, "hardware", None) and args.cost:
        yield "--hardware does not apply with --cost (the cost model is given)"


__all__ = ["HARDWARE", "add_arguments", "board_topology", "check", "hardware_name", "run_profile"]
