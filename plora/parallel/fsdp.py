"""Fully sharded data parallelism (FSDP2) for the packed engine: the frozen base sharded.

Each of ``F`` data-parallel ranks trains on its token-balanced share of every adapter's rows
(:mod:`plora.parallel.balance`); the loss it backpropagates is its share
``Σ_{t ∈ rank} CE_t / N_i`` (``N_i``: target tokens of adapter ``i``'s whole step batch), so
the gradients *summed* over ranks are the full batch's, exactly as on one process.

What is sharded. The frozen base weights of every decoder layer (one ``fully_shard`` unit per
layer, plus the decoder as the root unit holding the embeddings and final norm) are sharded
over the ``fsdp`` mesh dimension and all-gathered per layer in forward and again in backward
(``reshard_after_forward``). The LM head stays whole on every rank (``packed_loss`` calls it
chunk-wise outside the decoder; transformers' own plan keeps it full too).

What is not. The packed LoRA factors ``A``/``Bt`` are *ignored* by FSDP (``ignored_params``)
and replicated: an adapter joins or leaves by re-allocating them between steps, which FSDP's
managed parameters cannot follow, and :class:`~plora.engine.packed_optim.PackedAdamW` keeps
them in flat buffers; they are a few per cent of the base. Their gradients are summed over the
``fsdp`` group by :class:`plora.parallel.optim.ParallelPackedAdamW` (one all-reduce per buffer
width) and every rank takes the same AdamW step.

``shard_base=False`` keeps the base whole on every rank (no FSDP at all: pure data parallelism
of the adapters) when it fits -- FSDP re-gathers the base every micro-step, which costs more
than it saves when memory is not the limit.

CPU offload (``cpu_offload=True``, the ``fsdp_offload`` strategy): every unit gets FSDP2's
``CPUOffloadPolicy``, so the sharded base lives in host memory (pinned on CUDA) and each layer's
shard is copied to the GPU just before its all-gather, forward and again in backward. The base
is frozen, so no gradient or optimizer state goes back. The adapters are ignored by FSDP and
stay on the GPU; so does the LM head. Build the model on the CPU and let ``fully_shard`` shard
each unit in place (a base too big for one GPU never is on one whole); the trainer then moves
the rest with :func:`to_device_but_offloaded`. A plain ``model.to(device)`` would move the
host shards too, and FSDP2 refuses to run offloaded parameters found on the GPU ("FSDP
parameters should be materialized on CPU when enabling CPU offloading").
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from plora.engine.adapters import packed_layers


def apply_fsdp(
    model: nn.Module,
    *,
    dp_mesh: DeviceMesh,
    shard_base: bool = True,
    reshard_after_forward: bool = True,
    stage: nn.Module | None = None,
    cpu_offload: bool = False,
) -> None:
    """Shard the frozen base of ``model``'s decoder over ``dp_mesh`` (in place).

    Call after ``inject`` and :func:`plora.parallel.tp.apply_tp` (FSDP then shards each rank's
    TP shards over the data-parallel ranks), before the trainer is built.

    Args:
        model: a HF causal LM with :class:`~plora.engine.lora.PackedLoRALinear` projections.
        dp_mesh: the 1-D ``fsdp`` mesh (``mesh["fsdp"]``).
        shard_base: False keeps the base replicated (only the adapters' gradients are summed).
        reshard_after_forward: free each layer's gathered weights after its forward (ZeRO-3);
            False keeps them until backward (ZeRO-2-like, more memory, half the all-gathers).
        stage: this rank's pipeline stage (:func:`plora.parallel.pp.apply_pp`): it, not the
            decoder, is the root unit (the pipeline calls it; it holds the embeddings / norm).
        cpu_offload: keep the sharded base in host memory (``CPUOffloadPolicy``; pinned when
            the mesh is on CUDA -- pinning needs an accelerator).
    """
    if dp_mesh.ndim != 1:
        raise ValueError(f"apply_fsdp: dp_mesh must be 1-D, got {dp_mesh.ndim} dims")
    if not shard_base:
        if cpu_offload:
            raise ValueError("apply_fsdp: cpu_offload offloads the sharded base; shard it")
        return
    offload = (
        CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda")
        if cpu_offload
        else OffloadPolicy()
    )
    layers = packed_layers(model)
    if not layers:
        raise ValueError("apply_fsdp: no PackedLoRALinear in the model; inject it first")
    adapters = {p for layer in layers.values() for p in (layer.A, layer.Bt)}
    decoder = getattr(model, str(model.base_model_prefix))
    for block in decoder.layers:
        if any(True for _ in block.parameters()):  # pipeline stages leave placeholders
            fully_shard(
                block,
                mesh=dp_mesh,
                reshard_after_forward=reshard_after_forward,
                ignored_params=adapters,
                offload_policy=offload,
            )
    root = decoder if stage is None else stage
    fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, ignored_params=adapters,
                offload_policy=offload)  # fmt: skip


def to_device_but_offloaded(model: nn.Module, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` in place, leaving its DTensors where parallelizing put them.

    :func:`plora.parallel.parallelize` places every DTensor it makes: TP and FSDP shards on the
    mesh's device, and under :func:`apply_fsdp` with ``cpu_offload`` the base's shards in host
    memory, where FSDP2 must find them. Every plain tensor moves: the adapters FSDP ignores,
    the LM head, a pipeline stage's own weights, buffers such as RoPE's frequencies. Tensors
    keep their identity where ``nn.Module.to`` keeps it (``.data`` is replaced).

    Returns:
        ``model``.
    """
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(param, DTensor) or param.device == device:
                continue
            moved = param.data.to(device)
            if torch._has_compatible_shallow_copy_type(param.data, moved):
                param.data = moved
            else:  # e.g. to ``meta``: a new parameter, as ``nn.Module.to`` makes then
                setattr(module, name, nn.Parameter(moved, requires_grad=param.requires_grad))
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and not isinstance(buf, DTensor) and buf.device != device:
                module._buffers[name] = buf.to(device)
    return model


__all__ = ["apply_fsdp", "to_device_but_offloaded"]
