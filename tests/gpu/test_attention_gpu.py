"""The engine's forwards keep cuDNN attention out (its per-shape plan builds stalled steps)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _engine_testlib import TOKENIZER, VOCAB, tiny_model, toy_dataset

from plora.config import LoRAConfig
from plora.engine.adapters import base_only
from plora.engine.trainer import PackedTrainer

pytestmark = pytest.mark.gpu


def _attention_kernels(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # flash attention's kernels are "pytorch_flash::flash_fwd_kernel<...>" (the graphed step's
    # mask-free SDPA), memory-efficient attention's "fmha_cutlass...", cuDNN's "cudnn_..."
    words = ("sdpa", "fmha", "flash", "attention", "cudnn")
    return {e.name for e in prof.events() if any(w in e.name.lower() for w in words)}


def test_packed_steps_and_evaluation_run_no_cudnn_attention():
    model = tiny_model(hidden=256, intermediate=512).to("cuda", torch.bfloat16)
    ids = torch.randint(3, VOCAB, (8, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[::2, 30:] = 0  # padded rows: what a pack of rows of different lengths looks like

    def plain():
        model(input_ids=ids, attention_mask=mask).logits.float().sum()

    control = _attention_kernels(plain)
    if not any("cudnn" in n.lower() for n in control):
        pytest.skip(f"this GPU's default SDPA is not cuDNN here ({sorted(control)[:3]})")

    def routed():
        with base_only(model):
            model(input_ids=ids, attention_mask=mask).logits.float().sum()

    assert not any("cudnn" in n.lower() for n in _attention_kernels(routed))
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the context put the flags back

    for graphs in (False, True):
        trainer = PackedTrainer(
            model, TOKENIZER, toy_dataset(16), device="cuda", cuda_graphs=graphs
        )
        for i in range(2):
            trainer.add(LoRAConfig(config_id=f"a{i}", rank=8, alpha=16, lr=1e-3, batch_size=4,
                                   seed=i, max_steps=3, target_modules="all"))  # fmt: skip
        # graphed: the first step runs the graph's body eagerly (what the profiler sees, outside
        # any capture), the second captures that same body and replays it, the third replays
        kernels = _attention_kernels(trainer.step)
        assert kernels and not any("cudnn" in n.lower() for n in kernels), (graphs, sorted(kernels))
        for _ in range(2):
            trainer.step()
        if graphs:
            assert trainer.graphs is not None and trainer.graphs.replays == 2, trainer.graphs
        for i in range(2):
            trainer.release(f"a{i}")
