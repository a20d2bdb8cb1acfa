"""``run_pack``: train one pack to completion in this process (what a Ray worker calls).

Loop, between steps: ``hooks.poll()`` -> stop some configs / add new ones / abort; one packed
step; ``hooks.on_metrics``; every adapter that finished (its steps done, or stopped) is exported
in PEFT format to ``out_dir/adapters/<config_id>/``, evaluated if it completed, and leaves its
slot; every ``checkpoint_every`` steps the train-state and the results so far are written to
``checkpoint_dir``. With ``resume`` and a checkpoint present, training continues from it
(results of adapters finalised before the checkpoint are kept, not recomputed).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from plora.config import ConfigError, DatasetSpec, LoRAConfig, ModelRef
from plora.engine import checkpoint as ckpt
from plora.engine.records import Control
from plora.engine.trainer import AdapterStatus, PackedTrainer, PackProfile, StepMetrics
from plora.utils import atomic_write_json

RESULTS_FILE = "results.json"
TRAIN_STATE_DIR = "train_state"


class ConfigStatus(StrEnum):
    """How a config's training ended."""

    COMPLETED = "completed"
    STOPPED = "stopped"
    ABORTED = "aborted"


@runtime_checkable
class PackHooks(Protocol):
    """Callbacks of :func:`run_pack` (the runtime relays them to the coordinator)."""

    def on_metrics(self, metrics: list[StepMetrics]) -> None: ...

    def poll(self) -> Control: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ConfigResult:
    """The outcome of one config of the pack."""

    config_id: str
    status: ConfigStatus
    steps: int
    tokens: int
    final_train_loss: float | None
    eval_loss: float | None = None
    eval_metric: float | None = None
    adapter_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": str(self.status)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConfigResult:
        return cls(**{**data, "status": ConfigStatus(data["status"])})


@dataclass(frozen=True, kw_only=True, slots=True)
class PackResult:
    """Every config's result and the pack's measured profile."""

    results: dict[str, ConfigResult] = field(default_factory=dict)
    profile: PackProfile | None = None


def run_pack(
    *,
    model: ModelRef | str | dict,
    configs: list[LoRAConfig],
    dataset: DatasetSpec | dict,
    out_dir: str | os.PathLike[str],
    device: str | torch.device | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    checkpoint_every_s: float | None = None,
    resume: bool = True,
    hooks: PackHooks | None = None,
    max_rows: int | None = None,
    gradient_checkpointing: bool = False,
    evaluate: bool = True,
) -> PackResult:
    """Train ``configs`` packed on one copy of ``model`` until each finishes or is stopped.

    Args:
        model: the base model (``ModelRef``, its dict, or a name/path).
        configs: the pack.
        dataset: the data (``DatasetSpec`` or its dict).
        out_dir: adapters go to ``out_dir/adapters/<config_id>/`` (PEFT format).
        device: ``"cuda"``/``"cpu"``; default CUDA when available (bf16 base + autocast).
        checkpoint_dir: train-state checkpoints and the results so far.
        checkpoint_every: checkpoint every this many steps (None: only at the end).
        checkpoint_every_s: also checkpoint when this many seconds passed since the last one
            (None: no time-based checkpoints).
        resume: continue from ``checkpoint_dir`` when it holds a train-state.
        hooks: metrics sink and control source (see :class:`PackHooks`).
        max_rows: most sequences per forward (gradient accumulation beyond).
        gradient_checkpointing: recompute base activations in backward.
        evaluate: evaluate each completed adapter on the eval split.
    """
    from plora.engine.data import load_dataset
    from plora.models import load_model, resolve_model_path

    if checkpoint_every is not None and checkpoint_every < 1:
        raise ConfigError("must be >= 1 or null", key="checkpoint_every", value=checkpoint_every)
    if checkpoint_every_s is not None and not checkpoint_every_s >= 0:
        raise ConfigError(
            "must be >= 0 seconds or null", key="checkpoint_every_s", value=checkpoint_every_s
        )
    ids = [c.config_id for c in configs]
    if len(set(ids)) != len(ids):
        raise ConfigError("duplicate config ids in one pack", key="configs", value=ids)
    ref = ModelRef(**model) if isinstance(model, dict) else model
    spec = DatasetSpec(**dataset) if isinstance(dataset, dict) else dataset
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    base, tokenizer = load_model(ref, dtype=dtype, device=dev)
    data = load_dataset(spec, tokenizer)
    trainer = PackedTrainer(
        base,
        tokenizer,
        data,
        device=dev,
        seq_len=spec.max_seq_len,
        max_rows=max_rows,
        gradient_checkpointing=gradient_checkpointing,
        base_model_name_or_path=resolve_model_path(ref),
    )
    run = _PackRun(trainer, data, tokenizer, Path(out_dir), checkpoint_dir, evaluate)
    run.start(configs, resume=resume)
    last_checkpoint = time.monotonic()
    while True:
        control = hooks.poll() if hooks is not None else None
        if control is not None:
            if control.abort:
                run.abort()
                break
            run.apply(control)
        run.finalize_finished()
        if not trainer.active:
            break
        metrics = trainer.step()
        if hooks is not None and metrics:
            hooks.on_metrics(metrics)
        run.finalize_finished()
        due = bool(checkpoint_every) and trainer.global_step % checkpoint_every == 0
        if checkpoint_every_s is not None:
            due = due or time.monotonic() - last_checkpoint >= checkpoint_every_s
        if due:
            run.checkpoint()
            last_checkpoint = time.monotonic()
    run.checkpoint()
    return PackResult(results=dict(run.results), profile=trainer.profile())


