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


def adapter_base_name(ref: Any, model_path: str, out_dir: str | os.PathLike[str]) -> str:
    """What an adapter's ``adapter_config.json`` names as its base model, so that a sweep
    directory copied elsewhere still loads with ``AutoPeftModelForCausalLM``:

    * a hub id: the id (loads anywhere the hub or the HF cache is);
    * a built-in tiny model saved in the sweep directory (``base_model/``): ``base_model``, a path
      relative to the sweep directory -- load from there (``cd DIR``), or with
      ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR / "base_model"), ...)``;
    * a local model directory: its absolute path, as the user gave it (not copied into the sweep).

    Args:
        ref: the sweep's :class:`~plora.config.ModelRef`.
        model_path: where the base model was loaded from (``plora.models.resolve_model_path``).
        out_dir: the sweep directory the adapters are written into.
    """
    from plora.models import is_builtin
    from plora.sweepdir.schema import BASE_MODEL_DIR

    builtin = is_builtin(ref)
    if builtin and (Path(out_dir) / BASE_MODEL_DIR).is_dir():
        return BASE_MODEL_DIR
    name = ref if isinstance(ref, str) else str(getattr(ref, "name_or_path", model_path))
    if not builtin and not Path(name).expanduser().exists():
        return name  # a hub id
    return str(Path(model_path).expanduser().absolute())


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


# --------------------------------------------------------- train-state helpers
def adamw_slot_state(state: dict[str, Any], keys: list[str]) -> dict[str, Any] | None:
    """A version-1 ``torch.optim.AdamW`` state dict as :meth:`PackedAdamW.slot_state` output.

    Its parameters were the adapter's factors in ``keys`` order (module order, A then B);
    None when it took no step yet.
    """
    per = state["state"]
    if not per:
        return None
    return {
        "step": int(per[0]["step"]),
        "exp_avg": {k: per[i]["exp_avg"] for i, k in enumerate(keys)},
        "exp_avg_sq": {k: per[i]["exp_avg_sq"] for i, k in enumerate(keys)},
    }


def detached_copy(obj: Any) -> Any:
    """``obj`` with every tensor (in nested dicts, lists, tuples) copied to the CPU, detached."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: detached_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [detached_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(detached_copy(v) for v in obj)
    return obj


def as_tuple(obj: Any) -> Any:
    """Lists back to tuples, recursively (``random.setstate`` after a JSON/torch round trip)."""
    return tuple(as_tuple(v) for v in obj) if isinstance(obj, list | tuple) else obj


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adamw_slot_state",
    "as_tuple",
    "detached_copy",
    "export_peft_adapter",
    "has_train_state",
    "load_train_state",
    "peft_lora_config",
    "save_train_state",
]
