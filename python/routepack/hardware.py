"""Per-GPU rates of the hardware a cost model is derived from (`CostModel.from_model`), and the
datasheet presets: H200 (8-GPU NVLink nodes) and GB200 NVL72 (a 72-GPU NVLink domain)."""

from __future__ import annotations

from dataclasses import dataclass

from routepack._checks import finite_float
from routepack.errors import RoutepackError, RoutepackTypeError

#: GPUs of one GB200 NVL72 rack's NVLink domain (`Topology.nvlink_domain`) and of one of its
#: compute trays (`Topology.gpus_per_node`): 18 trays of 2 Grace CPUs and 4 Blackwell GPUs.
NVL72_DOMAIN = 72
NVL72_GPUS_PER_NODE = 4


@dataclass(frozen=True)
class Hardware:
    """Per-GPU rates. Figures from presets are datasheet-level, scaled by achieved fractions.

    ``bw_intra`` is the link inside an NVLink domain (a node, or a rack-scale domain:
    `Topology.nvlink_domain`), ``bw_inter`` the link between domains."""

    name: str
    flops: float  # peak dense bf16 FLOP/s
    flops_efficiency: float  # fraction of peak a grouped GEMM / attention kernel achieves
    bw_intra: float  # bytes/s one direction, per GPU, inside an NVLink domain
    bw_inter: float  # bytes/s one direction, per GPU, between domains (InfiniBand/RoCE)
    comm_efficiency: float  # fraction of link bandwidth an all-to-all achieves
    expert_overhead_s: float  # fixed time per active expert per layer (kernel/tile overhead)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise RoutepackTypeError(f"hardware.name: expected a str, got {type(self.name).__name__} {self.name!r}")
        for name in ("flops", "bw_intra", "bw_inter"):
            object.__setattr__(self, name, finite_float(getattr(self, name), f"hardware.{name}", strict=True))
        for name in ("flops_efficiency", "comm_efficiency"):
            v = finite_float(getattr(self, name), f"hardware.{name}", strict=True)
            if v > 1:
                raise RoutepackError(f"hardware.{name}: must be in (0, 1], got {v}")
            object.__setattr__(self, name, v)
        object.__setattr__(
            self, "expert_overhead_s", finite_float(self.expert_overhead_s, "hardware.expert_overhead_s")
        )

    @classmethod
    def h200(cls) -> "Hardware":
        """NVIDIA H200 SXM, datasheet-level: 989 TFLOP/s dense bf16, NVLink 900 GB/s
        bidirectional (450 GB/s per direction), one 400 Gb/s NIC per GPU (50 GB/s). The
        efficiency fractions are assumptions, not measurements; calibrate on real runs."""
        return cls(
            name="h200",
            flops=989e12,
            flops_efficiency=0.5,
            bw_intra=450e9,
            bw_inter=50e9,
            comm_efficiency=0.8,
            expert_overhead_s=2e-6,
        )

    @classmethod
    def gb200_nvl72(cls) -> "Hardware":
        """NVIDIA GB200 NVL72, datasheet-level, per Blackwell GPU: 2.5 PFLOP/s dense bf16 (the
        rack's 180 PFLOP/s over 72 GPUs), fifth-generation NVLink 1.8 TB/s bidirectional (900 GB/s
        per direction) to every GPU of the rack's 72-GPU domain through the NVLink switches
        (`NVL72_DOMAIN`; a topology sets ``nvlink_domain=72``, ``gpus_per_node=4``), one
        400 Gb/s ConnectX-7 NIC per GPU between racks (50 GB/s). The efficiency fractions and
        the per-expert overhead are H200's, assumptions, not measurements; calibrate on real
        runs."""
        return cls(
            name="gb200_nvl72",
            flops=2.5e15,
            flops_efficiency=0.5,
            bw_intra=900e9,
            bw_inter=50e9,
            comm_efficiency=0.8,
            expert_overhead_s=2e-6,
        )
