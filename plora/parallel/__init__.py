"""Packed jobs on several devices: FSDP2, tensor and pipeline parallelism (torchtitan style).

A job of ``d`` devices runs ``d`` processes with one process group and a
:class:`~plora.parallel.dims.ParallelDims` mesh ``(pp, fsdp, tp)``. Each process builds the
same model, calls :func:`parallelize` and trains with
:class:`~plora.parallel.trainer.ParallelPackedTrainer`; losses and adapters equal
single-process packed training (``tests/dist``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plora.engine.adapters import inject, packed_layers
from plora.parallel.dims import ParallelDims
from plora.parallel.pp import PipelineStageModule


def parallelize(
    model: nn.Module,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    shard_base: bool = True,
    cpu_offload: bool = False,
) -> PipelineStageModule | None:
    """Parallelise ``model`` in place for this rank; returns its pipeline stage (PP) or None.

    Order (each step needs the previous one's result):

    1. ``inject``: wrap the seven projections in ``PackedLoRALinear`` (if not done yet).
    2. PP (:func:`~plora.parallel.pp.apply_pp`): keep only this rank's decoder layers, so the
       later steps touch only them.
    3. TP (:func:`~plora.parallel.tp.apply_tp`): split each projection (base and LoRA
       placements together) over the ``tp`` ranks.
    4. FSDP (:func:`~plora.parallel.fsdp.apply_fsdp`): shard each layer's (TP-local) frozen
       base over the ``fsdp`` ranks (the stage as root under PP), adapters left replicated;
       ``shard_base=False`` keeps the base whole; ``cpu_offload`` keeps the shards in host
       memory (the ``fsdp_offload`` strategy; build the model on the CPU).

    Adapters are added afterwards (the trainer's ``add``). Tested (``tests/dist``): tp, fsdp,
    pp, fsdp x tp, pp x tp and pp x fsdp (not yet all three at once: 8 processes).
    """
    if dims.world_size > 1 and mesh is None:
        raise ValueError("parallelize: world_size > 1 needs the mesh (dims.build_mesh(...))")
    if cpu_offload and dims.fsdp == 1:
        raise ValueError(f"parallelize: cpu_offload is FSDP's; dims have fsdp={dims.fsdp}")
    if not packed_layers(model):
        inject(model)
    if dims.world_size == 1:
        return None
    assert mesh is not None
    stage = None
    if dims.pp > 1:
        from plora.parallel.pp import apply_pp

        stage = apply_pp(model, pp_group=mesh["pp"].get_group())
    if dims.tp > 1:
        from plora.parallel.tp import apply_tp

        apply_tp(model, tp_group=mesh["tp"].get_group())
    if dims.fsdp > 1:
        from plora.parallel.fsdp import apply_fsdp

        apply_fsdp(model, dp_mesh=mesh["fsdp"], shard_base=shard_base, stage=stage,
                   cpu_offload=cpu_offload)  # fmt: skip
    return stage


__all__ = ["ParallelDims", "parallelize"]