class _PackRun:
    """Bookkeeping of one ``run_pack`` call: results, exports, checkpoints."""

    def __init__(self, trainer, data, tokenizer, out_dir: Path, checkpoint_dir, evaluate: bool):
        self.trainer = trainer
        self.data = data
        self.tokenizer = tokenizer
        self.out_dir = out_dir
        self.ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.evaluate = evaluate
        self.results: dict[str, ConfigResult] = {}

    def start(self, configs: list[LoRAConfig], *, resume: bool) -> None:
        state = self.ckpt_dir / TRAIN_STATE_DIR if self.ckpt_dir else None
        if resume and state is not None and ckpt.has_train_state(state):
            self.trainer.load_state_dict(ckpt.load_train_state(state))
            saved = self.ckpt_dir / RESULTS_FILE
            if saved.is_file():
                for cid, r in json.loads(saved.read_text()).items():
                    self.results[cid] = ConfigResult.from_dict(r)
        for cfg in configs:
            if cfg.config_id not in self.results and cfg.config_id not in self.trainer.adapters:
                self.trainer.add(cfg)

    def apply(self, control: Control) -> None:
        for cid in sorted(control.stop):
            if cid in self.trainer.active:
                self.trainer.remove(cid)
        for cfg in control.add:
            if cfg.config_id not in self.results and cfg.config_id not in self.trainer.adapters:
                self.trainer.add(cfg)

    def finalize_finished(self) -> None:
        for cid in list(self.trainer.finished):
            ad = self.trainer.adapter(cid)
            status = (
                ConfigStatus.COMPLETED
                if ad.status is AdapterStatus.COMPLETED
                else ConfigStatus.STOPPED
            )
            path = self.out_dir / "adapters" / cid
            self.trainer.export_adapter(cid, path)
            eval_loss = eval_metric = None
            if self.evaluate and status is ConfigStatus.COMPLETED:
                eval_loss, eval_metric = _evaluate(self.trainer, self.tokenizer, self.data, ad.slot)
            self.results[cid] = ConfigResult(
                config_id=cid,
                status=status,
                steps=ad.step,
                tokens=ad.tokens,
                final_train_loss=ad.last_loss,
                eval_loss=eval_loss,
                eval_metric=eval_metric,
                adapter_path=str(path),
            )
            self.trainer.release(cid)

    def abort(self) -> None:
        """Checkpoint, then report every unfinished config as aborted (nothing exported)."""
        self.checkpoint()
        for cid in self.trainer.active:
            ad = self.trainer.adapter(cid)
            self.results[cid] = ConfigResult(
                config_id=cid,
                status=ConfigStatus.ABORTED,
                steps=ad.step,
                tokens=ad.tokens,
                final_train_loss=ad.last_loss,
            )

    def checkpoint(self) -> None:
        if self.ckpt_dir is None:
            return
        ckpt.save_train_state(self.ckpt_dir / TRAIN_STATE_DIR, self.trainer.state_dict())
        atomic_write_json(
            self.ckpt_dir / RESULTS_FILE, {c: r.to_dict() for c, r in self.results.items()}
        )


def _evaluate(trainer: PackedTrainer, tokenizer: Any, data: Any, slot: int):
    """(eval loss, task metric) of one slot on the eval split (``plora.engine.evaluate``)."""
    if not getattr(data, "eval", None):
        return None, None
    from plora.engine.evaluate import evaluate_adapters

    was_training = trainer.model.training
    trainer.model.eval()
    try:
        with torch.no_grad():
            res = evaluate_adapters(trainer.model, tokenizer, data, [slot])[slot]
    finally:
        trainer.model.train(was_training)
    loss = None if math.isnan(res.loss) else float(res.loss)
    return loss, None if res.metric_value is None else float(res.metric_value)


__all__ = [
    "ConfigResult",
    "ConfigStatus",
    "Control",
    "PackHooks",
    "PackResult",
    "run_pack",
]
