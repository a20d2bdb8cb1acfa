"""Load, resolve and save base models (what :mod:`plora.models` exports).

``load_model`` is the one door through which the engine, the runtime and the tests get a frozen
base model and its tokenizer:

* ``"tiny-qwen2"`` / ``"tiny-llama"`` -- built locally (no hub), deterministic, pretrained and
  cached on first use (:mod:`plora.models.tiny`);
* a local directory written by ``save_pretrained``;
* a hub id (``Qwen/Qwen2.5-0.5B``), loaded with ``AutoModelForCausalLM`` / ``AutoTokenizer``
  (downloads follow the usual HF cache and ``HF_HUB_OFFLINE`` rules).

``save_base_model`` writes any of them as a standard HF directory, which
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` reload
bit-identically -- the ``base_model_name_or_path`` that exported PEFT adapters point at.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig

from plora.config import ConfigError
from plora.models.quantize import quantize_model
from plora.models.tiny import COMPLETE_MARKER, TINY_MODELS, tiny_config, tiny_model_dir
from plora.utils import atomic_path, torchao_first

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from plora.config import ModelRef

#: Names of the built-in tiny models.
BUILTIN_MODELS: tuple[str, ...] = tuple(TINY_MODELS)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def is_builtin(ref: ModelRef | str) -> bool:
    """Whether ``ref`` names a built-in tiny model."""
    return _name(ref) in TINY_MODELS


def resolve_model_path(ref: ModelRef | str) -> str:
    """The path or hub id ``from_pretrained`` should load for ``ref``.

    Built-ins resolve to their cached directory (built on first use); anything else is
    returned unchanged (``~`` expanded for existing local paths).
    """
    name = _name(ref)
    if name in TINY_MODELS:
        return str(tiny_model_dir(name))
    local = Path(name).expanduser()
    return str(local) if local.exists() else name


def load_model(
    ref: ModelRef | str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode on ``device``.

    Args:
        ref: a :class:`plora.config.ModelRef` or a string: built-in name, local dir or hub id.
        dtype: weights dtype; ``None`` takes ``ref.dtype`` (``"auto"``: the checkpoint's own
            dtype; built-ins are float32).
        device: where to put the model.

    With ``ref.quantization == "nf4"`` the decoder's projections are stored in NF4 on
    ``device`` (:func:`plora.models.quantize.quantize_model`), computed in ``dtype``.

    Returns:
        ``(model, tokenizer)``; the tokenizer always has a pad token (eos when it had none).

    Raises:
        ConfigError: the directory or id cannot be loaded (one line, with the cause).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = _name(ref)
    path = resolve_model_path(ref)
    trust = bool(getattr(ref, "trust_remote_code", False))
    torch_dtype: Any = dtype if dtype is not None else _ref_dtype(ref)
    if torch_dtype == "auto" and name in TINY_MODELS:
        torch_dtype = torch.float32
    local = Path(path)
    if local.is_dir() and not (local / "config.json").is_file():
        raise ConfigError(
            "not a Hugging Face model directory (no config.json)",
            key="model.name_or_path",
            value=name,
            fix="point to a directory written by save_pretrained",
        )
    torchao_first()  # transformers imports it below, with a page of warnings
    quantization = getattr(ref, "quantization", "none")
    # Unquantized weights are read straight onto ``device`` (a GPU's copy of a few GB from the
    # page cache, no host copy of the model first); NF4 quantizes on the host's copy below.
    placement = {"device_map": {"": torch.device(device)}} if quantization == "none" else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust, **placement
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    except (OSError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        cause = " ".join(str(err).split())[:200]
        raise ConfigError(
            f"cannot load the model ({type(err).__name__}: {cause})",
            key="model.name_or_path",
            value=name,
            fix="check the hub id (and network/HF_HUB_OFFLINE) or the local directory",
        ) from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    if quantization != "none":  # on the target device, one projection at a time
        quantize_model(model, quantization, device=device)
    # transformers wraps PreTrainedModel.to with functools.wraps, which typeshed cannot bind
    return model.to(device), tokenizer  # type: ignore[arg-type]


def save_base_model(ref: ModelRef | str, out_dir: str | Path) -> Path:
    """Write ``ref`` as a self-contained HF directory (config, safetensors weights, tokenizer).

    The directory is written atomically; reloading it with ``from_pretrained`` gives the same
    tensors and token ids. Built-ins are copied from their cache without re-serialising.

    Returns:
        ``Path(out_dir)``.
    """
    out = Path(out_dir)
    name = _name(ref)
    with atomic_path(out) as tmp:
        if name in TINY_MODELS:
            shutil.copytree(
                tiny_model_dir(name), tmp, ignore=shutil.ignore_patterns(COMPLETE_MARKER)
            )
        else:  # the dense weights (a quantized ref's base is saved unquantized)
            dense = ref if isinstance(ref, str) else dataclasses.replace(ref, quantization="none")
            model, tokenizer = load_model(dense)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return out


def _name(ref: ModelRef | str) -> str:
    name = ref if isinstance(ref, str) else getattr(ref, "name_or_path", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(
            "model must be a hub id, a local directory or a built-in name",
            key="model.name_or_path",
            value=name,
            fix=f"e.g. Qwen/Qwen2.5-0.5B, ./my-model or {BUILTIN_MODELS[0]}",
        )
    return name


def _ref_dtype(ref: ModelRef | str) -> torch.dtype | str:
    dtype = getattr(ref, "dtype", "auto")
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return "auto"
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(
            "unknown dtype",
            key="model.dtype",
            value=dtype,
            fix="use auto, float32, bfloat16 or float16",
        ) from None


__all__ = [
    "BUILTIN_MODELS",
    "PretrainedConfig",
    "is_builtin",
    "load_model",
    "quantize_model",
    "resolve_model_path",
    "save_base_model",
    "tiny_config",
]
