"""The distributed equivalence cases: configs, the per-rank training run and the spawner.

Each worker process builds the same tiny model, parallelises it for its rank, trains three
adapters with :class:`plora.parallel.trainer.ParallelPackedTrainer` and (rank 0) saves the
per-step losses, gradient norms and gathered weights; every rank takes part in the export.
"""

from __future__ import annotations

import os
import sys
import traceback
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))

from _engine_testlib import TOKENIZER, assert_same_adapter, tiny_model, toy_dataset

from plora.config import LoRAConfig

STEPS = 4

#: Three adapters that differ in rank, targets (column- and row-wise projections), lr, batch
#: size, schedule, clipping and dropout (keyed masks, sliced under row-wise TP).
CONFIGS = [
    LoRAConfig(config_id="a", rank=4, alpha=8, lr=2e-2, batch_size=2, seed=1, max_steps=STEPS,
               target_modules=("q_proj", "v_proj", "o_proj"), warmup_steps=1),
    LoRAConfig(config_id="b", rank=8, alpha=16, lr=1e-2, batch_size=3, seed=2, max_steps=STEPS,
               target_modules="all", schedule="linear", weight_decay=0.01, max_grad_norm=0.05,
               dropout=0.1),
    LoRAConfig(config_id="c", rank=16, alpha=8, lr=5e-3, batch_size=1, seed=3, max_steps=STEPS,
               target_modules=("gate_proj", "up_proj", "down_proj", "k_proj"),
               schedule="cosine", use_rslora=True, max_grad_norm=None),
]  # fmt: skip
#: Joins after step 2 into the slot "b" leaves (refill cases).
JOINER = LoRAConfig(config_id="e", rank=12, alpha=24, lr=1e-2, batch_size=2, seed=9, max_steps=3,
                    target_modules=("q_proj", "up_proj", "down_proj"), dropout=0.05)  # fmt: skip


def train(trainer, *, refill: bool, rebuild=None, keep=None):
    """Add the pack and step until every adapter is done; with ``refill``, "b" stops after
    step 2 and "e" takes its slot; with ``rebuild`` (a function making a fresh trainer), the
    run checkpoints after step 2 (``keep(state)`` sees it) and resumes in a new trainer.

    Returns per-adapter losses and gradient norms per step, the final trainer and, per step,
    the token-balanced splits it made (``ParallelPackedTrainer.last_splits``; none on one
    process).
    """
    for cfg in CONFIGS:
        trainer.add(cfg)
    losses: dict[str, list[float]] = {}
    norms: dict[str, list[float]] = {}
    splits: list[list] = []  # per step: the parallel trainer's token-balanced splits
    while trainer.active:
        if rebuild is not None and trainer.global_step == 2:
            state = trainer.state_dict()
            if keep is not None:
                keep(state)
            trainer = rebuild()
            trainer.load_state_dict(state)
            rebuild = None
        if refill and trainer.global_step == 2:
            trainer.remove("b")
            trainer.release("b")
            trainer.add(JOINER)
        for m in trainer.step():
            losses.setdefault(m.config_id, []).append(m.loss)
            norms.setdefault(m.config_id, []).append(m.grad_norm)
        splits.append(list(getattr(trainer, "last_splits", ())))
    return losses, norms, trainer, splits


#: Base-model shapes a case may train (``tiny_model`` keywords). ``tiny`` (2 layers, 4 heads,
#: 2 KV heads) takes tp <= 2 and pp <= 2; ``wide8`` (8 layers, 8 heads and 8 KV heads of 8
#: dims, 64 MLP features) takes every strategy at d = 8 (``ModelSpec.parallel_problem``).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {},
    "wide8": {"hidden": 64, "intermediate": 64, "layers": 8, "heads": 8, "kv_heads": 8},
}


def base_model(shape: str = "tiny"):
    """The (seeded) base model of ``shape`` (:data:`SHAPES`)."""
    return tiny_model("qwen2", **SHAPES[shape])


