"""One job on a resident model: the step loop of :class:`PackJob` (:meth:`PackJob.train`) and the clock of its phases.

Loop, between steps: ``hooks.poll()`` -> stop some configs / add new ones / abort; one packed
step; ``hooks.on_step`` (its metrics and measurements); the adapters that finished (their steps
done, or stopped) are
exported in PEFT format to ``out_dir/adapters/<config_id>/`` -- their weights copied to the host
at once, the files written on a background thread (:class:`~plora.engine.export.ExportWriter`)
while the same adapters are evaluated together in packed forwards -- and leave their slots; every ``checkpoint.every_steps`` steps the
hooks are synced (``hooks.sync()`` when they have it: the runtime makes the metrics reported so
far durable, so a resumed curve has no hole), the exports handed over so far finish, and then the
train-state and the results so far are
written to ``checkpoint.dir/state-<global step>/`` with checksums
(:func:`plora.engine.checkpoint.write_checkpoint`; the previous one is kept). With ``resume``,
training continues from the newest checkpoint that verifies (results of adapters finalised
before it are kept, not recomputed); a damaged one is skipped with a note in
``PackOutcome.notes``, and with none left the pack starts from scratch.
:class:`~plora.engine.api.JobTimings` says where the job's seconds went. The outcome (and every
checkpoint's results) comes only once every adapter directory it names is written; a failed
write fails the job with its error and leaves no directory behind.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plora.config import LoRAConfig
from plora.engine import checkpoint as ckpt
from plora.engine import pause
from plora.engine.api import (
    ConfigResult,
    JobTimings,
    PackHooks,
    PackRequest,
    StepReport,
    SyncHooks,
)
from plora.engine.export import ExportWriter, snapshot_weights
from plora.engine.reports import Control
from plora.engine.trainer import AdapterStatus, PackedTrainer


class JobClock:
    """Wall seconds per phase of one job (``with clock.phase("train"): ...``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.checkpoints = 0
        self.exports = 0
        self.started_at = time.time()
        """Wall-clock time of the job's start (the marks below are offsets from it)."""
        self._t0 = time.perf_counter()
        self.marks: dict[str, float] = {}
        """Seconds from the job's start to the first step's end (``first_step``) and the last
        step's, evaluation's and export's (``last_step``, ``eval_end``, ``export_end``)."""

    def mark(self, name: str, *, first: bool = False) -> None:
        """``name`` happened now (``first``: keep the earliest)."""
        if not (first and name in self.marks):
            self.marks[name] = time.perf_counter() - self._t0

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)

    def timings(self, *, load_s: float, model_loads: int) -> JobTimings:
        s = self.seconds
        return JobTimings(
            load_s=load_s,
            start_s=s.get("start", 0.0),
            train_s=s.get("train", 0.0),
            eval_s=s.get("eval", 0.0),
            export_s=s.get("snapshot", 0.0) + s.get("export_write", 0.0),
            export_critical_s=s.get("snapshot", 0.0) + s.get("export_wait", 0.0),
            exports=self.exports,
            checkpoint_s=s.get("checkpoint", 0.0),
            checkpoints=self.checkpoints,
            model_loads=model_loads,
            started_at=self.started_at,
            first_step_s=self.marks.get("first_step"),
            last_step_s=self.marks.get("last_step"),
            eval_end_s=self.marks.get("eval_end"),
            export_end_s=self.marks.get("export_end"),
        )


class _Phase:
    def __init__(self, clock: JobClock, name: str) -> None:
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.clock.add(self.name, time.perf_counter() - self.t0)


