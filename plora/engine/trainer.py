"""PackedTrainer: one forward and one backward per step over every active adapter.

Each step, adapter ``i`` draws its own batch ``b_i`` (its ``AdapterStream``: batch size, seed and
order as if it trained alone); the rows of all adapters are packed into one batch whose rows
``[start_i, stop_i)`` go through slot ``i`` only (:func:`plora.engine.adapters.packed_segments`).
The loss is::

    L = Σ_i  (1 / N_i) Σ_{t ∈ b_i, label_t ≠ -100}  CE(logits_t, label_t)

with ``N_i`` the number of target tokens of ``b_i`` (labels shifted by one; prompt and padding
are -100). Since slot ``i``'s parameters only touch its own rows, ``∂L/∂θ_i`` is exactly the
gradient of adapter ``i``'s own mean token loss. Each adapter then clips by its own L2 norm and
takes its own AdamW step with its own lr schedule, weight decay and step count -- all adapters in
one :class:`~plora.engine.packed_optim.PackedAdamW` step over the packed parameters
(:mod:`plora.engine.optim` for the schedules).

When the packed rows exceed ``max_rows`` they are split into micro-batches (rows of one adapter
may straddle two); each micro-batch backpropagates its share ``Σ_{t ∈ micro} CE / N_i`` so the
accumulated gradient equals the full batch's. Logits are computed only at target positions, in
chunks, recomputed in backward when large (never ``R × S × V`` at once).

GPU: bf16 autocast, fp32 master LoRA weights, fused kernels via the layer's hook; CPU: fp32.
The host queues a whole step without waiting for the device (the per-adapter losses and
gradient norms stay device tensors) and synchronises once, at the end.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from plora.config import ConfigError, LoRAConfig
from plora.engine import adapters, optim
from plora.engine.batch import (
    PackedBatch,
    pack_micro_batch,
    plan_micro_batches,
    target_count,
    truncate,
)
from plora.engine.causal_lm import decoder_and_head
from plora.engine.device import model_device, peak_memory, to_device
from plora.engine.graphed import LENGTH_BUCKET, StepGraphs, graphs_wanted
from plora.engine.loss import packed_loss
from plora.engine.packed_optim import PackedAdamW
from plora.engine.reports import AdapterStatus, PackProfile, StepMetrics, StepProfile
from plora.engine.step_record import (
    Accumulated,
    StepReadback,
    StepShape,
    TrainingAdapter,
    pack_profile,
    record_step,
)
from plora.engine.train_state import (
    TRAIN_STATE_VERSION,
    adapter_state,
    add_adapter_from_state,
    load_trainer_state,
    trainer_state,
)

_Batches = dict[int, list[Any]]
"""A step's drawn examples, by slot."""


