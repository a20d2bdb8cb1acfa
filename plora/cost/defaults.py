"""The assumed constants behind :meth:`plora.cost.overheads.Overheads.default` on a GPU and on
the CPU, and the measurements they come from.

Pure data: no I/O, nothing imported beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class DefaultConstants:
    """The assumed constants behind ``Overheads.default`` (:data:`GPU` and :data:`CPU`)."""

    worker_start_s: float
    """A worker group's process start, imports, device init (and first-use kernel JIT)."""
    load_bytes_per_s: float
    """Weights from local disk / page cache onto the device through ``from_pretrained``."""
    model_load_fixed_s: float
    """Model construction, tokenizer, moving to the device."""
    job_start_s: float
    """A job on a warm group: trainer set-up, data tokenization, adapter init."""
    write_s_per_gb: float
    """Device -> host copy plus ``safetensors`` / ``torch.save`` of 1e9 bytes to a local disk."""
    export_fixed_s: float
    checkpoint_fixed_s: float


#: The cold-start measurement behind the GPU defaults: the Qwen2.5-1.5B shape (1.544e9 params,
#: bf16), a resident worker of ``plora sweep`` (``benchmarks/e2e.py``, three sweeps on an H200 and
#: two H100 hosts, 2026-11-28, weights read straight onto the GPU; medians of the
#: ``workers_ready`` and ``job_done`` entries of ``decisions.jsonl`` and the first and steady
#: step times of ``metrics.parquet``): 15.6 s from the worker's request to its loaded model
#: (15.4-17.6 s), 11.2 s of it the load (11.1-13.0 s: importing the engine 8.6-10.7 s, the
#: weights 0.7-1.0 s, Liger's patch 0.6-0.8 s, the dataset 0.8 s), then 1.5 s more in the first
#: job's first step than in a steady one (1.4-1.8 s); the job's set-up took 1.5 s (1.4-2.6 s).
#: (2026-11-27, loading on the host first: 21.1, 15.2, 2.3 and 2.4 s on two H100 hosts.)
COLD_START_MEASURED: dict[str, Any] = {
    "gpu": "H100",
    "weight_bytes": 2.0 * 1.543714304e9,
    "ready_s": 15.57,
    "load_s": 11.18,
    "compile_s": 1.48,
    "job_start_s": 1.53,
}
#: The model loads behind the GPU defaults' load bandwidth: ``plora sweep``'s resident worker
#: groups on a 4 x H100 host (``benchmarks/e2e.py --case M`` and ``--case L``, 2026-11-27, weights
#: in the page cache as after a download, loaded on the host and then moved to the GPU; the
#: ``load_s`` of ``workers_ready`` in ``decisions.jsonl``, what a ``model_load`` sample is):
#: Qwen2.5-7B (d = 1, four groups at once) 17.0-18.7 s, median 17.96 s; Qwen2.5-32B (d = 2 tp, two
#: groups at once, every rank reads the whole checkpoint) 23.0 and 23.4 s: about 9.5 GB/s between
#: them. The fixed part is the 1.5B load of :data:`COLD_START_MEASURED` less its bytes at that
#: rate (about 10.9 s): the weights now go straight to the GPU, and the larger loads were not
#: measured that way yet.
LOAD_MEASURED: tuple[dict[str, Any], ...] = (
    {"model": "Qwen/Qwen2.5-7B", "weight_bytes": 2.0 * 7615616512, "load_s": 17.96},
    {"model": "Qwen/Qwen2.5-32B", "weight_bytes": 2.0 * 32763876352, "load_s": 23.23},
)


def _load_line(small: dict[str, Any], large: dict[str, Any]) -> dict[str, float]:
    """Bytes per second between two measured loads, and the fixed seconds that put the line
    through :data:`COLD_START_MEASURED`'s load."""
    rate = (large["weight_bytes"] - small["weight_bytes"]) / (large["load_s"] - small["load_s"])
    cold = COLD_START_MEASURED
    return {
        "load_bytes_per_s": rate,
        "model_load_fixed_s": cold["load_s"] - cold["weight_bytes"] / rate,
    }


#: GPU defaults: the worker start is the measured request-to-ready minus the load, plus the
#: first step's compilation (≈ 5.9 s); the model load the line of :func:`_load_line`; write
#: bandwidth and fixed export/checkpoint parts assumed.
GPU = DefaultConstants(
    worker_start_s=COLD_START_MEASURED["ready_s"]
    - COLD_START_MEASURED["load_s"]
    + COLD_START_MEASURED["compile_s"],
    **_load_line(*LOAD_MEASURED),
    job_start_s=COLD_START_MEASURED["job_start_s"],
    write_s_per_gb=1.0,
    export_fixed_s=0.2,
    checkpoint_fixed_s=0.5,
)
#: CPU defaults (the quickstart on a 2-core host, ``tests/ray/test_quickstart.py``, 2026-11-25):
#: the resident worker's Ray actor starts and imports torch in 1.5-2.1 s, then its load --
#: transformers' model classes imported, the tiny model built, the dataset tokenized -- takes
#: 3.2-3.7 s: request to ready 4.7 s alone, 5.7-5.8 s inside CI's test session (8-9 s while
#: other processes held both cores); the defaults sit in the middle (2.0 + 3.5 s). A job's
#: set-up, export and checkpoint of tiny adapters took 0.02-0.04 s there.
CPU = DefaultConstants(worker_start_s=2.0, load_bytes_per_s=1.0e9, model_load_fixed_s=3.5,
                       job_start_s=0.05, write_s_per_gb=2.0, export_fixed_s=0.005,
                       checkpoint_fixed_s=0.02)  # fmt: skip


__all__ = ["COLD_START_MEASURED", "CPU", "GPU", "LOAD_MEASURED", "DefaultConstants"]
