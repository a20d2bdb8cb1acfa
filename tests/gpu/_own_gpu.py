"""Spawn entry of the NCCL tests: each rank sees one GPU, as Ray gives each worker.

``CUDA_VISIBLE_DEVICES`` is read once, when CUDA starts, and importing the test code (torch,
transformers, plora) may start it: so the rank's entry is named by strings and imported only
after the variable is set. A function passed to ``mp.spawn`` directly is unpickled -- its module
imported -- before it can run (both ranks then saw both GPUs and NCCL refused "Duplicate GPU").
"""

from __future__ import annotations

import importlib
import os


def run_on_own_gpu(rank: int, module: str, function: str, *args: object) -> None:
    """``module.function(rank, *args)`` with only GPU ``rank`` visible (as device 0)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    getattr(importlib.import_module(module), function)(rank, *args)
