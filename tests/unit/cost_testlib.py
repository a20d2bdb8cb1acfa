"""Shared by the SweepCostModel tests: a Qwen2.5-7B model on A100s and random configs."""

from __future__ import annotations

import random

from plora.config import PROJECTIONS, HardwareConfig, LoRAConfig
from plora.cost import Strategy
from plora.cost.model import SweepCostModel
from plora.model_spec import ModelSpec

QWEN7B = ModelSpec.from_hf_config("Qwen/Qwen2.5-7B")
A100 = HardwareConfig(gpu_type="A100-80GB", num_gpus=8)


def configs(n: int = 24, seed: int = 0) -> list[LoRAConfig]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kw = (
            {"max_steps": rng.choice([50, 100, 400])}
            if rng.random() < 0.5
            else {"epochs": rng.choice([0.5, 1.0, 2.0])}
        )
        out.append(
            LoRAConfig(
                rank=rng.choice([8, 32, 128]),
                alpha=16.0,
                lr=rng.choice([1e-4, 2e-4]),
                batch_size=rng.choice([1, 4, 16]),
                dropout=rng.choice([0.0, 0.05]),
                target_modules=rng.choice([("q_proj", "v_proj"), PROJECTIONS]),
                seed=rng.randrange(1000),
                **kw,
            )
        )
    return out


def model(**kw) -> SweepCostModel:
    args = dict(strategies=(Strategy.TP, Strategy.FSDP, Strategy.PP))
    return SweepCostModel(QWEN7B, 1024, 7473, A100, **{**args, **kw})
