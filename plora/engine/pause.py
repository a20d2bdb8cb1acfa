"""Pause an adapter out of its pack and let it join another pack later, continuing exactly.

A scheduler that pauses trials to resume them later (Ray Tune's synchronous
``HyperBandScheduler``, ``MedianStoppingRule(hard_stop=False)``) asks a running pack to let one
adapter go at the next step boundary. :func:`leave` saves that adapter's whole train-state --
its A/B factors, its AdamW moments, its step and token counters, its losses, its data stream's
position and its schedule -- to ``<sweep dir>/paused/<config_id>/`` (written atomically, with a
checksum, by :func:`plora.engine.checkpoint.save_train_state`) and retires it from the pack.
When the config is later packed again (a new job or a refill of a running one), :func:`join`
finds that state and adds the adapter from it instead of fresh.

Why this is exact. An adapter's update depends only on its own state: its batches come from its
own stream (:class:`plora.engine.data.AdapterStream`, seeded by the config), its dropout masks are
keyed by ``(config seed, adapter step)`` (:mod:`plora.engine.lora`), its loss is its own mean
token loss, its gradient clipping and AdamW step are per slot. So the slot it lands in and the
adapters it shares a pack with change nothing: an adapter paused after step ``k`` and resumed
trains steps ``k+1..n`` on the same batches with the same moments, and ends (fp32) with the same
weights as an uninterrupted run (``tests/unit/test_pause.py``).

A paused config's state is removed once it completed or stopped (:func:`forget`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plora.config import LoRAConfig
from plora.engine import checkpoint as ckpt
from plora.engine.reports import AdapterStatus
from plora.engine.train_state import TRAIN_STATE_VERSION

PAUSED_DIR = "paused"
"""Where paused adapters' train-states are kept, inside the pack's ``out_dir``."""


def paused_dir(out_dir: str | os.PathLike[str], config_id: str) -> Path:
    """The train-state directory of a paused config."""
    return Path(out_dir) / PAUSED_DIR / config_id


def is_paused(out_dir: str | os.PathLike[str], config_id: str) -> bool:
    """Whether ``config_id`` left a pack paused and has not finished since."""
    return ckpt.has_train_state(paused_dir(out_dir, config_id))


def paused_step(out_dir: str | os.PathLike[str], config_id: str) -> int | None:
    """The adapter step of ``config_id``'s paused train-state (None: none, or not recorded)."""
    meta = paused_dir(out_dir, config_id) / ckpt.TRAIN_STATE_META
    if not is_paused(out_dir, config_id) or not meta.is_file():
        return None
    try:
        step = json.loads(meta.read_text()).get("global_step")
    except ValueError:  # being replaced right now: not known yet
        return None
    return None if step is None else int(step)


def leave(trainer: Any, config_id: str, out_dir: str | os.PathLike[str]) -> Path:
    """Save ``config_id``'s whole train-state and retire it from ``trainer`` as paused (between
    steps; its weights stay until the pack releases it). Returns the state's directory."""
    state = ckpt.detached_copy(trainer.adapter_train_state(config_id))
    path = ckpt.save_train_state(
        paused_dir(out_dir, config_id),
        {
            "version": TRAIN_STATE_VERSION,
            "global_step": state["step"],
            "adapters": {config_id: state},
        },
    )
    trainer.retire(config_id, AdapterStatus.PAUSED)
    return path


def join(trainer: Any, config: LoRAConfig, out_dir: str | os.PathLike[str]) -> bool:
    """Add ``config`` to ``trainer``: from its paused train-state when it has one (True), else
    fresh (False).

    Raises:
        plora.engine.checkpoint.CheckpointError: the paused state is damaged (one line; the
            config's progress since its start would be lost, so it is not silently restarted).
    """
    path = paused_dir(out_dir, config.config_id)
    if not ckpt.has_train_state(path):
        trainer.add(config)
        return False
    state = ckpt.load_train_state(path)
    st = state["adapters"][config.config_id]
    if LoRAConfig.from_dict(st["config"]).fingerprint() != config.fingerprint():
        raise ckpt.CheckpointError(
            f"{path}: paused with other hyperparameters than config {config.config_id} has now; "
            "remove that directory to train the config from its start"
        )
    trainer.add_from_state(
        {**st, "status": str(AdapterStatus.ACTIVE)}, version=int(state["version"])
    )
    return True


def join_all(trainer: Any, configs: Sequence[LoRAConfig], out_dir: str | os.PathLike[str]) -> None:
    """:func:`join` each of ``configs``; the fresh ones (no paused train-state) in one batch
    (``trainer.add_many``: every layer reallocates once for all of them)."""
    paused = [c for c in configs if ckpt.has_train_state(paused_dir(out_dir, c.config_id))]
    fresh = [c for c in configs if c not in paused]
    if fresh:
        trainer.add_many(fresh)
    for config in paused:
        join(trainer, config, out_dir)


def forget(out_dir: str | os.PathLike[str], config_id: str) -> None:
    """Drop a paused state once its config completed or stopped."""
    shutil.rmtree(paused_dir(out_dir, config_id), ignore_errors=True)


__all__ = [
    "PAUSED_DIR",
    "forget",
    "is_paused",
    "join",
    "join_all",
    "leave",
    "paused_dir",
    "paused_step",
]
