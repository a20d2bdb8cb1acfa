"""The accelerators: the one table of known GPUs, :class:`HardwareConfig` and :class:`Strategy`.

:data:`GPU_TYPES` holds everything plora knows about an accelerator -- memory (the default of
``hardware.gpu_memory_gib``) and the datasheet speeds the step-time model needs (dense bf16
peak, memory and link bandwidth). An accelerator not listed needs ``gpu_memory_gib`` and
``peak_tflops`` in the sweep file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from plora.config.errors import ConfigError
from plora.config.validate import as_float, as_int, as_str


class Strategy(StrEnum):
    """How a job with d > 1 GPUs splits the base model."""

    TP = "tp"
    FSDP = "fsdp"
    PP = "pp"
    FSDP_OFFLOAD = "fsdp_offload"
    """``fsdp`` with the frozen base's shards in pinned host memory (FSDP2's
    ``CPUOffloadPolicy``): each layer's shard is copied to its GPU and all-gathered as the layer
    runs, for a base that does not fit its d GPUs even sharded. Not named in
    ``planner.strategies``: ``planner.cpu_offload`` lets the planner use it (an option of
    ``fsdp``, kept apart from it wherever jobs are priced, grouped and profiled)."""

    @property
    def mesh_dim(self) -> str:
        """The device-mesh dimension the strategy splits over (``fsdp_offload``: ``fsdp``)."""
        return str(Strategy.FSDP) if self is Strategy.FSDP_OFFLOAD else str(self)


#: Strategies a sweep's ``planner.strategies`` may name.
SUPPORTED_STRATEGIES: tuple[Strategy, ...] = (Strategy.TP, Strategy.FSDP, Strategy.PP)
#: Every strategy a plan's job may have, which the runtime's resident worker groups run for
#: d > 1 (``plora.parallel.session.ParallelPackSession``): the named ones and ``fsdp_offload``.
JOB_STRATEGIES: tuple[Strategy, ...] = (*SUPPORTED_STRATEGIES, Strategy.FSDP_OFFLOAD)
#: The strategies that shard the base with FSDP (rows split over the ranks, base all-gathered).
FSDP_STRATEGIES: frozenset[Strategy] = frozenset({Strategy.FSDP, Strategy.FSDP_OFFLOAD})


@dataclass(frozen=True, kw_only=True, slots=True)
class GPUSpec:
    """One accelerator: its memory and speeds."""

    name: str
    memory_gib: float
    """Memory per device, GiB (for ``cpu``: the host RAM budget of one CPU worker slot)."""
    peak_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s (datasheet; fp16 for V100, fp32 for cpu)."""
    hbm_gbps: float
    """Device memory bandwidth, GB/s."""
    link_gbps: float
    """GPU-to-GPU bandwidth per direction, GB/s (NVLink, else PCIe)."""

    def __post_init__(self) -> None:
        if not (self.peak_tflops > 0 and self.hbm_gbps > 0 and self.link_gbps > 0):
            raise ConfigError(f"gpu {self.name}: peak_tflops, hbm_gbps and link_gbps must be > 0")

    @property
    def peak_flops(self) -> float:
        """Peak FLOP/s."""
        return self.peak_tflops * 1e12


#: Known accelerators. ``cpu`` stands for a CPU worker (``num_gpus`` = worker slots).
GPU_TYPES: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec(name="H200", memory_gib=141.0, peak_tflops=989.0, hbm_gbps=4800.0, link_gbps=450.0),
        GPUSpec(name="H100", memory_gib=80.0, peak_tflops=989.0, hbm_gbps=3350.0, link_gbps=450.0),
        GPUSpec(
            name="H100-80GB", memory_gib=80.0, peak_tflops=989.0, hbm_gbps=3350.0, link_gbps=450.0
        ),
        GPUSpec(
            name="B200", memory_gib=180.0, peak_tflops=2250.0, hbm_gbps=8000.0, link_gbps=900.0
        ),
        GPUSpec(
            name="A100-80GB", memory_gib=80.0, peak_tflops=312.0, hbm_gbps=2039.0, link_gbps=300.0
        ),
        GPUSpec(
            name="A100-40GB", memory_gib=40.0, peak_tflops=312.0, hbm_gbps=1555.0, link_gbps=300.0
        ),
        GPUSpec(
            name="V100-32GB", memory_gib=32.0, peak_tflops=125.0, hbm_gbps=900.0, link_gbps=150.0
        ),
        GPUSpec(
            name="V100-16GB", memory_gib=16.0, peak_tflops=125.0, hbm_gbps=900.0, link_gbps=150.0
        ),
        GPUSpec(name="L40S", memory_gib=48.0, peak_tflops=362.0, hbm_gbps=864.0, link_gbps=32.0),
        GPUSpec(name="A6000", memory_gib=48.0, peak_tflops=154.8, hbm_gbps=768.0, link_gbps=32.0),
        GPUSpec(name="A10", memory_gib=24.0, peak_tflops=125.0, hbm_gbps=600.0, link_gbps=32.0),
        GPUSpec(name="A10G", memory_gib=24.0, peak_tflops=70.0, hbm_gbps=600.0, link_gbps=32.0),
        GPUSpec(name="L4", memory_gib=24.0, peak_tflops=121.0, hbm_gbps=300.0, link_gbps=32.0),
        GPUSpec(name="RTX4090", memory_gib=24.0, peak_tflops=82.6, hbm_gbps=1008.0, link_gbps=32.0),
        GPUSpec(name="cpu", memory_gib=16.0, peak_tflops=0.2, hbm_gbps=20.0, link_gbps=5.0),
    )
}


