"""The resident engine of one rank of a ``d``-GPU job: :class:`ParallelPackSession`.

A worker group of ``d`` processes (one per GPU, :mod:`plora.runtime.actors.group`) shares one
torch.distributed group. Each process builds a ``ParallelPackSession``: it loads the base model
once, parallelises it for its rank (:func:`plora.parallel.parallelize`, with the job's
:class:`~plora.parallel.dims.ParallelDims`) and then serves successive packs exactly as
:class:`plora.engine.session.PackSession` does on one GPU, with a
:class:`~plora.parallel.trainer.ParallelPackedTrainer` per pack. What changes with ``d``:

- **Decisions come from rank 0.** Only rank 0 talks to the coordinator (its hooks stream the
  metrics and poll control); before every step the control it got, and every time-based
  checkpoint decision, is broadcast so that all ranks stop, add and checkpoint the same
  adapters at the same step (the collectives stay in step).
- **Files come from rank 0.** Train-state checkpoints (gathered, layout-free: a retried job
  resumes on a fresh group of the same ``d``) and the results so far are written by rank 0;
  adapters are gathered from the shards (:meth:`ParallelPackedTrainer.adapter_weights`, on
  every rank) and rank 0 snapshots them and writes their PEFT directories in the background.
- **Evaluation** runs the same packed forwards on every rank (TP and FSDP forwards are
  collectives; under PP the stages run forward one after the other and the last one's logits
  reach every stage, :class:`~plora.parallel.pp_eval.PipelinedCausalLM`); every rank gets the
  same scores.
- **Losses under PP** are the last stage's: it broadcasts the per-adapter CE sums to the other
  stages every step, so rank 0 (stage 0) reports them and decides on them.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from plora.config import Strategy
from plora.engine.api import EngineSpec, PackRequest
from plora.engine.session import PackSession
from plora.parallel import parallelize
from plora.parallel.dims import ParallelDims
from plora.parallel.trainer import ParallelPackedTrainer


class ParallelPackSession(PackSession):
    """A base model parallelised over the ranks of one job, serving successive packs.

    Needs an initialised default process group of ``dims.world_size`` ranks (NCCL on GPU, gloo
    on CPU); every rank builds one and calls :meth:`run` with the same requests.

    Args:
        spec: the base model, dataset and engine options; loaded here, once.
        dims: the job's degrees.
        shard_base: FSDP shards the frozen base (False keeps it whole on every rank).
        cpu_offload: FSDP keeps the sharded base in host memory (``fsdp_offload``): the base is
            loaded on the host and only FSDP moves it, a unit at a time, so it never has to fit
            the GPU whole.
    """

    def __init__(
        self,
        spec: EngineSpec,
        *,
        dims: ParallelDims,
        shard_base: bool = True,
        cpu_offload: bool = False,
    ) -> None:
        if not dist.is_initialized() or dist.get_world_size() != dims.world_size:
            have = dist.get_world_size() if dist.is_initialized() else 0
            raise RuntimeError(
                f"ParallelPackSession: dims need {dims.world_size} processes, the process "
                f"group has {have}; call torch.distributed.init_process_group first"
            )
        super().__init__(spec, load_device="cpu" if cpu_offload else None)
        t0 = time.perf_counter()
        self.dims = dims
        self.rank = dist.get_rank()
        self._writer = self.rank == 0
        self.mesh = dims.build_mesh(self.device.type)
        self.stage = parallelize(
            self.model, dims=dims, mesh=self.mesh, shard_base=shard_base, cpu_offload=cpu_offload
        )
        self.load_parts["parallelize"] = time.perf_counter() - t0
        self.load_s += self.load_parts["parallelize"]

    @classmethod
    def for_job(
        cls, spec: EngineSpec, d: int, strategy: str | Strategy | None
    ) -> ParallelPackSession:
        """The session of one rank of a plan's ``d``-GPU job with ``strategy`` (``tp``,
        ``fsdp``, ``fsdp_offload`` or ``pp``), as a resident worker group builds it."""
        offload = strategy is not None and Strategy(strategy) is Strategy.FSDP_OFFLOAD
        return cls(spec, dims=ParallelDims.for_job(d, strategy), cpu_offload=offload)

    def _trainer(self, request: PackRequest) -> ParallelPackedTrainer:
        return ParallelPackedTrainer(
            self.model,
            self.tokenizer,
            self.data,
            **self._trainer_kwargs(request),
            adapt_to_memory=False,  # one rank halving its micro-batches alone would desync
            dims=self.dims,
            mesh=self.mesh,
            stage=self.stage,
        )

    @staticmethod
    def _agree(value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a broadcast of one small object)."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


__all__ = ["ParallelPackSession"]
