"""Base models: built-in tiny models and any Hugging Face causal LM by id or local path.

* :mod:`plora.models.load` -- ``load_model`` (the one door through which the engine, the
  runtime and the tests get a frozen base model and its tokenizer), ``resolve_model_path``,
  ``save_base_model``;
* :mod:`plora.models.tiny` -- the built-in tiny models; :mod:`plora.models.tokenizer` -- the
  byte tokenizer; :mod:`plora.models.quantize` -- NF4 (QLoRA);
* :mod:`plora.models.hub` -- whether a hub id can be loaded, checked in seconds.

Names load lazily, so the sweep driver's ``import plora.models.hub`` (and ``plora plan``) stays
free of torch and transformers (seconds of import on a small host: ``python -X importtime``).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BUILTIN_MODELS": "plora.models.load",
    "PretrainedConfig": "plora.models.load",
    "is_builtin": "plora.models.load",
    "load_model": "plora.models.load",
    "quantize_model": "plora.models.quantize",
    "resolve_model_path": "plora.models.load",
    "save_base_model": "plora.models.load",
    "tiny_config": "plora.models.tiny",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'plora.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
