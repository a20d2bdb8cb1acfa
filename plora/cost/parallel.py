"""Communication and pipeline bubble of one packed step, per strategy, as ``plora.parallel`` runs it.

Pure functions of shapes and degrees (no torch, no Ray): bytes each GPU sends per optimizer
step and the pipeline's idle fraction. Ring collectives over ``n`` ranks move
``2(n-1)/n · S`` bytes per GPU for an all-reduce of ``S`` bytes and ``(n-1)/n · S`` for an
all-gather of a whole of ``S`` bytes.

- **TP** (:mod:`plora.parallel.tp`): per decoder layer and token, 2 all-reduces of ``h``
  activations forward (after ``o`` and ``down``) and 2 backward (the attention's and the MLP's
  input gradients)::

      B_tp = 4 · L · h · b_act · 2(T-1)/T   per token

  plus the partial LoRA gradients (``∂A`` of column-wise, ``∂Bt`` of row-wise projections),
  all-reduced once per step: ``2(T-1)/T · 4 · P_rep`` with ``P_rep`` the replicated factors.
- **FSDP** (:mod:`plora.parallel.fsdp`): each of ``m`` micro-batches per rank all-gathers the
  base once forward and once more backward when ``reshard_after_forward``::

      B_fsdp = (2 or 1) · m · W · (F-1)/F   +   2(F-1)/F · 4 · P_lora

  (``W`` the base's bytes, ``P_lora`` the pack's LoRA parameters: replicated adapters, their
  fp32 gradients all-reduced once per step); ``B_fsdp = 2(F-1)/F · 4 · P_lora`` when the base
  is kept whole.
- **FSDP with CPU offload** (``fsdp_offload``): the same collectives, and before each
  all-gather a GPU copies its shard of the layer in from pinned host memory (FSDP2's
  ``CPUOffloadPolicy``; the base is frozen, so nothing goes back)::

      B_host = (2 or 1) · m · W / F     over the host link (PCIe), :data:`HOST_LINK_GBPS`

- **PP** (:mod:`plora.parallel.pp`): 1F1B over ``P`` stages and ``M`` micro-batches idles
  ``(P-1)/(M+P-1)`` of the step; a stage sends each micro-batch's activations forward and
  their gradients back: ``2 · h · b_act`` per token per stage boundary. Micro-batches are
  token-balanced bins of *all* adapters' rows, so a pack raises ``M`` (fills the bubble)
  without lengthening any one adapter's step: the bubble shrinks with the pack.

:func:`parallel_step_time` combines these with a measured or modelled single-GPU compute time
``t_1`` (no overlap of communication and compute: an upper bound that fitted link efficiencies
correct)::

    t = t_1 / d · (M+P-1)/M [PP only]  +  B / (link · e_c)  +  B_host / host_link
"""

from __future__ import annotations

from dataclasses import dataclass

from plora.cost import Strategy

#: Host-to-GPU bandwidth per GPU, GB/s, that a CPU-offloaded job's weight copies run at: about
#: what pinned copies reach on PCIe 4.0 x16 (PCIe 5.0 doubles the link). An assumption until
#: measured: fitted step times of ``fsdp_offload`` jobs do not refit it.
HOST_LINK_GBPS = 25.0


