"""Adapters out in PEFT format, and train-state checkpoints that resume exactly.

* :func:`export_peft_adapter` (PEFT directories of finished adapters) lives in
  :mod:`plora.engine.export` and is re-exported here.
* :func:`save_train_state` / :func:`load_train_state` store ``PackedTrainer.state_dict()``
  (adapter weights, AdamW and schedule state, data-stream positions, RNG states, step
  counters) as one ``torch.save`` file inside a directory, written atomically, with the
  results of the adapters finalised so far and a SHA-256 of each file in ``meta.json``.
* :func:`write_checkpoint` / :func:`latest_good_checkpoint` keep a job's last
  :data:`KEEP_CHECKPOINTS` train-states side by side (``state-<global step>/``): a resume loads
  the newest one whose checksums and contents verify and falls back to the one before, so a
  damaged checkpoint costs one checkpoint interval, never the job's configs.

Every write goes through :func:`plora.utils.atomic_path`: a reader sees the old or the new
directory, never a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from plora.engine.export import (  # re-exported: adapters out in PEFT format
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_base_name,
    export_peft_adapter,
    peft_lora_config,
    snapshot_weights,
    write_peft_adapter,
)
from plora.utils import atomic_path, atomic_write_json

TRAIN_STATE = "train_state.pt"
TRAIN_STATE_META = "meta.json"
RESULTS_FILE = "results.json"
#: Train-states kept per job: the newest and the one before it (the fallback).
KEEP_CHECKPOINTS = 2
_STATE_DIR = re.compile(r"^state-(\d+)$")


def save_train_state(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    results: Mapping[str, Any] | None = None,
) -> Path:
    """Write a train-state (``PackedTrainer.state_dict()``) into directory ``path`` atomically.

    ``results`` (JSON-able, the results of adapters finalised before this state) is written
    beside it; ``meta.json`` holds the SHA-256 of both files, which :func:`verify_train_state`
    checks before a resume trusts them.
    """
    path = Path(path)
    meta: dict[str, Any] = {
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
        files = [TRAIN_STATE]
        if results is not None:
            (tmp / RESULTS_FILE).write_text(json.dumps(dict(results), indent=1) + "\n")
            files.append(RESULTS_FILE)
        meta["sha256"] = {name: _sha256(tmp / name) for name in files}
        for name in files:
            _fsync(tmp / name)
        atomic_write_json(tmp / TRAIN_STATE_META, meta)
    return path


def has_train_state(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a complete train-state checkpoint."""
    return (Path(path) / TRAIN_STATE).is_file()


def load_train_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a train-state written by :func:`save_train_state` (tensors on CPU), verified.

    Raises:
        CheckpointError: the directory is missing, incomplete, fails its checksum or does not
            load.
    """
    return verify_train_state(path)[0]


class CheckpointError(RuntimeError):
    """A train-state that cannot be trusted: missing, incomplete, corrupt."""


def verify_train_state(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(state, results)`` of the checkpoint in ``path`` after checking it end to end.

    Checks, in order: ``train_state.pt`` exists; each file's SHA-256 matches ``meta.json`` (a
    ``state-N`` directory must have it; a ``train_state`` one written before checksums were
    recorded has none to check); ``torch.load`` with
    ``weights_only`` reads it; ``results.json`` (when present) parses.

    Raises:
        CheckpointError: with one line saying which check failed.
    """
    path = Path(path)
    file = path / TRAIN_STATE
    if not file.is_file():
        raise CheckpointError(f"{path}: no {TRAIN_STATE}")
    meta_file = path / TRAIN_STATE_META
    sums: dict[str, str] = {}
    if _STATE_DIR.match(path.name) and not meta_file.is_file():  # written with checksums
        raise CheckpointError(f"{meta_file}: missing, nothing to verify the train-state with")
    if meta_file.is_file():
        try:
            sums = dict(json.loads(meta_file.read_text()).get("sha256") or {})
        except (ValueError, AttributeError, TypeError) as e:
            raise CheckpointError(f"{meta_file}: unreadable ({e})") from None
    for name, digest in sums.items():
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name}: missing")
        if _sha256(path / name) != digest:
            raise CheckpointError(f"{path / name}: checksum mismatch (the file is damaged)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, unpickling error, ...
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file}: does not load ({type(e).__name__}: {first})") from None
    if not isinstance(state, dict) or "adapters" not in state:
        raise CheckpointError(f"{file}: not a plora train-state")
    results = None
    if (path / RESULTS_FILE).is_file():
        try:
            results = dict(json.loads((path / RESULTS_FILE).read_text()))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{path / RESULTS_FILE}: unreadable ({e})") from None
    return state, results


# --------------------------------------------------------- a job's checkpoints
def checkpoint_dirs(job_dir: str | os.PathLike[str]) -> list[Path]:
    """A job's train-state directories, newest (highest global step) first."""
    job_dir = Path(job_dir)
    if not job_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in job_dir.iterdir() if (m := _STATE_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def state_dir(job_dir: str | os.PathLike[str], global_step: int) -> Path:
    """Where :func:`write_checkpoint` puts the train-state of ``global_step``."""
    return Path(job_dir) / f"state-{int(global_step):09d}"


def write_checkpoint(
    job_dir: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    results: Mapping[str, Any],
    keep: int = KEEP_CHECKPOINTS,
) -> Path:
    """Save ``state`` and ``results`` as ``job_dir/state-<global step>/`` (atomically) and
    remove all but the newest ``keep`` train-states of the job."""
    job_dir = Path(job_dir)
    step = int(state.get("global_step") or 0)
    path = save_train_state(state_dir(job_dir, step), state, results=results)
    for old in checkpoint_dirs(job_dir)[max(1, keep) :]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def latest_good_checkpoint(
    job_dir: str | os.PathLike[str],
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[str]]:
    """``(state, results, notes)`` of the newest train-state of ``job_dir`` that verifies.

    Damaged ones are skipped, each with a note saying why; ``(None, None, notes)`` when none
    verifies (the job's configs start from scratch). A job directory written before
    numbered train-states (``train_state/`` + ``results.json``) is read too.
    """
    job_dir = Path(job_dir)
    notes: list[str] = []
    candidates = checkpoint_dirs(job_dir)
    legacy = job_dir / "train_state"
    if legacy.is_dir():
        candidates.append(legacy)
    for path in candidates:
        try:
            state, results = verify_train_state(path)
        except CheckpointError as e:
            notes.append(f"checkpoint skipped: {e}")
            continue
        if results is None and path is legacy and (job_dir / RESULTS_FILE).is_file():
            with_results = json.loads((job_dir / RESULTS_FILE).read_text())
            results = dict(with_results)
        if notes:
            notes.append(f"resumed from {path.name} (global step {state.get('global_step')})")
        return state, results, notes
    if notes:
        notes.append("no checkpoint verifies: the job's configs start from scratch")
    return None, None, notes


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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
    "KEEP_CHECKPOINTS",
    "CheckpointError",
    "adamw_slot_state",
    "adapter_base_name",
    "as_tuple",
    "checkpoint_dirs",
    "detached_copy",
    "export_peft_adapter",
    "has_train_state",
    "latest_good_checkpoint",
    "load_train_state",
    "peft_lora_config",
    "save_train_state",
    "snapshot_weights",
    "verify_train_state",
    "write_checkpoint",
    "write_peft_adapter",
]