class PackedTrainer:
    """Trains many LoRA adapters at once on one frozen causal LM.

    Args:
        model: a HF causal LM (Llama/Qwen2 family) on ``device``; frozen and injected here.
        tokenizer: its tokenizer (``pad_token_id``, else ``eos_token_id``, pads rows).
        dataset: a ``plora.engine.data.TokenizedDataset`` (``train``: examples with
            ``input_ids`` and aligned ``labels``).
        device: defaults to the model's device.
        dtype: autocast dtype; default bf16 on CUDA, none (fp32) on CPU.
        seq_len: truncate examples to this many tokens (None: as tokenized).
        max_rows: most sequences per forward; more rows are split into micro-batches.
        adapt_to_memory: on CUDA out-of-memory in forward/backward, halve ``max_rows`` and redo
            the step's accumulation with the same batches (exact: gradient accumulation).
        gradient_checkpointing: recompute the frozen base's activations in backward.
        profile_steps: how many first steps :meth:`profile` keeps.
        base_model_name_or_path: written into exported ``adapter_config.json``.
        cuda_graphs: replay the steady step as a CUDA graph (:mod:`plora.engine.graphed`);
            None: on for a CUDA device unless ``PLORA_CUDA_GRAPHS=0``. On the CPU, True runs the
            graph's static-buffer step eagerly (what the tests compare with the eager step).
    """

    pausable = True
    """Whether an adapter may leave with :meth:`adapter_train_state` (:mod:`plora.engine.pause`)."""
    graphable = True
    """Whether the step may replay as a CUDA graph (:mod:`plora.engine.graphed`)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        dataset: Any,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seq_len: int | None = None,
        max_rows: int | None = None,
        adapt_to_memory: bool = True,
        gradient_checkpointing: bool = False,
        profile_steps: int = 10,
        base_model_name_or_path: str | None = None,
        cuda_graphs: bool | None = None,
    ) -> None:
        self.device = torch.device(device) if device is not None else model_device(model)
        self.model = self._to_device(model)
        self.dataset = dataset
        self.train_examples = list(dataset.train)
        if not self.train_examples:
            raise ConfigError("dataset: the training split is empty; give it at least one example")
        self.autocast_dtype = (
            dtype if dtype is not None else (torch.bfloat16 if self.device.type == "cuda" else None)
        )
        if self.autocast_dtype == torch.float32:
            self.autocast_dtype = None
        self.seq_len = seq_len
        if max_rows is not None and max_rows < 1:
            raise ConfigError(f"trainer: max_rows={max_rows} must be >= 1 or None")
        self.max_rows = max_rows
        self.adapt_to_memory = adapt_to_memory
        self.oom_splits = 0
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else (getattr(tokenizer, "eos_token_id", None) or 0)
        self.base_model_name_or_path = base_model_name_or_path or str(
            getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        )
        if not adapters.packed_layers(model):
            adapters.inject(model)
        self.layers = adapters.packed_layers(model)
        model.requires_grad_(False)
        model.train()
        hf: Any = model  # a transformers PreTrainedModel: its methods are not nn.Module's
        if gradient_checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._decoder, self._head = decoder_and_head(model)
        self.adapters: dict[str, TrainingAdapter] = {}
        self.optimizer = PackedAdamW(self.layers)
        self.global_step = 0
        self.profile_steps = profile_steps
        self.graphs = (
            StepGraphs(self) if self.graphable and graphs_wanted(cuda_graphs, self.device) else None
        )
        """The graphed step (:mod:`plora.engine.graphed`); None: every step eager."""
        self._profile: list[StepProfile] = []
        self.last_step: StepProfile | None = None
        """Measurements of the latest step."""

    def _to_device(self, model: nn.Module) -> nn.Module:
        """``model`` on :attr:`device` (a parallel rank keeps its shards where they are)."""
        return model.to(self.device)

    # ------------------------------------------------------------- adapters
    @property
    def active(self) -> list[str]:
        """Config ids still training, in slot order."""
        ads = [a for a in self.adapters.values() if a.status is AdapterStatus.ACTIVE]
        return [a.config.config_id for a in sorted(ads, key=lambda a: a.slot)]

    @property
    def finished(self) -> list[str]:
        """Config ids that reached their steps or were stopped (weights still held)."""
        return [c for c, a in self.adapters.items() if a.status is not AdapterStatus.ACTIVE]

    def adapter(self, config_id: str) -> TrainingAdapter:
        try:
            return self.adapters[config_id]
        except KeyError:
            raise KeyError(f"no adapter {config_id!r} in this pack") from None

    def status(self, config_id: str) -> AdapterStatus:
        return self.adapter(config_id).status

    def slot_of(self, config_id: str) -> int:
        return self.adapter(config_id).slot

    def add(self, config: LoRAConfig, *, slot: int | None = None) -> int:
        """Add ``config`` as a fresh adapter in a free slot (between steps); return the slot."""
        if slot is not None and slot in {a.slot for a in self.adapters.values()}:
            raise ValueError(f"slot {slot} is taken")
        return self.add_many([config], slots=None if slot is None else [slot])[0]

    def add_many(
        self, configs: Sequence[LoRAConfig], *, slots: Sequence[int] | None = None
    ) -> list[int]:
        """Add ``configs`` as fresh adapters, in free slots in order (between steps); every layer
        reallocates once for all of them (:func:`plora.engine.adapters.add_adapters`). Returns
        their slots."""
        from plora.engine.data import AdapterStream

        ids = [c.config_id for c in configs]
        for cid in ids:
            if cid in self.adapters or ids.count(cid) > 1:
                raise ConfigError(f"config {cid}: already in this pack; use a new config_id")
        if slots is None:
            used = {a.slot for a in self.adapters.values()}
            free = (i for i in itertools.count() if i not in used)
            slots = [next(free) for _ in configs]
        self._drop_graphs()
        adapters.add_adapters(self.model, dict(zip(slots, configs, strict=True)))
        for config, slot in zip(configs, slots, strict=True):
            steps = optim.total_steps(config, len(self.train_examples))
            self.optimizer.add_slot(
                slot, weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm
            )
            self.adapters[config.config_id] = TrainingAdapter(
                config=config,
                slot=slot,
                total_steps=steps,
                stream=AdapterStream(len(self.train_examples), config.batch_size, config.seed),
                lr_lambda=optim.lr_lambda(config, steps),
            )
        return list(slots)

    def remove(self, config_id: str) -> None:
        """Stop an active adapter early (its weights stay for export until :meth:`release`)."""
        ad = self.adapter(config_id)
        if ad.status is AdapterStatus.ACTIVE:
            self._retire(ad, AdapterStatus.STOPPED)

    def retire(self, config_id: str, status: AdapterStatus) -> None:
        """End an active adapter's training here as ``status`` (stopped, paused)."""
        ad = self.adapter(config_id)
        if ad.status is AdapterStatus.ACTIVE:
            self._retire(ad, status)

    def release(self, config_id: str) -> None:
        """Forget a finished or stopped adapter and free its slot."""
        ad = self.adapters.pop(config_id)
        self._drop_graphs()
        self.optimizer.remove_slot(ad.slot)
        adapters.remove_adapter(self.model, ad.slot)

    def _retire(self, ad: TrainingAdapter, status: AdapterStatus) -> None:
        """Stop training ``ad``: its rows freeze (no update, no state) until released."""
        ad.status = status
        self.optimizer.remove_slot(ad.slot)
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Adapters change: the pack's graphs (and their memory, which evaluation may need) go;
        the next steps capture the new layout."""
        if self.graphs is not None:
            self.graphs.drop()

    # ----------------------------------------------------------------- step
    def step(self) -> list[StepMetrics]:
        """One packed optimizer step for every active adapter; returns their metrics."""
        active = [self.adapters[c] for c in self.active]
        if not active:
            return []
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        self.optimizer.sync()  # after adapters joined or left: adopt the new packed parameters
        batches = {ad.slot: self._draw(ad) for ad in active}
        denoms = {s: max(1, sum(target_count(ex) for ex in exs)) for s, exs in batches.items()}
        lrs = {ad.slot: ad.config.lr * ad.lr_lambda(ad.step) for ad in active}
        readback = self._graphed_step(active, batches, denoms, lrs)
        if readback is None:
            acc = self._eager_accumulate(batches, denoms, active)
            norms = self.optimizer.step(lrs)
            readback = StepReadback(
                # one device -> host read per step: every slot's grad norm, then the CE sums
                values=torch.cat([norms.double(), *(sums for _, sums in acc.ce_parts)]),
                num_norms=norms.shape[0],
                ce_slots=[slots for slots, _ in acc.ce_parts],
                shape=acc.shape,
            )
        host_s = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        metrics, tokens_total = record_step(
            active,
            batches=batches,
            denoms=denoms,
            lrs=lrs,
            values=readback.values.tolist(),
            num_norms=readback.num_norms,
            ce_slots=readback.ce_slots,
            elapsed=elapsed,
        )
        for ad in active:
            if ad.step >= ad.total_steps:
                self._retire(ad, AdapterStatus.COMPLETED)
        self.global_step += 1
        shape = readback.shape
        self.last_step = StepProfile(
            step=self.global_step,
            time_s=elapsed,
            host_s=host_s,
            adapters=len(active),
            rows=shape.rows,
            seq_len=shape.seq_len,
            tokens=tokens_total,
            padded_tokens=shape.padded_tokens,
            micro_batches=shape.micro_batches,
            peak_memory_bytes=peak_memory(self.device),
        )
        if len(self._profile) < self.profile_steps:
            self._profile.append(self.last_step)
        return metrics

    def _eager_accumulate(
        self, batches: _Batches, denoms: dict[int, int], active: Sequence[TrainingAdapter]
    ) -> Accumulated:
        """:meth:`_accumulate`, on out-of-memory again with half the rows per forward (when
        ``adapt_to_memory``)."""
        while True:
            try:
                return self._accumulate(batches, denoms, active)
            except torch.OutOfMemoryError:
                total = sum(len(b) for b in batches.values())
                current = min(self.max_rows or total, total)
                if not self.adapt_to_memory or current <= 1:
                    raise
            # Out of memory (the exception and its frames are released by now): gradient
            # accumulation on demand -- same batches, half the rows per forward. The result is
            # unchanged since each micro-batch carries its share of every adapter's loss.
            self.optimizer.zero_grad()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.max_rows = max(1, current // 2)
            self.oom_splits += 1

    def _graphed_step(
        self,
        active: Sequence[TrainingAdapter],
        batches: _Batches,
        denoms: dict[int, int],
        lrs: dict[int, float],
    ) -> StepReadback | None:
        """The step through :attr:`graphs` (None: not graphed, nothing done). On CUDA anything
        the graphed step cannot do turns it off for this trainer and the step runs eagerly."""
        if self.graphs is None or self.graphs.disabled is not None:
            return None
        try:
            out = self.graphs.step(active, batches, denoms, lrs)
        except Exception as err:
            if self.device.type != "cuda":
                raise
            first = (str(err).strip().splitlines() or [""])[0][:200]
            self.graphs.disable(f"{type(err).__name__}: {first}")
            self.optimizer.zero_grad()
            return None
        self.optimizer.count_step(lrs)
        return out

    def _accumulate(
        self, batches: _Batches, denoms: dict[int, int], active: Sequence[TrainingAdapter]
    ) -> Accumulated:
        """Forward + backward of the step's rows in micro-batches of ``max_rows``."""
        ce_parts: list[tuple[list[int], torch.Tensor]] = []
        micros = plan_micro_batches(batches, self.max_rows)
        rows = padded = seq_len = 0
        for micro in micros:
            pb, keys = self._pack(micro, active)
            rows += pb.input_ids.shape[0]
            padded += pb.input_ids.numel()
            seq_len = max(seq_len, pb.input_ids.shape[1])
            with adapters.packed_segments(self.model, pb.segments, dropout_keys=keys):
                loss, sums = self._forward_loss(pb, denoms)
                loss.backward()
            del loss
            if sums:
                ce_parts.append((list(sums), torch.stack(list(sums.values()))))
        shape = StepShape(
            rows=rows, padded_tokens=padded, seq_len=seq_len, micro_batches=len(micros)
        )
        return Accumulated(ce_parts=ce_parts, shape=shape)

    def _draw(self, ad: TrainingAdapter) -> list[Any]:
        exs = [self.train_examples[i] for i in ad.stream.next_batch()]
        if self.seq_len is not None:
            exs = [truncate(ex, self.seq_len) for ex in exs]
        return exs

    def _pack_host(
        self, micro: dict[int, tuple[int, list[Any]]], active: Sequence[TrainingAdapter]
    ) -> tuple[PackedBatch, dict[int, tuple[int, int]]]:
        """``micro``'s rows packed on the host, and each slot's dropout key. On CUDA the width
        is rounded up to a length bucket, as the graphed step's: a step of a width not seen
        before runs slow (new shapes for the attention and GEMM kernels), and rows of varied
        lengths would otherwise bring a new width almost every step."""
        step_of = {ad.slot: ad.step for ad in active}
        keys = {s: (step_of[s], micro[s][0]) for s in micro}
        bucket = LENGTH_BUCKET if self.device.type == "cuda" else None
        return pack_micro_batch(micro, self.pad_id, pad_to_multiple_of=bucket), keys

    def _pack(
        self, micro: dict[int, tuple[int, list[Any]]], active: Sequence[TrainingAdapter]
    ) -> tuple[PackedBatch, dict[int, tuple[int, int]]]:
        """:meth:`_pack_host`, its inputs and mask on the device."""
        pb, keys = self._pack_host(micro, active)
        # Inputs go over pinned and non-blocking; the labels stay on the host, where
        # packed_loss finds the target positions without a device sync.
        inputs = to_device(pb.input_ids, self.device)
        mask = to_device(pb.attention_mask, self.device)
        return dataclasses.replace(pb, input_ids=inputs, attention_mask=mask), keys

    def _forward_loss(
        self, pb: PackedBatch, denoms: dict[int, int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        with self.autocast():
            hidden = self._decoder(
                input_ids=pb.input_ids, attention_mask=pb.attention_mask, use_cache=False
            ).last_hidden_state
            return packed_loss(self._head, hidden, pb.labels, pb.segments, denoms)

    def autocast(self, *, cache: bool = True) -> torch.autocast:
        """The step's autocast: :attr:`autocast_dtype`, or none (fp32). ``cache=False`` for a
        step being captured as a CUDA graph (autocast's cast cache may not outlive a capture)."""
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=cache)

    # -------------------------------------------------------------- outputs
    @property
    def eval_model(self) -> nn.Module:
        """The model evaluation runs its forwards on (a pipeline job's stages: see
        :class:`plora.parallel.trainer.ParallelPackedTrainer`)."""
        return self.model

    def profile(self) -> PackProfile:
        """Measurements of the first ``profile_steps`` steps."""
        return pack_profile(
            self.device, self.autocast_dtype, list(self.adapters.values()), self._profile
        )

    def export_adapter(self, config_id: str, path: Any) -> None:
        """Write ``config_id``'s adapter in PEFT format to directory ``path``."""
        from plora.engine.export import export_peft_adapter

        export_peft_adapter(
            path,
            config=self.adapter(config_id).config,
            weights=self.adapter_weights(config_id),
            base_model_name_or_path=self.base_model_name_or_path,
        )

    def adapter_weights(self, config_id: str) -> dict[str, torch.Tensor]:
        """``config_id``'s PEFT-keyed weights: live views of its slot (copy before keeping)."""
        return adapters.adapter_state_dict(self.model, self.adapter(config_id).slot)

    def adapter_train_state(self, config_id: str) -> dict[str, Any]:
        """One adapter's part of :meth:`state_dict` (live tensors; copy before keeping): its
        config, slot, step counters, losses, data-stream position, weights and AdamW moments
        (None once it stopped training). With it the adapter continues exactly in any pack
        (:meth:`add_from_state`): its dropout and data order are keyed by its own seed and step."""
        return adapter_state(self, config_id)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: weights, optimizer, schedule, data, RNG
        (:func:`plora.engine.train_state.trainer_state`)."""
        return trainer_state(self)

    def add_from_state(
        self, st: dict[str, Any], *, slot: int | None = None, version: int = TRAIN_STATE_VERSION
    ) -> int:
        """Add an adapter from its :meth:`adapter_train_state` (between steps) in ``slot`` (None:
        a free one) and return the slot; it continues where it left off."""
        return add_adapter_from_state(self, st, slot=slot, version=version)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into this trainer (which must hold no adapters); see
        :func:`plora.engine.train_state.load_trainer_state`."""
        load_trainer_state(self, state)


__all__ = [
    "AdapterStatus",
    "PackProfile",
    "PackedTrainer",
    "StepMetrics",
    "StepProfile",
    "packed_loss",
]
