"""Tile configs of the packed LoRA kernels and the measured fused/unfused mode choice.

Both come from ``kernels/tuned.json``, measured per GPU name by ``benchmarks/kernels.py
--tune`` (every candidate config timed and checked against a torch reference); a GPU missing
from it gets the defaults below and the unfused path, which leans on cuBLAS for the base GEMM.
"""

from __future__ import annotations

import json
import math
import os
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

TUNED_PATH = Path(__file__).with_name("tuned.json")

#: Defaults for a GPU absent from tuned.json (H100-class numbers), and for the CPU interpreter.
DEFAULT_CONFIGS: dict[str, dict[str, int]] = {  # what --tune picked on both H100 and H200
    "shrink": {"BM": 64, "BK": 64, "num_warps": 4, "num_stages": 4},
    "gemm": {
        "BM": 128,
        "BN": 128,
        "BK": 64,
        "BR": 64,
        "GROUP_M": 8,
        "num_warps": 8,
        "num_stages": 4,
    },
    "lora": {
        "BM": 64,
        "BN": 256,
        "BK": 32,
        "BR": 32,
        "GROUP_M": 8,
        "num_warps": 4,
        "num_stages": 2,
    },
    "wgrad": {"BN": 128, "BT": 64, "BR": 64, "num_warps": 4, "num_stages": 3},
    "tma": {
        "BM": 128,
        "BN": 256,
        "BK": 64,
        "BR": 32,
        "GROUP_M": 8,
        "SUBTILE": 1,
        "FLATTEN": 0,
        "num_warps": 8,
        "num_stages": 3,
    },
}
_INTERPRETER_CONFIGS: dict[str, dict[str, int]] = {
    "shrink": {"BM": 32, "BK": 64},
    "gemm": {"BM": 32, "BN": 64, "BK": 64, "BR": 32, "GROUP_M": 4},
    "lora": {"BM": 32, "BN": 64, "BK": 64, "BR": 32, "GROUP_M": 4},
    "wgrad": {"BN": 64, "BT": 32, "BR": 16},
    "tma": {"BM": 32, "BN": 64, "BK": 32, "BR": 32, "GROUP_M": 4, "SUBTILE": 1, "FLATTEN": 0},
}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@lru_cache(maxsize=1)
def _tuned_file() -> dict[str, Any]:
    if not TUNED_PATH.exists():
        return {}
    return json.loads(TUNED_PATH.read_text())


@lru_cache(maxsize=16)
def _gpu_entry(device_index: int) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device_index)
    return _tuned_file().get(name, {})


def reload_tuned() -> None:
    """Forget the cached tuned.json, its per-GPU entries and the mode choices made from them."""
    _tuned_file.cache_clear()
    _gpu_entry.cache_clear()
    _config.cache_clear()
    _measured_mode.cache_clear()


#: Per-kind configs that win over everything else (set by the tuner in benchmarks/kernels.py).
CONFIG_OVERRIDES: dict[str, dict[str, int]] = {}


def kernel_config(kind: str, device: torch.device, elem_size: int = 2) -> dict[str, int]:
    """Tile config of ``kind`` (shrink, gemm, lora, wgrad) on ``device`` (a fresh dict).

    Configs are tuned for 2-byte operands; for float32 the reduction tile (BK / BT) is halved so
    the pipelined shared-memory buffers keep the same byte size.
    """
    if kind in CONFIG_OVERRIDES:
        return _sized(dict(CONFIG_OVERRIDES[kind]), elem_size)
    interpreted = device.type != "cuda" or _interpreting()
    # Cached: every launch of every layer asks (several per packed call).
    return dict(_config(kind, None if interpreted else (device.index or 0), elem_size))


@lru_cache(maxsize=64)
def _config(kind: str, device_index: int | None, elem_size: int) -> dict[str, int]:
    """:func:`kernel_config` off the overrides; ``device_index`` None: the interpreter's."""
    if device_index is None:
        return dict(_INTERPRETER_CONFIGS[kind])
    entry = _gpu_entry(device_index).get("configs", {}).get(kind) or DEFAULT_CONFIGS[kind]
    return _sized(dict(entry), elem_size)


def _sized(cfg: dict[str, int], elem_size: int) -> dict[str, int]:
    if elem_size > 2:
        for key in ("BK", "BT"):
            if key in cfg:
                cfg[key] = max(16, cfg[key] * 2 // elem_size)
    return cfg


class Mode(StrEnum):
    """How the base GEMM and the LoRA term meet (one choice per phase, measured per GPU)."""

    FUSED = "fused"  #: one Triton GEMM: base tile + routed LoRA products in one accumulator
    EPILOGUE = "epilogue"  #: LoRA kernel writes the term, cuBLAS adds the base (addmm, beta = 1)
    ACCUMULATE = "accumulate"  #: cuBLAS writes the base, the LoRA kernel adds its term in place


def choose_mode(
    phase: str, n_tokens: int, in_features: int, out_features: int, device, *, fused: bool | None
) -> Mode:
    """The measured mode for ``phase`` ('fwd' | 'bwd' | 'bwd-dropout') at the nearest tuned shape.

    ``fused=True`` forces :attr:`Mode.FUSED`; ``fused=False`` takes the faster unfused mode at
    that shape; ``None`` the fastest of all. Off-table GPUs get EPILOGUE (the mode measured
    fastest at most tuned shapes on H100 and H200), or FUSED if forced. 'bwd-dropout' is the
    backward of a pack with dropout (the keep mask is applied to the LoRA part of dX).
    """
    if fused:
        return Mode.FUSED
    if device.type != "cuda" or _interpreting():
        return Mode.ACCUMULATE
    # Cached per shape: every layer of every step asks the same few questions.
    return _measured_mode(phase, n_tokens, in_features, out_features, device.index or 0, fused)


@lru_cache(maxsize=1024)
def _measured_mode(
    phase: str, n_tokens: int, in_features: int, out_features: int, device_index: int, fused
) -> Mode:
    rows = [r for r in _gpu_entry(device_index).get("dispatch", []) if "ms" in r]
    exclude = set() if fused is None else {Mode.FUSED}
    if phase == "bwd-dropout" and not any(r.get("phase") == phase for r in rows):
        # A table without dropout rows: the fused kernel's masked epilogue (tiles halved to fit
        # the mask) measured 1.2x slower than EPILOGUE at the (b) shape on H100 and H200.
        phase, exclude = "bwd", {Mode.FUSED}
    best, best_dist = None, math.inf
    for row in rows:
        if row.get("phase") != phase:
            continue
        dist = (
            abs(math.log2(max(n_tokens, 1) / row["tokens"]))
            + abs(math.log2(in_features / row["in"]))
            + abs(math.log2(out_features / row["out"]))
        )
        if dist < best_dist:
            best, best_dist = row, dist
    if best is None:
        return Mode.EPILOGUE
    times = {Mode(m): t for m, t in best["ms"].items() if Mode(m) not in exclude}
    return min(times, key=times.__getitem__)
