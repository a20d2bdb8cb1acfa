"""A small real engine with ``plora.engine.PackSession``'s interface, for the runtime's Ray tests.

``PackFnEngine(spec)`` counts its "model loads" (one per worker: it is resident); each ``run``
fits, per config, a 4-dim linear regression with SGD at the config's lr and seed, one step per
packed step; it streams step reports, obeys control (stop / add / abort), checkpoints every N
steps and resumes from its checkpoint; a paused config leaves with its state (written where
``plora.engine.pause`` puts a train-state) and a later pack continues it. Steps sleep
``PACKFN_STEP_S`` seconds. While the file named by ``PACKFN_GATE`` does not exist, only the first
pack to end returns; the others wait (obeying control) at their end: a test that kills a sweep
mid-way waits for the events it needs (a job ended, the others not) instead of racing the
sweep's end. A pack with more than two configs whose ids start with ``oom`` is an out-of-memory
outcome.
It exercises every runtime path without the cost of the LLM engine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from plora.config import ConfigError
from plora.engine import pause
from plora.engine.api import (
    AdapterStatus,
    ConfigResult,
    EngineSpec,
    JobTimings,
    OutcomeStatus,
    PackHooks,
    PackOutcome,
    PackRequest,
    StepReport,
    SyncHooks,
)
from plora.engine.checkpoint import TRAIN_STATE, save_train_state
from plora.engine.reports import StepMetrics, StepProfile
from plora.sweepdir.store import SweepStore
from plora.utils import atomic_write_json

LOADS = 0


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 4, generator=g)
    w = torch.tensor([1.0, -2.0, 0.5, 3.0])
    return x, x @ w


class PackFnEngine:
    hold_at = 0  # a step at which packs wait for a config to join (see _hold); 0: none
    hold_s = 0.0

    def __init__(self, spec: EngineSpec) -> None:
        global LOADS
        t0 = time.perf_counter()
        time.sleep(float(os.environ.get("PACKFN_LOAD_S", "0.05")))
        LOADS += 1
        self.loads = LOADS
        self.load_s = time.perf_counter() - t0
        self.charged = False

    def run(self, request: PackRequest, hooks: PackHooks | None = None) -> PackOutcome:
        load_s, self.charged = (0.0 if self.charged else self.load_s), True
        timings = JobTimings(load_s=load_s, model_loads=self.loads)
        configs = request.configs
        if sum(c.config_id.startswith("oom") for c in configs) > 2:  # too big for the GPU
            return PackOutcome(job_id=request.job_id, status=OutcomeStatus.OOM, timings=timings,
                               error="CUDA out of memory (packfn: more than 2 'oom' configs)")  # fmt: skip
        step_s = float(os.environ.get("PACKFN_STEP_S", "0.02"))
        x, y = _data()
        state: dict[str, dict] = {}
        ckpt_dir = request.checkpoint.dir
        ckpt = Path(ckpt_dir) / "state.json" if ckpt_dir else None
        if request.resume and ckpt is not None and ckpt.is_file():
            state = json.loads(ckpt.read_text())
        cfgs = {c.config_id: c for c in configs}
        for c in configs:
            if c.config_id not in state:
                state[c.config_id] = _start(c, request.out_dir)
        n = 0
        t_train = time.perf_counter()
        while any(s["status"] == "running" for s in state.values()) or self._gated(
            hooks, request, state, cfgs
        ):
            n += 1
            t = time.perf_counter()
            time.sleep(step_s)
            metrics = []
            for cid, s in state.items():
                if s["status"] != "running":
                    continue
                c = cfgs[cid]
                w = torch.tensor(s["w"], requires_grad=True)
                loss = ((x @ w - y) ** 2).mean()
                loss.backward()
                with torch.no_grad():
                    w -= c.lr * 100 * w.grad
                s.update(w=w.detach().tolist(), step=s["step"] + 1, loss=float(loss))
                if s["step"] >= c.max_steps:
                    s["status"] = "done"
                metrics.append(StepMetrics(config_id=cid, step=s["step"], loss=float(loss), lr=c.lr,
                                           tokens=64, grad_norm=0.0, time_s=step_s))  # fmt: skip
            dt = time.perf_counter() - t
            profile = StepProfile(step=n, time_s=dt, adapters=len(metrics), rows=len(metrics),
                                  seq_len=16, tokens=64 * len(metrics), padded_tokens=64 * len(metrics),
                                  micro_batches=1, peak_memory_bytes=0)  # fmt: skip
            if hooks is not None:
                hooks.on_step(StepReport(metrics=tuple(metrics), profile=profile))
            if (
                ckpt is not None
                and request.checkpoint.every_steps
                and n % request.checkpoint.every_steps == 0
            ):
                if isinstance(hooks, SyncHooks):  # as PackSession: metrics durable first
                    hooks.sync()
                atomic_write_json(ckpt, state)
            if hooks is not None:
                added = self._obey(hooks, request, state, cfgs)
                if n == self.hold_at and not added:
                    self._hold(hooks, request, state, cfgs)
        train_s = time.perf_counter() - t_train
        results = {}
        for cid, s in state.items():
            path = Path(request.out_dir) / cid
            path.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path / "adapter.json", {"w": s["w"]})
            err = float(((x @ torch.tensor(s["w"]) - y) ** 2).mean())
            status = {"done": AdapterStatus.COMPLETED, "paused": AdapterStatus.PAUSED}.get(
                s["status"], AdapterStatus.STOPPED
            )
            if status is not AdapterStatus.PAUSED:
                pause.forget(request.out_dir, cid)
            results[cid] = ConfigResult(config_id=cid, status=status, steps=s["step"], tokens=64 * s["step"],
                                        final_train_loss=s["loss"], eval_loss=err, eval_metric=-err,
                                        adapter_path=str(path), eval_s=0.001, export_s=0.001)  # fmt: skip
        return PackOutcome(job_id=request.job_id, results=results,
                           timings=JobTimings(load_s=load_s, start_s=0.001, train_s=train_s, model_loads=self.loads))  # fmt: skip

    def _obey(self, hooks: PackHooks, request: PackRequest, state: dict, cfgs: dict) -> bool:
        """Apply one poll's control (abort, stop, pause, add); True when configs joined."""
        ctl = hooks.poll()
        if ctl.abort:
            raise RuntimeError("aborted")
        for cid in ctl.stop:
            if state.get(cid, {}).get("status") == "running":
                state[cid]["status"] = "stopped"
        for cid in ctl.pause:
            if state.get(cid, {}).get("status") == "running":
                save_train_state(pause.paused_dir(request.out_dir, cid),
                                 {"global_step": state[cid]["step"], "adapters": {},
                                  "packfn": dict(state[cid])})  # fmt: skip
                state[cid]["status"] = "paused"
        for c in ctl.add:
            cfgs[c.config_id] = c
            state[c.config_id] = _start(c, request.out_dir)
        return bool(ctl.add)

    def _gated(
        self, hooks: PackHooks | None, request: PackRequest, state: dict, cfgs: dict
    ) -> bool:
        """Wait at the pack's end while ``PACKFN_GATE`` is absent and another pack ended first
        (the first to end claims ``<gate>.first`` with its job id); True when configs joined."""
        gate = os.environ.get("PACKFN_GATE")
        while gate and not os.path.exists(gate) and not _claim(f"{gate}.first", request.job_id):
            if hooks is not None and self._obey(hooks, request, state, cfgs):
                return True
            time.sleep(0.05)
        return False

    def _hold(self, hooks: PackHooks, request: PackRequest, state: dict, cfgs: dict) -> None:
        """Wait at step ``hold_at`` (obeying control) until a config joins the pack, or another
        pack paused a config while this one paused none, or every config here has left, or no
        config of the sweep is queued (no refill can come), or ``hold_s`` passed: a test that
        needs a pack alive when the coordinator refills the slot of a paused config waits for
        those events, not for a step time."""
        deadline = time.monotonic() + self.hold_s
        paused = Path(request.out_dir) / pause.PAUSED_DIR
        queue_checked = 0.0
        while time.monotonic() < deadline and any(s["status"] == "running" for s in state.values()):
            if self._obey(hooks, request, state, cfgs):
                return
            mine = any(s["status"] == "paused" for s in state.values())
            if not mine and paused.is_dir() and any(paused.iterdir()):
                return
            if time.monotonic() - queue_checked > 0.2:
                queue_checked = time.monotonic()
                if _queue_empty(request.out_dir):
                    return
            time.sleep(0.01)


