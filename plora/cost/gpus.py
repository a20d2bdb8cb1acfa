"""Speeds of known accelerators: datasheet dense bf16 peak, memory and link bandwidth.

Memory sizes live in ``plora.config.GPU_MEMORY_GIB`` (``HardwareConfig.gpu_memory_gib``);
this table gives what the step-time model needs. An accelerator not listed needs its peak
(``hardware.peak_tflops``).
"""

from __future__ import annotations

from dataclasses import dataclass

from plora.config import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class GPUSpec:
    """Speed of one accelerator (memory comes from ``HardwareConfig.gpu_memory_gib``)."""

    name: str
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


#: Datasheet numbers of known accelerators (names as in ``plora.config.GPU_MEMORY_GIB``).
GPU_TYPES: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec(name="H200", peak_tflops=989.0, hbm_gbps=4800.0, link_gbps=450.0),
        GPUSpec(name="H100", peak_tflops=989.0, hbm_gbps=3350.0, link_gbps=450.0),
        GPUSpec(name="H100-80GB", peak_tflops=989.0, hbm_gbps=3350.0, link_gbps=450.0),
        GPUSpec(name="B200", peak_tflops=2250.0, hbm_gbps=8000.0, link_gbps=900.0),
        GPUSpec(name="A100-80GB", peak_tflops=312.0, hbm_gbps=2039.0, link_gbps=300.0),
        GPUSpec(name="A100-40GB", peak_tflops=312.0, hbm_gbps=1555.0, link_gbps=300.0),
        GPUSpec(name="V100-32GB", peak_tflops=125.0, hbm_gbps=900.0, link_gbps=150.0),
        GPUSpec(name="V100-16GB", peak_tflops=125.0, hbm_gbps=900.0, link_gbps=150.0),
        GPUSpec(name="L40S", peak_tflops=362.0, hbm_gbps=864.0, link_gbps=32.0),
        GPUSpec(name="A6000", peak_tflops=154.8, hbm_gbps=768.0, link_gbps=32.0),
        GPUSpec(name="A10", peak_tflops=125.0, hbm_gbps=600.0, link_gbps=32.0),
        GPUSpec(name="A10G", peak_tflops=70.0, hbm_gbps=600.0, link_gbps=32.0),
        GPUSpec(name="L4", peak_tflops=121.0, hbm_gbps=300.0, link_gbps=32.0),
        GPUSpec(name="RTX4090", peak_tflops=82.6, hbm_gbps=1008.0, link_gbps=32.0),
        GPUSpec(name="cpu", peak_tflops=0.2, hbm_gbps=20.0, link_gbps=5.0),
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
        peak_tflops=peak_tflops,
        hbm_gbps=known.hbm_gbps if known else 1000.0,
        link_gbps=known.link_gbps if known else 32.0,
    )


__all__ = ["GPU_TYPES", "GPUSpec", "gpu_spec"]
