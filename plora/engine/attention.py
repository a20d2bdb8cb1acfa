"""The attention kernels the engine's forwards may use: every SDPA backend but cuDNN's.

Packed rows are right-padded to the longest row of the micro-batch, so nearly every step has a
new ``(rows, length)`` shape. PyTorch picks cuDNN's fused attention for padded (masked) rows on
Hopper, and cuDNN builds an execution plan on the host for each new shape: seconds per new padded
length, a stall on every step whose length is new. The memory-efficient kernel runs the same
shapes at the same steady-state speed with no per-shape cost, so the engine leaves cuDNN out
(``benchmarks/sdpa_shapes.py`` measures both; the numbers are in ``benchmarks/RESULTS.md``).
Flash attention stays first for unpadded batches.

The graphed step (:mod:`plora.engine.graphed`) passes no padding mask -- its rows are
right-padded, so causal attention never lets a real token see padding -- and runs under
:func:`causal_only`: HF's SDPA attention with no mask at all. Without it HF builds a full causal
mask whenever a CUDA stream is capturing (``is_tracing``), and the masked SDPA call takes the
memory-efficient kernel, several times slower than flash on a 3B shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from plora.engine.device import model_device

_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def engine_attention(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """SDPA without cuDNN for the forwards (and backwards) inside, when ``model`` is on CUDA."""
    if model_device(model).type != "cuda":  # a CPU-offloaded base computes on its GPU too
        return contextlib.nullcontext()
    return sdpa_kernel(_BACKENDS)


#: HF attention implementation of :func:`causal_only`: SDPA, causal, never a mask.
CAUSAL_SDPA = "plora_causal_sdpa"


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def causal_suffices(model: Any, *, width: int | None = None) -> bool:
    """Whether right-padded rows of ``width`` tokens may run with no mask under
    :func:`causal_only`: HF's SDPA attention (what it replaces) and no sliding window shorter
    than the rows (only the mask applies a window; ``width`` None: any window is too short)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or (width is not None and width <= window)


@contextlib.contextmanager
def causal_only(model: nn.Module, *, width: int | None = None) -> Iterator[bool]:
    """Inside, a model running HF's SDPA attention builds no attention mask: every call is
    ``is_causal`` (flash when allowed). Only for right-padded rows of ``width`` tokens whose
    padding is no target. Where that is not exact (:func:`causal_suffices`: other attention
    implementations, a sliding window shorter than the rows) the model is left as it is.
    Yields whether the model runs without a mask (False: pass the caller's mask)."""
    if not causal_suffices(model, width=width):
        yield False
        return
    config: Any = model.config
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, _no_mask)
    config._attn_implementation = CAUSAL_SDPA
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"


__all__ = ["CAUSAL_SDPA", "causal_only", "causal_suffices", "engine_attention"]