def _check(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")


def ring_allreduce_bytes(size: float, ranks: int) -> float:
    """Bytes one GPU sends in a ring all-reduce of ``size`` bytes over ``ranks`` GPUs."""
    _check("ranks", ranks)
    return 2.0 * (ranks - 1) / ranks * size


def ring_allgather_bytes(size: float, ranks: int) -> float:
    """Bytes one GPU receives gathering a ``size``-byte whole from ``ranks`` equal shards."""
    _check("ranks", ranks)
    return (ranks - 1) / ranks * size


def pp_bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a 1F1B step: ``(P-1)/(M+P-1)``."""
    _check("stages", stages)
    _check("microbatches", microbatches)
    return (stages - 1) / (microbatches + stages - 1)


def tp_bytes(
    *, tokens: float, layers: int, hidden: int, tp: int, replicated_lora_params: float = 0.0,
    act_bytes: int = 2,
) -> float:  # fmt: skip
    """Bytes per GPU per step under TP: 4 activation all-reduces per layer and token, plus
    the partial LoRA gradients (fp32) once."""
    acts = ring_allreduce_bytes(4.0 * layers * hidden * act_bytes, tp) * tokens
    return acts + ring_allreduce_bytes(4.0 * replicated_lora_params, tp)


def fsdp_bytes(
    *, base_bytes: float, lora_params: float, fsdp: int, microbatches: int = 1,
    shard_base: bool = True, reshard_after_forward: bool = True,
) -> float:  # fmt: skip
    """Bytes per GPU per step under FSDP: base all-gathers per micro-batch, adapter all-reduce."""
    _check("microbatches", microbatches)
    grads = ring_allreduce_bytes(4.0 * lora_params, fsdp)
    if not shard_base:
        return grads
    gathers = (2 if reshard_after_forward else 1) * microbatches
    return gathers * ring_allgather_bytes(base_bytes, fsdp) + grads


def host_copy_bytes(
    *, base_bytes: float, fsdp: int, microbatches: int = 1, reshard_after_forward: bool = True
) -> float:
    """Bytes one GPU copies in from host memory per step under ``fsdp_offload``: its shard of
    the base before every all-gather (forward, and backward again when resharded)."""
    _check("fsdp", fsdp)
    _check("microbatches", microbatches)
    return (2 if reshard_after_forward else 1) * microbatches * base_bytes / fsdp


def pp_bytes(*, tokens: float, hidden: int, stages: int, act_bytes: int = 2) -> float:
    """Bytes a middle stage sends per step: activations forward, their gradients backward."""
    _check("stages", stages)
    return 0.0 if stages == 1 else 2.0 * tokens * hidden * act_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelStepCost:
    """One step of a ``d``-GPU job, split into its parts (seconds)."""

    compute_s: float
    """``t_1 / d``: the single-GPU compute divided over the GPUs."""
    bubble_s: float
    """Pipeline idle time (0 unless PP)."""
    comm_s: float
    """Communication, not overlapped."""
    host_copy_s: float = 0.0
    """Copies of the base's shards from host memory (``fsdp_offload``), not overlapped."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s + self.host_copy_s


def parallel_step_time(
    *,
    strategy: Strategy | str,
    d: int,
    single_gpu_s: float,
    tokens: float,
    layers: int,
    hidden: int,
    base_bytes: float,
    lora_params: float,
    link_bytes_per_s: float,
    microbatches: int = 1,
    shard_base: bool = True,
    comm_efficiency: float = 0.7,
    act_bytes: int = 2,
) -> ParallelStepCost:
    """Step time of a pack on ``d`` GPUs with one strategy (see the module docstring).

    Args:
        strategy: ``tp``, ``fsdp``, ``fsdp_offload`` or ``pp``.
        d: GPUs (the strategy's degree).
        single_gpu_s: the pack's compute time per step on one GPU (``t_1``).
        tokens: tokens per step (all adapters' rows, padded).
        layers, hidden: decoder layers ``L`` and hidden size ``h``.
        base_bytes: the frozen base's weight bytes ``W``.
        lora_params: the pack's LoRA parameters (all adapters).
        link_bytes_per_s: GPU-to-GPU bandwidth per direction.
        microbatches: per FSDP rank, or the pipeline's ``M``.
        shard_base: FSDP shards the base (else only the adapters' gradients move).
        comm_efficiency: achieved fraction of the link bandwidth.
    """
    _check("d", d)
    if not (single_gpu_s >= 0 and link_bytes_per_s > 0 and 0 < comm_efficiency <= 1):
        raise ValueError(
            f"parallel_step_time: single_gpu_s={single_gpu_s}, link={link_bytes_per_s}, "
            f"comm_efficiency={comm_efficiency}: need >= 0, > 0 and in (0, 1]"
        )
    strat = Strategy(strategy)
    compute, bubble, host = single_gpu_s / d, 0.0, 0.0
    if strat is Strategy.FSDP_OFFLOAD and shard_base:
        copied = host_copy_bytes(base_bytes=base_bytes, fsdp=d, microbatches=microbatches)
        host = copied / (HOST_LINK_GBPS * 1e9)
    if strat is Strategy.TP:
        # column-wise A and row-wise B are replicated: about half of each adapter's factors
        sent = tp_bytes(tokens=tokens, layers=layers, hidden=hidden, tp=d,
                        replicated_lora_params=lora_params / 2, act_bytes=act_bytes)  # fmt: skip
    elif strat in (Strategy.FSDP, Strategy.FSDP_OFFLOAD):
        sent = fsdp_bytes(base_bytes=base_bytes, lora_params=lora_params, fsdp=d,
                          microbatches=microbatches, shard_base=shard_base)  # fmt: skip
    else:
        f = pp_bubble_fraction(d, microbatches)
        bubble = compute * f / (1.0 - f)
        # each stage's adapter gradients stay on it: only the slot norms (a few floats) move
        sent = pp_bytes(tokens=tokens, hidden=hidden, stages=d, act_bytes=act_bytes)
    comm = sent / (link_bytes_per_s * comm_efficiency) if d > 1 else 0.0
    return ParallelStepCost(compute_s=compute, bubble_s=bubble, comm_s=comm, host_copy_s=host)


__all__ = [
    "HOST_LINK_GBPS",
    "ParallelStepCost",
    "fsdp_bytes",
    "host_copy_bytes",
    "parallel_step_time",
    "pp_bubble_fraction",
    "pp_bytes",
    "ring_allgather_bytes",
    "ring_allreduce_bytes",
    "tp_bytes",
]
