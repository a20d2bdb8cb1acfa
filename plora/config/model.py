"""The frozen base model a sweep fine-tunes: :class:`ModelRef`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from plora.config.errors import ConfigError
from plora.config.validate import as_bool, as_choice, as_str

#: Built-in tiny base models, built locally without the hub (``plora.models``).
BUILTIN_MODELS: tuple[str, ...] = ("tiny-qwen2", "tiny-llama")
#: Model dtypes; aliases map to these names (``torch.<name>``).
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
#: How the frozen projections are stored: ``none`` (the model's dtype) or ``nf4`` (QLoRA).
QUANTIZATIONS: tuple[str, ...] = ("none", "nf4")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}  # fmt: skip
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is written as a filesystem path rather than a hub id (``org/name``)."""
    return (
        name.startswith(("/", "./", "../", "~"))
        or name in (".", "..")
        or name.count("/") > 1
        or name.endswith("/")
        or "\\" in name
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRef:
    """The frozen base model every config of a sweep fine-tunes."""

    name_or_path: str
    """A Hugging Face hub id (``Qwen/Qwen2.5-7B``), a local model directory, or a built-in tiny
    model (``tiny-qwen2`` | ``tiny-llama``)."""
    dtype: str = "auto"
    """Weights dtype: auto | float32 | bfloat16 | float16 (aliases fp32, bf16, fp16)."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained`` for models with custom code."""
    quantization: str = "none"
    """``none`` | ``nf4``: QLoRA -- the decoder's frozen projections stored as 4-bit NormalFloat
    with double-quantized block scales (torchao's ``NF4Tensor``; the ``qlora`` extra), computed
    in the model dtype (bf16 on GPUs, fp32 on CPU); embeddings, norms and the LM head stay in
    the model dtype. The packed LoRA factors are unchanged."""

    def __post_init__(self) -> None:
        name = as_str(self.name_or_path, "name_or_path", fix="write a hub id such as Qwen/Qwen2.5-0.5B, a local model directory or tiny-qwen2")  # fmt: skip
        dtype = (
            _DTYPE_ALIASES.get(self.dtype, self.dtype)
            if isinstance(self.dtype, str)
            else self.dtype
        )
        object.__setattr__(self, "dtype", as_choice(dtype, "dtype", DTYPES))
        as_bool(self.trust_remote_code, "trust_remote_code")
        quant = self.quantization
        quant = "none" if quant is None else quant.lower() if isinstance(quant, str) else quant
        object.__setattr__(self, "quantization", as_choice(quant, "quantization", QUANTIZATIONS))
        if name in BUILTIN_MODELS:
            return
        if looks_like_path(name):
            path = Path(name).expanduser()
            if not path.is_dir():
                raise ConfigError("model directory not found", key="name_or_path", value=name,
                                  fix="fix the path (relative paths are relative to the sweep file) or use a hub id")  # fmt: skip
            if not (path / "config.json").is_file():
                raise ConfigError("not a Hugging Face model directory (no config.json)", key="name_or_path", value=name,
                                  fix="point to a directory written by save_pretrained")  # fmt: skip
        elif not _HF_ID.match(name):
            raise ConfigError("not a hub id, local path or built-in model", key="name_or_path", value=name,
                              fix=f"write org/name, ./path/to/model or one of {', '.join(BUILTIN_MODELS)}")  # fmt: skip

    @property
    def is_builtin(self) -> bool:
        """Whether this is a built-in tiny model (built locally, no hub access)."""
        return self.name_or_path in BUILTIN_MODELS

    @property
    def quantized(self) -> bool:
        """Whether the frozen projections are stored quantized (``quantization != "none"``)."""
        return self.quantization != "none"

    @property
    def profile_key(self) -> str:
        """The model's name in the profile store: a quantized base runs at other step times and
        memory than the same model in bf16, so it is profiled apart (``Qwen/Qwen2.5-7B@nf4``)."""
        return self.name_or_path + (f"@{self.quantization}" if self.quantized else "")

    @property
    def is_local(self) -> bool:
        """Whether ``name_or_path`` is an existing local directory."""
        return Path(self.name_or_path).expanduser().is_dir()


__all__ = ["BUILTIN_MODELS", "DTYPES", "QUANTIZATIONS", "ModelRef", "looks_like_path"]