#: Left-padded probe rows for the evaluation forward: adapters "a" (rows 0-1) and "c" (row 2).
PROBE_IDS = [[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [0, 3, 4, 5, 6, 7]]
PROBE_ROUTES = (("a", 0, 2), ("c", 2, 3))


def probe_logits(model, slot_of) -> torch.Tensor:
    """Logits of the probe rows (left padding, mask-derived position ids) through ``model``
    as evaluation runs it: eval mode, rows routed with ``packed_segments``."""
    from plora.engine.adapters import packed_segments
    from plora.engine.evaluate import _device, _logits, eval_mode

    ids = torch.tensor(PROBE_IDS)
    mask = (torch.arange(ids.shape[1]) >= (ids == 0).sum(1, keepdim=True)).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, pos = (t.to(_device(model)) for t in (ids, mask, pos))
    segs = [(slot_of(cid), start, stop) for cid, start, stop in PROBE_ROUTES]
    with eval_mode(model), packed_segments(model, segs):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
    return _logits(out).detach().float().cpu()


def trained_ids(refill: bool) -> list[str]:
    """Adapters whose weights a case keeps (a released adapter's are gone)."""
    return ["a", "c", "e"] if refill else [c.config_id for c in CONFIGS]


def assert_layout(layout: dict, shape: tuple, bt_cols: int, fsdp: bool, layers: int) -> None:
    """One rank's split of the base (:func:`_layout`): q_proj's local weight shape and Bt
    columns, whether FSDP sharded the base, and how many layers the rank holds."""
    assert layout["q_local_shape"] == shape
    assert layout["q_bt_cols"] == bt_cols
    assert (layout["base_dtensors"] > 0) == fsdp
    assert layout["layers_here"] == layers


def assert_same_training(got: dict, ref: dict, trained: list[str], *, tol: float = 1e-5) -> None:
    """One rank's run equals the single process's: every step's loss and gradient norm, and
    the final weights of the ``trained`` adapters within ``tol`` (whole-adapter relative error;
    ``tests/dist/_spread.py`` measures it), each of which moved B from its zero init."""
    assert sorted(got["losses"]) == sorted(ref["losses"])
    for cid in ref["losses"]:
        for part in ("losses", "norms"):
            torch.testing.assert_close(
                torch.tensor(got[part][cid]), torch.tensor(ref[part][cid]), rtol=1e-5, atol=1e-6
            )
    assert sorted(got["weights"]) == trained
    for cid in trained:
        assert_same_adapter(got["weights"][cid], ref["weights"][cid], tol=tol)
        assert any(v.abs().max() > 1e-4 for k, v in got["weights"][cid].items() if "lora_B" in k)


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One parallel layout to train."""

    name: str
    shape: str = "tiny"
    """The base model's shape (:data:`SHAPES`)."""
    pp: int = 1
    fsdp: int = 1
    tp: int = 1
    microbatches: int | None = None
    shard_base: bool = True
    refill: bool = False
    resume: bool = False
    """Checkpoint after step 2 and go on in a freshly built model and trainer."""
    checkpointing: bool = False
    """Activation checkpointing (recomputed in backward under each micro-batch's routing)."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of the sharded base (``fsdp_offload``): the model is built on the CPU
    and ``fully_shard`` moves it, as ``ParallelPackSession`` does."""

    @property
    def world_size(self) -> int:
        return self.pp * self.fsdp * self.tp


#: Longest a rank waits to connect or in one collective before it fails (gloo's default is 30
#: minutes: a rank that never connects hung a CI run instead of failing it).
COLLECTIVE_TIMEOUT = timedelta(minutes=3)


def _run_case(rank: int, case: Case, store: str, out: Path, device_type: str) -> None:
    from plora.parallel import ParallelDims, parallelize
    from plora.parallel.trainer import ParallelPackedTrainer

    device: str | torch.device = "cpu"
    if device_type == "cuda":  # one GPU per rank, NCCL; bf16 autocast as in the workers
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    try:
        # a fresh file store per case: no TCP port chosen ahead of time that something else
        # (an earlier case's gloo pairs, another test) may hold by the time the case starts
        dist.init_process_group(
            backend, init_method=f"file://{store}", rank=rank, world_size=case.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )  # fmt: skip
        dims = ParallelDims(pp=case.pp, fsdp=case.fsdp, tp=case.tp, world_size=case.world_size)
        mesh = dims.build_mesh(device_type)

        def build():
            model = base_model(case.shape)
            stage = parallelize(model, dims=dims, mesh=mesh, shard_base=case.shard_base,
                                cpu_offload=case.cpu_offload)  # fmt: skip
            return ParallelPackedTrainer(
                model, TOKENIZER, toy_dataset(), device=device, dims=dims, mesh=mesh, stage=stage,
                microbatches=case.microbatches, gradient_checkpointing=case.checkpointing,
            )  # fmt: skip

        def keep(state):
            if rank == 0:
                torch.save(state, out / f"{case.name}.state.pt")

        losses, norms, trainer, splits = train(
            build(), refill=case.refill, rebuild=build if case.resume else None, keep=keep
        )
        ids = trained_ids(case.refill)
        weights = {cid: trainer.adapter_weights(cid) for cid in ids}
        for cid in ids:
            trainer.export_adapter(cid, out / case.name / cid)
        result = {"losses": losses, "norms": norms, "weights": weights, "layout": _layout(trainer),
                  "splits": splits}  # fmt: skip
        if not case.refill:  # the evaluation forward (under PP: the stages in turn)
            result["probe"] = probe_logits(trainer.eval_model, trainer.slot_of)
        torch.save(result, out / f"{case.name}.rank{rank}.pt")
    except BaseException:
        # fail fast: the other ranks wait in a collective this rank will never join, and
        # destroy_process_group would wait with them (NCCL); exiting lets mp.spawn end them all
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()


def _layout(trainer) -> dict:
    """What this rank holds: proof that the model really was split (checked by the tests)."""
    from torch.distributed.tensor import DTensor

    decoder = trainer.model.model
    held = [b for b in decoder.layers if any(True for _ in b.parameters())]  # PP: this stage's
    q = held[0].self_attn.q_proj
    weight = q.base_layer.weight
    return {
        "q_local_shape": tuple(
            (weight.to_local() if isinstance(weight, DTensor) else weight).shape
        ),
        "q_bt_cols": q.Bt.shape[1],
        "base_dtensors": sum(isinstance(p, DTensor) for p in decoder.parameters()),
        "layers_here": sum(any(True for _ in b.parameters()) for b in decoder.layers),
        "idle_micro_batches": trainer.idle_micro_batches,
        **_held_numel(trainer.model),
        **_offload(trainer.model),
    }


def _param_groups(module) -> list:
    """An FSDP2 module's parameter groups: a list in torch >= 2.13 (``_fsdp_param_groups``),
    one group or none before (``_fsdp_param_group``: torch 2.11, the GPU image's)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _offload(model) -> dict:
    """Where the base lives after training: FSDP units with CPU offload, the elements of the
    frozen base on the accelerator, and whether every offloaded shard is in pinned memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from plora.engine.adapters import packed_layers

    groups = [g for m in model.modules() if isinstance(m, FSDPModule)
              for g in _param_groups(m)]  # fmt: skip
    offloaded = [g for g in groups if isinstance(g.offload_policy, CPUOffloadPolicy)]
    shards = [p.sharded_param.to_local() for g in offloaded for p in g.fsdp_params]
    on_device = sum(t.numel() for t in _frozen_base_local(model) if t.device.type != "cpu")
    return {
        "offloaded_units": len(offloaded),
        "offloaded_on_cpu": all(t.device.type == "cpu" for t in shards),
        "offloaded_pinned": bool(shards) and all(t.is_pinned() for t in shards),
        "base_numel_on_device": on_device,
        "lora_on_device": all(
            layer.A.device.type != "cpu" for layer in packed_layers(model).values()
        ),
    }


def _frozen_base_local(model) -> list[torch.Tensor]:
    """This rank's part of every frozen base parameter (a DTensor's local shard), each once
    (a parameter shared by two modules: once), the packed LoRA factors left out."""
    from torch.distributed.tensor import DTensor

    from plora.engine.adapters import packed_layers

    lora = {id(p) for layer in packed_layers(model).values() for p in (layer.A, layer.Bt)}
    seen: set[int] = set()
    out = []
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) in lora or id(p) in seen:
            continue
        seen.add(id(p))
        out.append(p.to_local() if isinstance(p, DTensor) else p)
    return out


