"""Small real implementations the runtime tests drive the coordinator with.

``AffineCost`` is a complete :class:`plora.cost.CostModel` (memory linear in rank, time affine in
the pack's tokens) with a least-squares ``refit``; ``GreedyPlanner`` packs configs first-fit by
memory into d = 1 jobs and list-schedules them. The coordinator's logic is tested against these
so a failure points at the coordinator, not at the ILP or the physics.

The coordinator tests drive it with ``Clock`` (a fake clock), ``make`` (a coordinator on these),
``finish`` (a job's step reports and result) and ``run_to_end`` (every job, in launch order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from plora.config import LoRAConfig
from plora.cost import Strategy
from plora.cost.throughput import StepSample
from plora.planner.types import Job, Plan

if TYPE_CHECKING:
    from plora.runtime.coordinator import Coordinator
    from plora.runtime.records import JobSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class AffineCost:
    """T(pack) = t0 + sec_per_sample * Σ_k steps_k * batch_k; M = base + per_rank * Σ r_k."""

    base_bytes: float = 1.0
    per_rank_bytes: float = 0.1
    capacity_bytes: float = 4.0
    t0: float = 1.0
    sec_per_sample: float = 0.01
    seq_len: int = 16

    def base_memory(self, d: int, strategy: Strategy) -> float:
        return self.base_bytes

    def config_memory(self, config: LoRAConfig, d: int, strategy: Strategy) -> float:
        return self.per_rank_bytes * config.rank

    def capacity(self, d: int) -> float:
        return self.capacity_bytes

    def steps(self, config: LoRAConfig) -> int:
        return int(config.max_steps or 1)

    def fixed_time(self, steps: int, d: int, strategy: Strategy) -> float:
        return self.t0

    def config_time(self, config: LoRAConfig, d: int, strategy: Strategy) -> float:
        return self.sec_per_sample * self.steps(config) * config.batch_size

    def job_time(self, pack: Sequence[LoRAConfig], d: int, strategy: Strategy) -> float:
        return self.fixed_time(0, d, strategy) + sum(self.config_time(c, d, strategy) for c in pack)

    def config_work(self, config: LoRAConfig) -> float:
        return self.config_time(config, 1, Strategy.TP)

    def strategies(self) -> Sequence[Strategy]:
        return ()

    def coefficients(self) -> dict[str, float]:
        return {"t0": self.t0, "sec_per_sample": self.sec_per_sample}

    def refit(self, samples: Sequence[StepSample]) -> AffineCost:
        """Least-squares sec_per_sample (t0 kept) from measured steps: t ≈ t0/steps + s·Σ B_k."""
        num = den = 0.0
        for smp in samples:
            rows = sum(a.sequences for a in smp.adapters)
            num += smp.step_time_s * rows
            den += rows * rows
        return dataclasses.replace(self, sec_per_sample=num / den)


class GreedyPlanner:
    """First-fit-decreasing packing by memory into d = 1 jobs, list-scheduled on G GPUs."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def _pack(self, configs: Sequence[LoRAConfig], cost: Any) -> list[list[LoRAConfig]]:
        packs: list[list[LoRAConfig]] = []
        for c in sorted(configs, key=lambda c: -c.rank):
            for p in packs:
                used = cost.base_memory(1, Strategy.TP) + sum(
                    cost.config_memory(k, 1, Strategy.TP) for k in [*p, c]
                )
                if used <= cost.capacity(1):
                    p.append(c)
                    break
            else:
                packs.append([c])
        return packs

    def _schedule(self, packs: list[list[LoRAConfig]], cost: Any, gpu_free_at: list[float]) -> Plan:
        jobs = []
        for i, p in enumerate(packs):
            g = min(range(len(gpu_free_at)), key=lambda j: gpu_free_at[j])
            start = gpu_free_at[g]
            end = start + cost.job_time(p, 1, Strategy.TP)
            gpu_free_at[g] = end
            jobs.append(
                Job(
                    job_id=f"p{i:03d}",
                    config_ids=tuple(c.config_id for c in p),
                    gpus=1,
                    strategy=None,
                    start_s=start,
                    end_s=end,
                    memory_gib_per_gpu=0.0,
                    gpu_ids=(g,),
                )
            )
        end = max((j.end_s for j in jobs), default=0.0)
        return Plan(
            jobs=tuple(jobs),
            num_configs=sum(len(p) for p in packs),
            num_gpus=len(gpu_free_at),
            makespan_s=end,
            lower_bound_s=0.0,
            ratio_bound=1.0,
        )

    def plan_sweep(self, configs: Sequence[LoRAConfig], cost: Any, num_gpus: int, **_: Any) -> Plan:
        self.calls.append({"kind": "plan", "n": len(configs), "cost": cost})
        return self._schedule(self._pack(configs, cost), cost, [0.0] * num_gpus)

    def replan(
        self,
        remaining: Sequence[LoRAConfig],
        free_gpus: int,
        running: Sequence[Job],
        now: float,
        cost: Any,
        num_gpus: int,
        **_: Any,
    ) -> Plan:
        self.calls.append(
            {"kind": "replan", "n": len(remaining), "free": free_gpus, "cost": cost, "now": now}
        )
        busy = sorted(max(j.end_s, now) for j in running)[: num_gpus - free_gpus]
        free_at = [now] * free_gpus + busy
        return self._schedule(self._pack(remaining, cost), cost, free_at)