def _queue_empty(root: str) -> bool:
    """Whether the sweep directory ``root`` says no config is queued (False while unreadable)."""
    try:
        status = SweepStore(root).read_state().get("status", {})
    except ConfigError:  # not written yet: no answer, keep waiting
        return False
    return bool(status) and "queued" not in status.values()


def _claim(path: str, job_id: str) -> bool:
    """Whether ``job_id`` holds the claim file: created now (atomically), or created before by it."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return Path(path).read_text() == job_id
    with os.fdopen(fd, "w") as f:
        f.write(job_id)
    return True


def _start(c, out_dir: str) -> dict:
    """A config's state as it joins: from its paused state when it has one."""
    path = pause.paused_dir(out_dir, c.config_id) / TRAIN_STATE
    if path.is_file():
        return {**torch.load(path)["packfn"], "status": "running"}
    w = torch.randn(4, generator=torch.Generator().manual_seed(c.seed)).tolist()
    return {"step": 0, "w": w, "loss": None, "status": "running"}


class RefillingEngine(PackFnEngine):
    """Packs wait at step 16 for a refill (see ``PackFnEngine._hold``; up to 300 s, a guard: the
    hold ends at an event): a config paused while others are queued has its slot refilled
    before its pack could end without it, however late Tune's pause arrives. Step 16 is the
    first milestone of the test's HyperBand (max_t 64, reduction factor 4): a hold short of
    it waits for a pause that cannot come until the pack steps on."""

    hold_at = 16
    hold_s = 300.0