def _held_numel(model) -> dict:
    """Elements this rank holds: of the frozen base (a DTensor's local shard; a parameter
    shared by two modules once) and of the packed LoRA factors (for the memory model)."""
    from plora.engine.adapters import packed_layers

    base = sum(t.numel() for t in _frozen_base_local(model))
    lora_numel = sum(layer.A.numel() + layer.Bt.numel() for layer in packed_layers(model).values())
    return {"base_numel": base, "lora_numel": lora_numel}


def _worker(rank: int, cases: list[Case], stores: list[str], out: str, device_type: str) -> None:
    torch.set_num_threads(1)
    for case, store in zip(cases, stores, strict=True):
        _run_case(rank, case, store, Path(out), device_type)


def spawn(cases: list[Case], out: Path, *, device_type: str = "cpu") -> None:
    """Run ``cases`` (all of one world size) in one set of spawned processes, one after another:
    gloo on the CPU, or NCCL with one GPU per rank (``device_type="cuda"``)."""
    world = {c.world_size for c in cases}
    assert len(world) == 1, world
    stores = [str(out / f"store-{c.name}-{uuid.uuid4().hex[:8]}") for c in cases]
    mp.spawn(_worker, args=(cases, stores, str(out), device_type), nprocs=world.pop(), join=True)
