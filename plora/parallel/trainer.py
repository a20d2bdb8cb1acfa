"""The packed trainer on one rank of a parallel job (FSDP, TP, PP and their products).

Every rank runs the same :class:`~plora.engine.trainer.PackedTrainer` step: each adapter
draws its own batch (the same on every rank: streams are seeded per config), the loss weights
``1 / N_i`` come from the adapter's *whole* batch, and each adapter takes its own AdamW step.
What differs is which rows a rank runs and which shard of the weights it holds:

- **data parallel** (``fsdp``): the step's rows are cut into ``F · m`` token-balanced bins
  (:mod:`plora.parallel.balance`); FSDP rank ``f`` runs bins ``[f·m, (f+1)·m)`` as its ``m``
  micro-batches. A rank left without rows (fewer rows than bins) runs one pad row with zero
  weight, so every rank issues the same FSDP collectives. Gradients are summed over ranks.
- **tensor parallel** (``tp``): every TP rank runs the same rows on its shards.
- **pipeline parallel** (``pp``): the rows (with FSDP: the rank's token-balanced share) are
  cut into ``M ≥ pp`` token-balanced micro-batches run by 1F1B (:mod:`plora.parallel.pp`;
  fewer rows than ``M``: the empty ones idle); the last stage computes the loss and broadcasts
  the per-adapter CE sums to the other stages, so rank 0 reports the last stage's losses.

``max_rows`` sets the number of bins (``⌈rows / (F · max_rows)⌉`` per rank); a token-balanced
bin may hold a few more rows than ``max_rows`` when its rows are short.

Per-adapter CE sums are summed over data-parallel ranks (and broadcast from the last stage),
so every rank reports the same losses; gradients and norms are combined by
:class:`~plora.parallel.optim.ParallelPackedAdamW`. Hence per-step losses and final weights
equal single-process packed training (tested in ``tests/dist``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plora.engine import adapters
from plora.engine.device import to_device
from plora.engine.loss import packed_loss
from plora.engine.step_record import Accumulated, StepShape
from plora.engine.trainer import PackedTrainer
from plora.parallel.balance import balanced_micro_batches, bin_tokens
from plora.parallel.dims import MESH_DIMS, ParallelDims
from plora.parallel.export import full_adapter_state_dict, gather_keyed, shard_keyed
from plora.parallel.fsdp import to_device_but_offloaded
from plora.parallel.optim import ParallelPackedAdamW
from plora.parallel.pp import MicroBatchRouting, PipelineStageModule, run_1f1b


def pipeline_micro_batches(
    rows: int, *, pp: int, fsdp: int = 1, max_rows: int | None = None
) -> int:
    """The pipeline's micro-batches for a step of ``rows`` rows (``fsdp`` ranks share them):
    ``2·pp`` (1F1B's bubble ``(P-1)/(M+P-1)``, what the cost model books), fewer when a rank
    has fewer rows (at least ``pp``: the empty ones idle), more when ``max_rows`` caps them.

    Each micro-batch pays the stage's host work (the packed layers' launches: about 0.25 s a
    micro-batch for 24 layers of a 14B stage on an H200) and its GEMMs shrink with its rows:
    8 micro-batches of 2 rows ran a 16-adapter pp2 step in 2.11 s, 4 of 4 rows in 1.35 s
    (2 x H200, 2026-11-28, benchmarks/RESULTS.md)."""
    mine = -(-rows // fsdp)
    count = max(pp, min(2 * pp, mine))
    if max_rows:
        count = max(count, -(-mine // max_rows))
    return count


class ParallelPackedTrainer(PackedTrainer):
    """:class:`PackedTrainer` for one rank of a job parallelised by :func:`plora.parallel.parallelize`.

    Args:
        model, tokenizer, dataset: as for :class:`PackedTrainer`; ``model`` already
            parallelised (PP stage kept, TP shards, FSDP units).
        dims: the job's degrees.
        mesh: the job's device mesh (``dims.build_mesh``); ``None`` when ``world_size == 1``.
        stage: this rank's pipeline stage (returned by ``parallelize``) when ``dims.pp > 1``.
        microbatches: micro-batches per data-parallel rank, or pipeline micro-batches for PP
            (default: enough for ``max_rows`` rows each; for PP :func:`pipeline_micro_batches`).
        **kwargs: the other :class:`PackedTrainer` arguments; ``cuda_graphs``
            (``training.cuda_graphs``) is accepted and ignored: a rank's step always runs
            eagerly (:attr:`graphable`).
    """

    pausable = False
    """Its adapter state is sharded over the job's ranks: pausing is for one-device packs."""
    graphable = False
    """Its step has collectives and pipeline schedules around the forward: not captured."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        dataset: Any,
        *,
        dims: ParallelDims,
        mesh: DeviceMesh | None,
        stage: PipelineStageModule | None = None,
        microbatches: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, tokenizer, dataset, **kwargs)
        if dims.pp > 1 and stage is None:
            raise ValueError("ParallelPackedTrainer: pp > 1 needs the stage from parallelize()")
        if microbatches is not None and microbatches < 1:
            raise ValueError(f"ParallelPackedTrainer: microbatches={microbatches} must be >= 1")
        self.dims, self.mesh, self.stage_module = dims, mesh, stage
        self.microbatches = microbatches
        self.idle_micro_batches = 0
        """Micro-batches this rank ran as a zero-weighted pad row (no rows of its own)."""
        self._pipelined: nn.Module | None = None
        self.last_splits: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        """The last step's token-balanced splits, in order (FSDP: the ranks' bins; PP: the
        micro-batches; PP x FSDP: the ranks' shares, then this rank's micro-batches): the
        tokens of each row split (slot order) and of each bin -- the step's load balance."""

        def group(name: str) -> dist.ProcessGroup | None:
            if name not in dims.enabled:
                return None
            assert mesh is not None  # checked by parallelize(): world_size > 1 has a mesh
            return mesh[name].get_group()

        self.dp_group, self.tp_group, self.pp_group = group("fsdp"), group("tp"), group("pp")
        self.coords = {
            n: mesh.get_local_rank(n) if mesh is not None and n in dims.enabled else 0
            for n in MESH_DIMS
        }
        """This rank's ``{"pp", "fsdp", "tp"}`` coordinates in the mesh."""
        self.optimizer = ParallelPackedAdamW(
            self.layers, dp_group=self.dp_group, tp_group=self.tp_group, pp_group=self.pp_group
        )

    def _to_device(self, model: nn.Module) -> nn.Module:
        """Every plain tensor to the rank's device; the DTensors stay where ``parallelize`` put
        them (FSDP2's CPU offload needs its base shards on the host)."""
        return to_device_but_offloaded(model, self.device)

    # ------------------------------------------------------------------ step
    def _accumulate(
        self, batches: dict[int, list[Any]], denoms: dict[int, int], active: Sequence[Any]
    ) -> Accumulated:
        self.last_splits = []
        if self.dims.pp > 1:
            return self._accumulate_pp(batches, denoms, active)
        return self._accumulate_dp(batches, denoms, active)

    def _bins(self, batches, count: int) -> list[dict[int, tuple[int, int]]]:
        lengths = {s: [len(ex.input_ids) for ex in exs] for s, exs in batches.items()}
        bins = balanced_micro_batches(lengths, count)
        rows = tuple(t for s in sorted(lengths) for t in lengths[s])
        self.last_splits.append((rows, tuple(bin_tokens(lengths, part) for part in bins)))
        return bins

    def _per_rank(self, total_rows: int) -> int:
        if self.microbatches is not None:
            return self.microbatches
        if self.max_rows is None:
            return 1
        return max(1, -(-total_rows // (self.dims.fsdp * self.max_rows)))

    def _accumulate_dp(
        self, batches: dict[int, list[Any]], denoms: dict[int, int], active: Sequence[Any]
    ) -> Accumulated:
        """Token-balanced bins of the step's rows; this FSDP rank's ``m`` of them, in turn."""
        slots = sorted(batches)
        m = self._per_rank(sum(len(b) for b in batches.values()))
        f = self.coords["fsdp"]
        mine = self._bins(batches, self.dims.fsdp * m)[f * m : (f + 1) * m]
        ce = torch.zeros(len(slots), dtype=torch.float64, device=self.device)
        rows = padded = seq_len = 0
        for part in mine:
            if not part:
                self._idle_backward(active)
                continue
            micro = {s: (o, batches[s][o : o + c]) for s, (o, c) in part.items()}
            pb, keys = self._pack(micro, active)
            rows += pb.input_ids.shape[0]
            padded += pb.input_ids.numel()
            seq_len = max(seq_len, pb.input_ids.shape[1])
            with adapters.packed_segments(self.model, pb.segments, dropout_keys=keys):
                loss, sums = self._forward_loss(pb, denoms)
                loss.backward()
            for s, v in sums.items():
                ce[slots.index(s)] += v
        if self.dp_group is not None:
            dist.all_reduce(ce, group=self.dp_group)
        shape = StepShape(rows=rows, padded_tokens=padded, seq_len=seq_len, micro_batches=len(mine))
        return Accumulated(ce_parts=[(slots, ce)], shape=shape)

    def _idle_backward(self, active) -> None:
        """A zero-weighted forward + backward of one pad row (FSDP collectives stay in step)."""
        self.idle_micro_batches += 1
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        with adapters.packed_segments(self.model, [(active[0].slot, 0, 1)]):
            hidden = self._decoder(
                input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False
            ).last_hidden_state
            (hidden.sum() * 0.0).backward()

    def _accumulate_pp(
        self, batches: dict[int, list[Any]], denoms: dict[int, int], active: Sequence[Any]
    ) -> Accumulated:
        """This data-parallel rank's share of the step's rows (all of them without FSDP) as
        ``M`` token-balanced, equally padded micro-batches through 1F1B."""
        slots = sorted(batches)
        fsdp = self.dims.fsdp
        total = sum(len(b) for b in batches.values())
        count = self.microbatches or pipeline_micro_batches(
            total, pp=self.dims.pp, fsdp=fsdp, max_rows=self.max_rows
        )
        if count < self.dims.pp:
            raise ValueError(
                f"pipeline: microbatches={count} < pp={self.dims.pp}; 1F1B needs at least one "
                "micro-batch per stage (raise microbatches or leave it unset)"
            )
        share = self._bins(batches, fsdp)[self.coords["fsdp"]]
        start = {s: o for s, (o, _) in share.items()}
        mine = {s: batches[s][o : o + c] for s, (o, c) in share.items()}
        # fewer rows than micro-batches (1F1B needs pp of them): the empty bins idle. The bins
        # are packed on the host: ids go over once, pinned and non-blocking; labels stay there,
        # where the loss finds its targets without a device sync
        packs = [
            self._pack_host(
                {s: (start[s] + o, mine[s][o : o + c]) for s, (o, c) in part.items()}, active
            )
            if part
            else None
            for part in self._bins(mine, count)
        ]
        r_mb = max((pb.input_ids.shape[0] for pb, _ in filter(None, packs)), default=1)
        width = max((pb.input_ids.shape[1] for pb, _ in filter(None, packs)), default=1)
        ids = torch.full((count * r_mb, width), self.pad_id, dtype=torch.long)
        labels = torch.full((count * r_mb, width), -100, dtype=torch.long)
        routing = []
        for k, packed in enumerate(packs):
            if packed is None:
                # idle: one pad row through an active adapter (so the stage's output needs a
                # gradient), no target token: it adds exactly zero to every gradient and loss
                self.idle_micro_batches += 1
                routing.append(
                    MicroBatchRouting(attention_mask=None, segments=((active[0].slot, 0, 1),))
                )
                continue
            pb, keys = packed
            r, w = pb.input_ids.shape
            ids[k * r_mb : k * r_mb + r, :w] = pb.input_ids
            labels[k * r_mb : k * r_mb + r, :w] = pb.labels
            segs = tuple((s.slot, s.start, s.stop) for s in pb.segments if s.stop > s.start)
            # rows are right-padded (pad rows too) and no padding is a target: causal only
            routing.append(MicroBatchRouting(attention_mask=None, segments=segs, dropout_keys=keys))
        sums_seen: list[dict[int, torch.Tensor]] = []

        def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss, sums = packed_loss(
                self._head, hidden, target, routing[len(sums_seen)].segments or (), denoms
            )
            sums_seen.append(sums)
            return loss

        assert self.stage_module is not None and self.pp_group is not None  # pp > 1 here
        with self.autocast():
            run_1f1b(
                self.stage_module,
                pp_group=self.pp_group,
                input_ids=to_device(ids, self.device),
                labels=labels,
                micro=routing,
                loss_fn=loss_fn,
            )
        ce = torch.zeros(len(slots), dtype=torch.float64, device=self.device)
        for sums in sums_seen:
            for s, v in sums.items():
                ce[slots.index(s)] += v
        if self.dp_group is not None:
            dist.all_reduce(ce, group=self.dp_group)
        last = dist.get_global_rank(self.pp_group, self.dims.pp - 1)
        dist.broadcast(ce, src=last, group=self.pp_group)
        shape = StepShape(
            rows=ids.shape[0], padded_tokens=ids.numel(), seq_len=width, micro_batches=len(routing)
        )
        return Accumulated(ce_parts=[(slots, ce)], shape=shape)

    # --------------------------------------------------------------- outputs
    @property
    def eval_model(self) -> nn.Module:
        """What evaluation runs forwards on: under PP this rank's stage as a causal LM
        (:class:`~plora.parallel.pp_eval.PipelinedCausalLM`, a collective per forward)."""
        if self.stage_module is None:
            return self.model
        if self._pipelined is None:
            from plora.parallel.pp_eval import PipelinedCausalLM

            assert self.pp_group is not None  # pp > 1 whenever there is a stage
            self._pipelined = PipelinedCausalLM(
                self.stage_module,
                head=self._head,
                pp_group=self.pp_group,
                vocab_size=int(cast(Any, self.model).config.vocab_size),
            )
        return self._pipelined

    def adapter_weights(self, config_id: str) -> dict[str, torch.Tensor]:
        """``config_id``'s whole PEFT-keyed weights on every rank (collective: call on all)."""
        return full_adapter_state_dict(
            self.model, self.adapter(config_id).slot, pp_group=self.pp_group
        )

    def export_adapter(self, config_id: str, path: Any) -> None:
        """Gather ``config_id``'s adapter and write it in PEFT format from global rank 0
        (collective: every rank calls it)."""
        from plora.engine.checkpoint import export_peft_adapter

        weights = self.adapter_weights(config_id)
        if not dist.is_initialized() or dist.get_rank() == 0:
            export_peft_adapter(
                path,
                config=self.adapter(config_id).config,
                weights=weights,
                base_model_name_or_path=self.base_model_name_or_path,
            )
        if dist.is_initialized():
            dist.barrier()

    def state_dict(self) -> dict[str, Any]:
        """:meth:`PackedTrainer.state_dict` with whole adapters and moments (collective: every
        rank calls it and gets the same state). It is layout-free: it resumes this job, a job
        of other degrees, or a single-process :class:`PackedTrainer`."""
        state = super().state_dict()
        for cid in sorted(state["adapters"]):
            st = state["adapters"][cid]
            st["weights"] = gather_keyed(self.model, st["weights"], pp_group=self.pp_group)
            opt = st["optimizer"]
            if opt is not None:
                for name in ("exp_avg", "exp_avg_sq"):
                    opt[name] = gather_keyed(self.model, opt[name], pp_group=self.pp_group)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a whole state (this class's or a single process's :meth:`state_dict`, version
        2) into this rank's shards and stage."""
        if state.get("version") != 2:
            raise ValueError(
                f"parallel resume reads train-state version 2, got {state.get('version')!r}"
            )
        adapters = {}
        for cid, st in state["adapters"].items():
            st = {**st, "weights": shard_keyed(self.model, st["weights"])}
            if st["optimizer"] is not None:
                opt = st["optimizer"]
                st["optimizer"] = {
                    **opt,
                    "exp_avg": shard_keyed(self.model, opt["exp_avg"]),
                    "exp_avg_sq": shard_keyed(self.model, opt["exp_avg_sq"]),
                }
            adapters[cid] = st
        super().load_state_dict({**state, "adapters": adapters})


__all__ = ["ParallelPackedTrainer"]
