"""The parallel degrees of one job and the device mesh they span.

A job on ``d`` devices runs with ``d = pp · fsdp · tp`` (torchtitan's ``ParallelDims``). The
mesh is laid out ``(pp, fsdp, tp)`` with ``tp`` innermost, so a TP group is ``tp`` consecutive
ranks (one NVLink island on a real host) and an FSDP group takes one rank of each TP group::

    rank = (p · fsdp + f) · tp + t      for p < pp, f < fsdp, t < tp

Only the dimensions of size > 1 are named in the mesh (``"pp"``, ``"fsdp"``, ``"tp"``); a job
with ``d = 1`` has no mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from plora.cost import Strategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The mesh's dimension names, outermost first.
MESH_DIMS = ("pp", "fsdp", "tp")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """Degrees of pipeline, fully-sharded data and tensor parallelism of one job.

    Raises ``ValueError`` naming the bad value when a degree is not a positive power of two or
    when the degrees do not multiply to ``world_size``.
    """

    pp: int = 1
    """Pipeline stages: the decoder layers split into ``pp`` consecutive runs (1F1B)."""
    fsdp: int = 1
    """Data-parallel ranks: each takes a token-balanced share of every adapter's rows; the
    frozen base is sharded over them (FSDP2) unless kept whole."""
    tp: int = 1
    """Tensor-parallel ranks: each projection split column- or row-wise (Megatron)."""
    world_size: int = 1
    """Processes in the job; must equal ``pp · fsdp · tp``."""

    def __post_init__(self) -> None:
        for name in ("pp", "fsdp", "tp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims: {name}={value!r} must be a positive integer")
            if value & (value - 1):
                raise ValueError(f"ParallelDims: {name}={value} must be a power of two")
        if self.pp * self.fsdp * self.tp != self.world_size:
            raise ValueError(
                f"ParallelDims: pp={self.pp} x fsdp={self.fsdp} x tp={self.tp} = "
                f"{self.pp * self.fsdp * self.tp} != world_size={self.world_size}; "
                "the degrees must multiply to the number of processes"
            )

    @classmethod
    def for_job(cls, d: int, strategy: Strategy | str | None) -> ParallelDims:
        """The dims of a plan's job: ``d`` devices all on one strategy (``None`` iff ``d = 1``;
        ``fsdp_offload`` is ``fsdp``'s degree, its offload the session's ``cpu_offload``)."""
        if strategy is None:
            if d != 1:
                raise ValueError(f"ParallelDims: d={d} needs a strategy (tp, fsdp or pp)")
            return cls()
        return cls(**{Strategy(strategy).mesh_dim: d}, world_size=d)

    @property
    def sizes(self) -> dict[str, int]:
        """``{dim: degree}`` of the dimensions of size > 1, outermost first."""
        return {n: getattr(self, n) for n in MESH_DIMS if getattr(self, n) > 1}

    @property
    def enabled(self) -> tuple[str, ...]:
        """Names of the dimensions of size > 1, outermost first."""
        return tuple(self.sizes)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": p, "fsdp": f, "tp": t}`` of global ``rank`` (see the module docstring)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ParallelDims: rank={rank} not in [0, {self.world_size})")
        return {
            "pp": rank // (self.fsdp * self.tp),
            "fsdp": rank // self.tp % self.fsdp,
            "tp": rank % self.tp,
        }

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The ``(pp, fsdp, tp)`` mesh (only dims > 1) on ``"cuda"`` or ``"cpu"`` (gloo).

        Needs an initialised default process group of ``world_size`` ranks; ``None`` when
        ``world_size == 1``.
        """
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"ParallelDims: device_type={device_type!r} must be cuda or cpu")
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.sizes
        return init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))


__all__ = ["MESH_DIMS", "ParallelDims"]