def gpu_spec(name: str, *, peak_tflops: float | None = None) -> GPUSpec:
    """The :class:`GPUSpec` of ``name``; an unknown type needs ``peak_tflops``."""
    if name in GPU_TYPES and peak_tflops is None:
        return GPU_TYPES[name]
    if peak_tflops is None:
        raise ConfigError(
            f"hardware.gpu_type: {name!r} has no known peak FLOP/s; use one of "
            f"{', '.join(GPU_TYPES)} or give its dense bf16 peak_tflops"
        )
    known = GPU_TYPES.get(name)
    return GPUSpec(
        name=name,
        memory_gib=known.memory_gib if known else 0.0,
        peak_tflops=peak_tflops,
        hbm_gbps=known.hbm_gbps if known else 1000.0,
        link_gbps=known.link_gbps if known else 32.0,
    )


def _gpu_key(name: str) -> str:
    """Spelling-insensitive GPU name: ``a100_40gb``, ``A100-40G`` and ``A100 40GB`` -> ``A10040``."""
    key = re.sub(r"[\s_]+", "-", name.strip().upper())
    return re.sub(r"-(\d+)GB?$", r"-\1", key).replace("-", "")


_GPU_LOOKUP = {_gpu_key(k): k for k in GPU_TYPES}


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareConfig:
    """The accelerators a sweep may use (one node)."""

    num_gpus: int = 1
    """GPUs the planner may use at once (for ``gpu_type: cpu``, CPU worker slots)."""
    gpu_type: str = "H200"
    """Accelerator name, e.g. A100-40GB, H100, H200, A10 or cpu; sets the memory default."""
    gpu_memory_gib: float | None = None
    """Memory per GPU in GiB; defaults from :data:`GPU_TYPES` for a known ``gpu_type``, needed
    (with ``peak_tflops``) for another."""
    load_factor: float = 0.9
    """C in (0, 1]: the fraction of GPU memory the planner may fill (fragmentation headroom)."""
    peak_tflops: float | None = None
    """Dense bf16 peak TFLOP/s of one GPU; needed (with ``gpu_memory_gib``) for a ``gpu_type``
    the cost model does not know (:data:`GPU_TYPES`)."""

    def __post_init__(self) -> None:
        as_int(self.num_gpus, "num_gpus", ge=1, fix="use at least 1 GPU")
        gpu_type = as_str(self.gpu_type, "gpu_type", fix="e.g. A100-40GB, H100 or cpu")
        canonical = _GPU_LOOKUP.get(_gpu_key(gpu_type))
        if canonical:
            object.__setattr__(self, "gpu_type", canonical)
        if canonical is None and (self.gpu_memory_gib is None or self.peak_tflops is None):
            # the planner needs both: how much a GPU holds, how fast it computes (GPU_TYPES)
            units = {"gpu_memory_gib": "GiB per GPU", "peak_tflops": "dense bf16 TFLOP/s"}
            missing = [k for k in units if getattr(self, k) is None]
            raise ConfigError(
                f"unknown gpu_type and no {' or '.join(missing)}", key="gpu_type", value=gpu_type,
                fix=f"set {' and '.join(f'{k} ({units[k]})' for k in missing)}, or use one of "
                f"{', '.join(GPU_TYPES)}",
            )  # fmt: skip
        if self.gpu_memory_gib is None:
            object.__setattr__(self, "gpu_memory_gib", GPU_TYPES[str(canonical)].memory_gib)
        mem = as_float(
            self.gpu_memory_gib,
            "gpu_memory_gib",
            gt=0.0,
            fix="give the memory of one GPU in GiB, e.g. 80",
        )
        object.__setattr__(self, "gpu_memory_gib", mem)
        lf = as_float(
            self.load_factor,
            "load_factor",
            gt=0.0,
            le=1.0,
            fix="use a fraction in (0, 1], e.g. 0.9",
        )
        object.__setattr__(self, "load_factor", lf)
        if self.peak_tflops is not None:
            tf = as_float(
                self.peak_tflops, "peak_tflops", gt=0.0, fix="give the datasheet dense bf16 TFLOP/s"
            )
            object.__setattr__(self, "peak_tflops", tf)

    @property
    def is_cpu(self) -> bool:
        """Whether the 'GPUs' are CPU worker slots."""
        return self.gpu_type == "cpu"

    @property
    def usable_gib(self) -> float:
        """C * M_gpu: GiB per GPU the planner may fill."""
        return self.load_factor * float(self.gpu_memory_gib or 0.0)


__all__ = [
    "FSDP_STRATEGIES",
    "GPU_TYPES",
    "JOB_STRATEGIES",
    "SUPPORTED_STRATEGIES",
    "GPUSpec",
    "HardwareConfig",
    "Strategy",
    "gpu_spec",
]
