"""TIMING SIMULATION engine for ``benchmarks/control_plane.py``: no model, no training.

``SimEngine`` has the interface of :class:`plora.engine.session.PackSession` (``cls(spec)`` once per
resident worker, ``run(request, hooks) -> PackOutcome``) and plugs in through
``RunOptions(engine=SimEngine)``. Each packed step only sleeps the step's booked time -- what the
sweep's own cost model charges the pack per step, ``t_fixed(1) + Σ_k t_k(1)``
(:meth:`~plora.cost.model.SweepCostModel.step_fixed_time`,
:meth:`~plora.cost.model.SweepCostModel.config_step_time` per step) -- times ``PLORA_SIM_SCALE``,
and reports a made-up loss curve per config, ``loss(s) = f + (2 - f) e^{-s/30}`` with a floor
``f`` in [0.2, 1.2) drawn from the config id, so early stopping has laggards to stop. It obeys
control (stop, add, pause, abort) every step and checkpoints its counters every N steps, so the
driver's whole loop (streaming, refill, early stop, retry of a killed worker) runs as in a real
sweep.

It lives under ``benchmarks/`` (never imported by ``plora``): ``plora sweep`` cannot reach it.
It imports no torch, so a worker costs a bare Ray worker's memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from plora.engine.api import (
    AdapterStatus,
    ConfigResult,
    EngineSpec,
    JobTimings,
    PackHooks,
    PackOutcome,
    PackRequest,
    StepReport,
    SyncHooks,
)
from plora.engine.reports import StepMetrics, StepProfile
from plora.utils import atomic_write_json

SCALE_ENV = "PLORA_SIM_SCALE"
"""Simulated seconds per booked second (the workers' environment)."""


def floor_loss(config_id: str) -> float:
    """The loss config ``config_id``'s made-up curve tends to, in [0.2, 1.2)."""
    h = int(hashlib.sha256(config_id.encode()).hexdigest()[:8], 16)
    return 0.2 + (h % 1000) / 1000.0


def sim_loss(config_id: str, step: int) -> float:
    f = floor_loss(config_id)
    return f + (2.0 - f) * math.exp(-step / 30.0)


class SimEngine:
    """A resident engine that sleeps each step's booked time (see the module docstring)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.scale = float(os.environ.get(SCALE_ENV, "1e-3"))
        self._cost: Any = None
        self.charged = False

    def _booked_step_s(self, configs: list[Any]) -> float:
        """The cost model's seconds for one step of ``configs`` packed on one GPU."""
        cost = self._cost
        fixed = cost.step_fixed_time(1, 1)
        return fixed + sum(cost.config_step_time(c, 1) / cost.expected_steps(c) for c in configs)

    def _load_cost(self, out_dir: str) -> None:
        if self._cost is None:  # the sweep's own cost model, from DIR/sweep.yaml
            from plora.config import SweepConfig
            from plora.cost.build import build_cost_model

            sweep = SweepConfig.from_yaml(Path(out_dir) / "sweep.yaml")
            self._cost = build_cost_model(sweep, use_profile=False)

    def run(self, request: PackRequest, hooks: PackHooks | None = None) -> PackOutcome:
        self._load_cost(request.out_dir)
        load_s, self.charged = (0.0 if self.charged else 0.01), True
        cfgs = {c.config_id: c for c in request.configs}
        ckpt = Path(request.checkpoint.dir) / "sim.json" if request.checkpoint.dir else None
        state: dict[str, dict[str, Any]] = {}
        if request.resume and ckpt is not None and ckpt.is_file():
            state = json.loads(ckpt.read_text())
        for cid in cfgs:
            state.setdefault(cid, {"step": 0, "status": "running"})
        n, t_train = 0, time.perf_counter()
        while any(s["status"] == "running" for s in state.values()):
            n += 1
            live = [cid for cid, s in state.items() if s["status"] == "running"]
            step_s = self._booked_step_s([cfgs[c] for c in live]) * self.scale
            time.sleep(step_s)
            metrics = []
            for cid in live:
                s = state[cid]
                s["step"] += 1
                if s["step"] >= self._steps(cfgs[cid]):
                    s["status"] = "done"
                metrics.append(StepMetrics(config_id=cid, step=s["step"], loss=sim_loss(cid, s["step"]),
                                           lr=cfgs[cid].lr, tokens=1024, grad_norm=1.0, time_s=step_s))  # fmt: skip
            if hooks is not None:
                profile = StepProfile(step=n, time_s=step_s, adapters=len(live), rows=len(live),
                                      seq_len=1024, tokens=1024 * len(live),
                                      padded_tokens=1024 * len(live), micro_batches=1,
                                      peak_memory_bytes=0)  # fmt: skip
                hooks.on_step(StepReport(metrics=tuple(metrics), profile=profile))
            every = request.checkpoint.every_steps
            if ckpt is not None and every and n % every == 0:
                if isinstance(hooks, SyncHooks):  # as PackSession: metrics durable first
                    hooks.sync()
                atomic_write_json(ckpt, state)
            if hooks is not None:
                self._obey(hooks, state, cfgs)
        train_s = time.perf_counter() - t_train
        results = {
            cid: ConfigResult(
                config_id=cid,
                status=_STATUS.get(s["status"], AdapterStatus.STOPPED),
                steps=s["step"],
                tokens=1024 * s["step"],
                final_train_loss=sim_loss(cid, s["step"]),
                eval_loss=sim_loss(cid, s["step"]),
                eval_metric=-sim_loss(cid, s["step"]),
                adapter_path=None,
                eval_s=0.0,
                export_s=0.0,
            )
            for cid, s in state.items()
        }
        timings = JobTimings(load_s=load_s, start_s=0.0, train_s=train_s, model_loads=1)
        return PackOutcome(job_id=request.job_id, results=results, timings=timings)

    def _steps(self, config: Any) -> int:
        return int(self._cost.steps(config))

    def _obey(self, hooks: PackHooks, state: dict[str, dict[str, Any]], cfgs: dict) -> None:
        ctl = hooks.poll()
        if ctl.abort:
            raise RuntimeError("aborted")
        for cid in (*ctl.stop, *ctl.pause):
            if state.get(cid, {}).get("status") == "running":
                state[cid]["status"] = "paused" if cid in ctl.pause else "stopped"
        for c in ctl.add:
            cfgs[c.config_id] = c
            state[c.config_id] = {"step": 0, "status": "running"}


_STATUS = {"done": AdapterStatus.COMPLETED, "paused": AdapterStatus.PAUSED}

__all__ = ["SCALE_ENV", "SimEngine", "floor_loss", "sim_loss"]
