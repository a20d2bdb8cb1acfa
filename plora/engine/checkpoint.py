"""Adapters out in PEFT format, and train-state checkpoints that resume exactly.

* :func:`export_peft_adapter` writes ``adapter_config.json`` (a ``peft.LoraConfig`` saved by
  peft itself) and ``adapter_model.safetensors`` with PEFT's key names
  (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``), so the directory
  reloads with ``PeftModel.from_pretrained(base, path)``.
* :func:`save_train_state` / :func:`load_train_state` store ``PackedTrainer.state_dict()``
  (adapter weights, AdamW and schedule state, data-stream positions, RNG states, step
  counters) as one ``torch.save`` file inside a directory, written atomically.

Every write goes through :func:`plora.utils.atomic_path`: a reader sees the old or the new
directory, never a half-written one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from plora.config import LoRAConfig
from plora.utils import atomic_path, atomic_write_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAIN_STATE = "train_state.pt"
TRAIN_STATE_META = "meta.json"


def peft_lora_config(config: LoRAConfig, *, base_model_name_or_path: str | None = None):
    """The ``peft.LoraConfig`` equivalent to ``config`` (task type CAUSAL_LM)."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        lora_dropout=config.dropout,
        use_rslora=config.use_rslora,
        bias="none",
        task_type=TaskType.CAUSAL_LM,
        base_model_name_or_path=base_model_name_or_path or None,
    )


def export_peft_adapter(
    path: str | os.PathLike[str],
    *,
    config: LoRAConfig,
    weights: Mapping[str, torch.Tensor],
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write one adapter as a PEFT directory at ``path`` (atomically, replacing it).

    Args:
        config: the adapter's config (rank, alpha, targets, dropout, rsLoRA).
        weights: PEFT-keyed tensors (``plora.engine.adapters.adapter_state_dict``).
        base_model_name_or_path: recorded in ``adapter_config.json``.
    """
    path = Path(path)
    bad = [k for k in weights if not k.startswith("base_model.model.")]
    if bad or not weights:
        raise ValueError(f"not PEFT-keyed adapter weights: {bad[:2] or 'empty'}")
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in weights.items()}
    with atomic_path(path) as tmp:
        tmp.mkdir()
        peft_lora_config(config, base_model_name_or_path=base_model_name_or_path).save_pretrained(
            str(tmp)
        )
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / "plora_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return path


def save_train_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
    """Write a train-state (``PackedTrainer.state_dict()``) into directory ``path`` atomically."""
    path = Path(path)
    meta = {
        "version": state.get("version"),
        "global_step": state.get("global_step"),
        "adapters": {
            cid: {"step": st["step"], "status": st["status"], "slot": st["slot"]}
            for cid, st in state.get("adapters", {}).items()
        },
    }
    with atomic_path(path) as tmp:
        tmp.mkdir()
        torch.save(dict(state), tmp / TRAIN_STATE)
        atomic_write_json(tmp / TRAIN_STATE_META, meta)
    return path


def has_train_state(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a complete train-state checkpoint."""
    return (Path(path) / TRAIN_STATE).is_file()


def load_train_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a train-state written by :func:`save_train_state` (tensors on CPU)."""
    file = Path(path) / TRAIN_STATE
    if not file.is_file():
        raise FileNotFoundError(f"no train-state at {file}")
    return torch.load(file, map_location="cpu", weights_only=True)


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "export_peft_adapter",
    "has_train_state",
    "load_train_state",
    "peft_lora_config",
    "save_train_state",
]
