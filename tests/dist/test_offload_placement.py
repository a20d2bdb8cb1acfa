"""A rank's trainer under FSDP2 CPU offload leaves the base's shards in host memory.

On CUDA, FSDP2 refuses to run a ``CPUOffloadPolicy`` unit whose parameters it finds on the GPU
("FSDP parameters should be materialized on CPU when enabling CPU offloading"); the trainer's
``model.to(device)`` put them there (seen on two H200s, 2026-11-28). Here the trainer's device
is ``meta``, a device other than the host on any machine, so the placement runs on the CPU
too: one gloo process, the base sharded over a mesh of one rank, the trainer only built.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))

from _engine_testlib import TOKENIZER, tiny_model, toy_dataset

from plora.engine.adapters import inject, packed_layers
from plora.parallel.dims import ParallelDims
from plora.parallel.fsdp import apply_fsdp
from plora.parallel.trainer import ParallelPackedTrainer


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    finally:
        dist.destroy_process_group()


def test_rank_trainer_keeps_offloaded_shards_on_the_host(one_rank) -> None:
    model = tiny_model("qwen2")
    inject(model)
    apply_fsdp(model, dp_mesh=one_rank["fsdp"], cpu_offload=True)
    trainer = ParallelPackedTrainer(
        model, TOKENIZER, toy_dataset(), device="meta", dims=ParallelDims(), mesh=None
    )
    shards = [n for n, p in trainer.model.named_parameters() if isinstance(p, DTensor)]
    assert "model.embed_tokens.weight" in shards and len(shards) > 10
    assert all(p.device.type == "cpu" for p in trainer.model.parameters() if isinstance(p, DTensor))
    # the rest went: the adapters FSDP ignores, the LM head, the buffers (RoPE's frequencies)
    assert all(layer.A.device.type == "meta" for layer in packed_layers(trainer.model).values())
    assert trainer.model.lm_head.weight.device.type == "meta"
    assert all(b.device.type == "meta" for b in trainer.model.buffers())