def lora(i: int, *, rank: int = 8, steps: int = 10, batch: int = 2) -> LoRAConfig:
    return LoRAConfig(
        config_id=f"c{i:02d}",
        rank=rank,
        alpha=16,
        lr=1e-3,
        batch_size=batch,
        max_steps=steps,
        seed=i,  # distinct hyperparameters: the coordinator trains equal ones once
    )


def report(*metrics: dict[str, Any], time_s: float = 0.05, seq_len: int = 16) -> Any:
    """A ``StepReport`` of one packed step from per-adapter ``{"config_id", "step", ...}``."""
    from plora.engine.api import StepReport
    from plora.engine.reports import StepMetrics, StepProfile

    ms = tuple(
        StepMetrics(config_id=m["config_id"], step=int(m["step"]), loss=float(m.get("loss", 1.0)),
                    lr=1e-3, tokens=int(m.get("tokens", 10)), grad_norm=0.0, time_s=time_s)
        for m in metrics
    )  # fmt: skip
    profile = StepProfile(step=1, time_s=time_s, adapters=len(ms), rows=len(ms), seq_len=seq_len,
                          tokens=10 * len(ms), padded_tokens=10 * len(ms), micro_batches=1,
                          peak_memory_bytes=0)  # fmt: skip
    return StepReport(metrics=ms, profile=profile)


def outcome(job_id: str, results: dict[str, dict[str, Any]]) -> Any:
    """A ``PackOutcome`` from per-config result fields (``status`` "done" means completed)."""
    from plora.engine.api import AdapterStatus, ConfigResult, PackOutcome

    def one(cid: str, r: dict[str, Any]) -> ConfigResult:
        status = {"done": "completed"}.get(r.get("status", "completed"), r.get("status"))
        fields = {k: v for k, v in r.items() if k not in ("status", "config_id")}
        fields.setdefault("steps", 0)
        fields.setdefault("tokens", 0)
        fields.setdefault("final_train_loss", None)
        return ConfigResult(config_id=cid, status=AdapterStatus(status), **fields)

    return PackOutcome(job_id=job_id, results={c: one(c, r) for c, r in results.items()})


class Clock:
    """A fake clock: ``t`` seconds, set by the test."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(configs, *, gpus=2, cost=None, store=None, **kw):
    """A coordinator of ``configs`` on ``AffineCost`` and ``GreedyPlanner`` with a fake clock
    (metrics flushed at every report); returns it and its clock."""
    from plora.runtime.coordinator import Coordinator

    clock = Clock()
    coord = Coordinator(
        cost=cost or AffineCost(),
        num_gpus=gpus,
        configs=configs,
        planner=GreedyPlanner(),
        store=store,
        clock=clock,
        metrics_flush_s=0.0,
        **kw,
    )
    return coord, clock


def finish(
    coord: Coordinator,
    spec: JobSpec,
    *,
    step_time: float = 0.05,
    status="done",
    steps: dict[str, int] | None = None,
) -> list[JobSpec]:
    """Three step reports of ``spec``'s configs, then its result (each config done at its last
    step, or after one step if asked to stop); returns what the coordinator launches next."""
    results = {
        c.config_id: {
            "config_id": c.config_id,
            "status": status,
            # a config asked to stop stopped early (after its first step) unless told otherwise
            "steps": (steps or {}).get(
                c.config_id, 1 if c.config_id in coord.state.configs.stop_requests else c.max_steps
            ),
            "tokens": 100 * c.batch_size,
            "final_train_loss": 1.0,
            "eval_loss": 1.5 - c.rank / 100,
            "eval_metric": c.rank / 100,
            "adapter_path": f"adapters/{c.config_id}",
        }
        for c in spec.configs
    }
    launched = [report(*({"config_id": c, "step": 1} for c in spec.config_ids), time_s=step_time)]
    coord.on_reports(spec.job_id, launched * 3)
    return coord.on_job_finished(spec.job_id, outcome(spec.job_id, results))


def run_to_end(coord: Coordinator, clock: Clock, launches: list[JobSpec], **kw) -> list[JobSpec]:
    """Finish jobs in launch order until the sweep is done; return every launch."""
    every = list(launches)
    queue = list(launches)
    while queue:
        spec = queue.pop(0)
        clock.t += 1.0
        new = finish(coord, spec, **kw)
        every += new
        queue += new
    return every