class PackJob:
    """Bookkeeping of one pack: the step loop, results, exports, evaluation, checkpoints."""

    def __init__(
        self,
        trainer: PackedTrainer,
        data: Any,
        tokenizer: Any,
        request: PackRequest,
        clock: JobClock,
        *,
        agree: Callable[[Any], Any] = lambda value: value,
        writer: bool = True,
    ) -> None:
        self.trainer = trainer
        self.agree = agree
        """Makes every rank of a parallel job act on rank 0's control and timing decisions."""
        self.writer = writer
        """Whether this process writes the checkpoint files (collectives run on every rank)."""
        self.data = data
        self.tokenizer = tokenizer
        self.request = request
        self.clock = clock
        self.out_dir = Path(request.out_dir)
        policy = request.checkpoint
        self.ckpt_dir = Path(policy.dir) if policy.dir is not None else None
        self.results: dict[str, ConfigResult] = {}
        self.notes: list[str] = []
        """What the job should know about its start (a damaged checkpoint skipped, ...)."""
        self.hooks: PackHooks | None = None
        self.exports = ExportWriter()
        """Writes the finished adapters' PEFT directories in the background."""

    def start(self) -> None:
        if self.request.resume and self.ckpt_dir is not None:
            state, results, notes = ckpt.latest_good_checkpoint(self.ckpt_dir)
            self.notes += notes
            # rank 0's view: in a parallel job every rank must resume from the same step
            step = state.get("global_step") if state is not None else None
            agreed = self.agree(step)
            if agreed != step:
                state, results = (None, None) if agreed is None else ckpt.verify_train_state(
                    ckpt.state_dir(self.ckpt_dir, agreed))  # fmt: skip
            if state is not None:
                self.trainer.load_state_dict(state)
                for cid, r in (results or {}).items():
                    self.results[cid] = ConfigResult.from_dict(r)
                asked = {c.config_id for c in self.request.configs}
                for cid in self.trainer.active:  # paused after this checkpoint: it left the job
                    if cid not in asked and pause.is_paused(self.out_dir, cid):
                        self.trainer.release(cid)
        pending = [
            cfg
            for cfg in self.request.configs
            if cfg.config_id not in self.results and cfg.config_id not in self.trainer.adapters
        ]
        pause.join_all(self.trainer, pending, self.out_dir)  # a paused config continues

    def train(self, hooks: PackHooks | None) -> None:
        """Step until every adapter ended or the job is aborted: between steps the control
        (stop, add, pause), finished adapters evaluated and exported, checkpoints on policy."""
        trainer, policy = self.trainer, self.request.checkpoint
        self.hooks = hooks
        last_checkpoint = time.monotonic()
        while True:
            control = self.agree(hooks.poll() if hooks is not None else None)
            if control is not None:
                if control.abort:
                    self.abort()
                    return
                self.apply(control)
            self.finalize_finished()
            if not trainer.active:
                break
            with self.clock.phase("train"):
                metrics = trainer.step()
            if metrics:
                self.clock.mark("first_step", first=True)
                self.clock.mark("last_step")
            if hooks is not None and metrics:
                assert trainer.last_step is not None  # set by the step
                report = StepReport(
                    metrics=tuple(metrics), profile=trainer.last_step, device=str(trainer.device)
                )
                hooks.on_step(report)
            self.finalize_finished()
            every = policy.every_steps
            due = every is not None and every != 0 and trainer.global_step % every == 0
            if policy.every_s is not None:
                due = self.agree(due or time.monotonic() - last_checkpoint >= policy.every_s)
            if due:
                self.checkpoint()
                last_checkpoint = time.monotonic()
        self.checkpoint()

    def apply(self, control: Control) -> None:
        for cid in sorted(control.stop):
            if cid in self.trainer.active:
                self.trainer.remove(cid)
        for cid in sorted(control.pause - control.stop):
            if cid in self.trainer.active and self.trainer.pausable:
                pause.leave(self.trainer, cid, self.out_dir)
        joining: list[LoRAConfig] = []
        for cfg in control.add:
            cid = cfg.config_id
            done = cid in self.results and self.results[cid].status is not AdapterStatus.PAUSED
            if (
                not done
                and cid not in self.trainer.adapters
                and cid not in {c.config_id for c in joining}
            ):
                self.results.pop(cid, None)
                joining.append(cfg)
        pause.join_all(self.trainer, joining, self.out_dir)  # a paused config continues

    def finalize_finished(self) -> None:
        """Export every finished adapter (snapshot now, files in the background), evaluate them
        together meanwhile, free their slots."""
        self.exports.raise_failed()  # a write that failed already fails the job now
        finished = list(self.trainer.finished)
        if not finished:
            return
        export_s: dict[str, float] = {}
        with self.clock.phase("snapshot"):
            for cid in finished:
                t0 = time.perf_counter()
                weights = self.trainer.adapter_weights(cid)  # a collective in a parallel job
                if self.writer:
                    self.exports.submit(
                        cid,
                        self.out_dir / "adapters" / cid,
                        config=self.trainer.adapter(cid).config,
                        tensors=snapshot_weights(weights),  # before the slot can change
                        base_model_name_or_path=self.trainer.base_model_name_or_path,
                    )
                export_s[cid] = time.perf_counter() - t0  # + its write's, in drain_exports
        self.clock.exports += len(finished)
        # every adapter that leaves is evaluated -- completed, stopped early or paused -- so
        # each has the eval loss it has now, packed together in one pass
        scores: dict[str, tuple[float | None, float | None, float]] = {}
        if self.request.evaluate:
            with self.clock.phase("eval"):
                scores = _evaluate(self.trainer, self.tokenizer, self.data, finished)
            if scores:
                self.clock.mark("eval_end")
        for cid in finished:
            ad = self.trainer.adapter(cid)
            if ad.status is not AdapterStatus.PAUSED:
                pause.forget(self.out_dir, cid)
            loss, metric, eval_s = scores.get(cid, (None, None, 0.0))
            self.results[cid] = ConfigResult(
                config_id=cid,
                status=ad.status,
                steps=ad.step,
                tokens=ad.tokens,
                final_train_loss=ad.last_loss,
                eval_loss=loss,
                eval_metric=metric,
                adapter_path=str(self.out_dir / "adapters" / cid),
                eval_s=eval_s,
                export_s=export_s[cid],
            )
            self.trainer.release(cid)

    def drain_exports(self) -> None:
        """Wait for the exports handed over so far (raising the first write's error) and add
        each one's write seconds to its result; seconds waited here are on the critical path."""
        if not self.exports.pending:
            return
        t0 = time.perf_counter()
        try:
            written = self.exports.wait()
        finally:
            self.clock.add("export_wait", time.perf_counter() - t0)
        self.clock.mark("export_end")
        for cid, seconds in written.items():
            self.clock.add("export_write", seconds)
            if cid in self.results:
                r = self.results[cid]
                self.results[cid] = dataclasses.replace(r, export_s=r.export_s + seconds)

    def abort(self) -> None:
        """Checkpoint, then report every unfinished config as aborted (nothing exported)."""
        self.checkpoint()
        for cid in self.trainer.active:
            ad = self.trainer.adapter(cid)
            self.results[cid] = ConfigResult(
                config_id=cid,
                status=AdapterStatus.ABORTED,
                steps=ad.step,
                tokens=ad.tokens,
                final_train_loss=ad.last_loss,
            )

    def checkpoint(self) -> None:
        if self.ckpt_dir is None:
            return
        self.drain_exports()  # the results it saves name adapter directories: written first
        with self.clock.phase("checkpoint"):
            if isinstance(self.hooks, SyncHooks):  # metrics durable before the state after them
                self.hooks.sync()
            state = self.trainer.state_dict()  # a collective in a parallel job: every rank
            if self.writer:
                ckpt.write_checkpoint(
                    self.ckpt_dir, state, results={c: r.to_dict() for c, r in self.results.items()}
                )
        self.clock.checkpoints += 1


def _evaluate(
    trainer: PackedTrainer, tokenizer: Any, data: Any, config_ids: list[str]
) -> dict[str, tuple[float | None, float | None, float]]:
    """``{config_id: (eval loss, task metric, eval seconds)}`` of finished adapters, evaluated
    together on the eval split (``plora.engine.evaluate``)."""
    if not getattr(data, "eval", None):
        return {}
    from plora.engine.evaluate_packed import evaluate_adapters

    slots = {trainer.adapter(c).slot: c for c in config_ids}
    res = evaluate_adapters(trainer.eval_model, tokenizer, data, list(slots))  # packed
    out = {}
    for slot, cid in slots.items():
        r = res[slot]
        loss = None if math.isnan(r.loss) else float(r.loss)
        metric = None if r.metric_value is None else float(r.metric_value)
        out[cid] = (loss, metric, float(r.seconds))
    return out


__all__ = ["JobClock", "PackJob"]
