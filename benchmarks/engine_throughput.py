"""Training throughput of the packed engine vs PEFT, as a fraction of the FLOP ceiling.

For each base shape (random bf16 weights from ``plora/models/configs/*.json``; Qwen2.5-3B and
-7B by default) at sequence length 1,024, measures tokens/s of full training steps (forward,
backward, per-adapter AdamW):

* ``peft``: one PEFT adapter (``get_peft_model``), batch 1, the model's own loss -- what a
  user writes today;
* ``packed-K``: :class:`plora.engine.PackedTrainer` with K adapters of batch 1 each
  (K in 1, 8, 16, 32), one forward/backward per step (torch path, or the fused kernels when
  ``plora.kernels`` runs on this GPU: see the ``kernels`` column), the eager step
  (``cuda_graphs=False``);
* ``packed-K+graphs``: the same pack on a fresh trainer with ``cuda_graphs=True``: the steady
  step replayed as CUDA graphs (``training.cuda_graphs``; on the CPU the graph's static-buffer
  step, run eagerly). A shape's first steps run eagerly and capture, so these rows warm up at
  least 3 steps. ``--graphs both`` (default) measures each pack eager, then graphed, on the same
  base; ``off`` / ``on``: one of the two;

first with the stock HF base, then with Liger-Kernel's fused RMSNorm/SwiGLU/RoPE applied to the
frozen base (when ``liger_kernel`` is importable) by the engine's own
:func:`plora.engine.liger.apply_fused_kernels` -- what ``plora sweep`` runs with
``training.fused_kernels`` on (``--liger on``: that pass alone; ``off``: the stock pass alone). The FLOP ceiling is
``peak / (4·matmul params + 6·s·h·L)`` tokens/s with ``peak`` measured by a large bf16
matmul on this device. Peak memory (``torch.cuda.max_memory_allocated``) is compared with the
cost model's prediction (``plora.cost.memory``, the allocator's share: without the fixed
reserve) and the relative error printed.

QLoRA (``--quantization nf4``): the decoder's projections of the random base are stored in NF4
(torchao, :mod:`plora.models.quantize`) and dequantized per layer into bf16; ``peft`` is PEFT on
that same NF4 base; the prediction uses the cost model's QLoRA precision (~0.52 B per projection
weight, one dense projection buffer). Default shapes then: Qwen2.5-7B and -14B.

GPU:   PYTHONPATH=$PWD python benchmarks/engine_throughput.py --out $OUT
       PYTHONPATH=$PWD python benchmarks/engine_throughput.py --quantization nf4 --out $OUT
CPU:   python benchmarks/engine_throughput.py --smoke [--quantization nf4]  (tiny shape, < 1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from plora.config import LoRAConfig
from plora.config.fused import liger_installed
from plora.cost import memory as mem
from plora.engine import lora
from plora.engine.adapters import uninject
from plora.engine.data import Example, TokenizedDataset
from plora.engine.liger import apply_fused_kernels
from plora.engine.trainer import PackedTrainer
from plora.model_spec import ModelSpec, shipped_config_path
from plora.utils import atomic_write_json

DEFAULT_MODELS = ("Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-7B")
QLORA_MODELS = ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-14B")
SMOKE_CONFIG = dict(
    model_type="qwen2",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)


def model_config(name: str):
    """The HF config of a shipped shape (``plora/models/configs``), or of ``smoke``'s tiny one."""
    if name == "smoke":
        from transformers import Qwen2Config

        return Qwen2Config(**{k: v for k, v in SMOKE_CONFIG.items() if k != "model_type"})
    return AutoConfig.from_pretrained(str(shipped_config_path(name)))


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul (8192³ bf16 on GPU; 512³ fp32 on CPU)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 20 if device.type == "cuda" else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_base(hf_config, device, dtype, quantization: str = "none") -> torch.nn.Module:
    """Random-weight causal LM of ``hf_config``'s shape, frozen, on ``device``; with
    ``quantization="nf4"`` its projections are then stored in NF4 there (one at a time)."""
    cfg = copy.deepcopy(hf_config)
    cfg.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.requires_grad_(False)
    if quantization != "none":
        from plora.models.quantize import quantize_model

        quantize_model(model, quantization, device=device)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return model


def synthetic_data(vocab: int, seq: int, n: int) -> TokenizedDataset:
    """``n`` random sequences of ``seq`` tokens, every token a target."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, vocab, (n, seq), generator=g).tolist()
    train = [Example(input_ids=r, labels=r, prompt="", answer=None, label=None) for r in rows]
    return TokenizedDataset(train=train, eval=[], metric="none", labels=None)


def adapter_configs(k: int, rank: int) -> list[LoRAConfig]:
    """``k`` batch-1 adapters of rank ``rank`` on every projection (the benchmark's packs)."""
    return [
        LoRAConfig(config_id=f"a{i}", rank=rank, alpha=2 * rank, lr=1e-4, batch_size=1,
                   target_modules="all", max_steps=10_000, seed=i)
        for i in range(k)
    ]  # fmt: skip


def predicted_bytes(
    spec: ModelSpec, configs, seq: int, *, liger: bool, ckpt: bool, quantization: str = "none"
) -> float:
    """Cost-model peak per GPU, minus the fixed reserve the allocator does not see."""
    precision = mem.quantized(mem.PEFT_AMP, quantization)
    opts = mem.MemoryOptions(loss=mem.Loss.FUSED, fused_kernels=liger, checkpointing=ckpt,
                             precision=precision)  # fmt: skip
    total = mem.base_memory(spec, options=opts).total - opts.reserved_bytes
    for c in configs:
        total += mem.adapter_memory(
            spec, rank=c.rank, targets=c.target_modules, batch_size=c.batch_size,
            seq_len=seq, dropout=c.dropout, options=opts,
        ).total  # fmt: skip
    return total


#: Warm-up steps of a graphed row at least: a new shape's first step runs eagerly and the next
#: captures, so the third is the first replay.
GRAPH_WARMUP = 3
#: ``--graphs``: which steps each pack is measured with (``cuda_graphs`` of the trainer).
GRAPH_MODES: dict[str, tuple[bool, ...]] = {"off": (False,), "on": (True,), "both": (False, True)}


def graph_label(label: str, graphs: bool) -> str:
    """A row's case with ``+graphs`` when its step replays CUDA graphs."""
    return f"{label}+graphs" if graphs else label


def graph_warmup(warmup: int, graphs: bool) -> int:
    """Warm-up steps of a row: at least :data:`GRAPH_WARMUP` when graphed."""
    return max(warmup, GRAPH_WARMUP) if graphs else warmup


def time_steps(step, device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def run_peft(base, data, seq, rank, device, dtype, warmup, steps) -> dict:
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(
        base,
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj",
                   "o_proj", "gate_proj", "up_proj", "down_proj"]),
    )  # fmt: skip
    for p in pm.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.tensor([data.train[0].input_ids], device=device)
    auto = (
        torch.autocast(device.type, dtype=dtype)
        if device.type == "cuda"
        else (contextlib.nullcontext())
    )
    pm.train()

    def step():
        with auto:
            loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dt = time_steps(step, device, warmup, steps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    pm.unload()  # back to the plain base (LoRA layers removed)

    return {"step_s": dt, "tokens": seq, "peak_bytes": peak}


def packed_trainer(
    base,
    tok,
    data,
    k: int,
    rank: int,
    device,
    dtype,
    *,
    ckpt: bool = False,
    graphs: bool = False,
    profile_steps: int = 10,
) -> PackedTrainer:
    """A fresh trainer on ``base`` with ``k`` batch-1 adapters of rank ``rank`` (undo it with
    :func:`drop_trainer`); ``graphs``: its ``cuda_graphs``."""
    trainer = PackedTrainer(base, tok, data, device=device,
                            dtype=dtype if device.type == "cuda" else None,
                            gradient_checkpointing=ckpt, cuda_graphs=graphs,
                            profile_steps=profile_steps)  # fmt: skip
    for c in adapter_configs(k, rank):
        trainer.add(c)
    return trainer


def drop_trainer(trainer: PackedTrainer, base, *, ckpt: bool = False) -> None:
    """Give ``base`` back as it was before :func:`packed_trainer` (no slots, no wrappers)."""
    for cid in list(trainer.adapters):
        trainer.remove(cid)
        trainer.release(cid)
    if ckpt:
        base.gradient_checkpointing_disable()
    uninject(base)


def host_ms(trainer: PackedTrainer, first: int) -> float | None:
    """Mean milliseconds until the host had queued a step, over the profiled steps from
    ``first`` on (``StepProfile.host_s``; None when not measured)."""
    hosts = [s.host_s for s in trainer.profile().steps[first:] if s.host_s is not None]
    return 1e3 * sum(hosts) / len(hosts) if hosts else None


def graph_stats(trainer: PackedTrainer) -> dict | None:
    """How the trainer's graphed step ran (None: it had none): captures, replays, steps run
    eagerly through the static buffers, and why graphs were turned off (None: they stayed on)."""
    graphs = trainer.graphs
    if graphs is None:
        return None
    names = ("captures", "replays", "eager_steps", "disabled")
    return {n: getattr(graphs, n) for n in names}


def run_packed(base, tok, data, k, rank, seq, device, dtype, warmup, steps, ckpt,
               graphs: bool = False) -> dict:  # fmt: skip
    trainer = packed_trainer(base, tok, data, k, rank, device, dtype, ckpt=ckpt, graphs=graphs,
                             profile_steps=warmup + steps)  # fmt: skip
    try:
        dt = time_steps(trainer.step, device, warmup, steps)
    finally:  # also after an OOM: the next row starts from the plain base
        drop_trainer(trainer, base, ckpt=ckpt)
    peak = max(s.peak_memory_bytes for s in trainer.profile().steps) if device.type == "cuda" else 0
    host = host_ms(trainer, warmup)
    return {
        "step_s": dt,
        "host_ms": host,
        "graph_stats": graph_stats(trainer),
        "tokens": k * seq,
        "peak_bytes": peak,
        "configs": adapter_configs(k, rank),
        "oom_splits": trainer.oom_splits,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models",
        nargs="*",
        default=None,
        help=f"default {' '.join(DEFAULT_MODELS)}; with nf4 {' '.join(QLORA_MODELS)}",
    )
    ap.add_argument("--quantization", choices=["none", "nf4"], default="none",
                    help="nf4: QLoRA, the base's projections stored in NF4 (torchao)")  # fmt: skip
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--packs", type=int, nargs="*", default=[1, 8, 16, 32])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--liger", choices=["auto", "on", "off"], default="auto",
                    help="auto: stock pass, then the Liger pass when installed; on: the Liger "
                    "pass only (the runtime's path with training.fused_kernels: on); off: stock")  # fmt: skip
    ap.add_argument("--graphs", choices=sorted(GRAPH_MODES), default="both",
                    help="packed rows with the eager step (off), replayed CUDA graphs (on: "
                    "training.cuda_graphs), or each pack both ways, eager first (both)")  # fmt: skip
    ap.add_argument("--kernels", choices=["auto", "torch"], default="auto")
    ap.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto",
                    help="auto: on when the cost model predicts > 90%% of GPU memory")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (< 1 minute)")
    ap.add_argument("--out", type=Path, default=None, help="directory for results JSON")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.models is None:
        args.models = list(QLORA_MODELS if args.quantization == "nf4" else DEFAULT_MODELS)
    if args.smoke:
        args.models, args.seq, args.packs = ["smoke"], 32, [1, 4]
        args.warmup, args.steps = 1, 2
        torch.set_num_threads(1)  # toy matmuls: threads only add overhead
    lora.set_kernel_backend(args.kernels)
    peak = measure_peak_flops(device, dtype)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    print(f"device {gpu}: measured peak {peak / 1e12:.3f} TFLOP/s ({dtype})", flush=True)
    rows = []
    for name in args.models:
        cfg = model_config(name)
        spec = ModelSpec.from_hf_config(cfg)
        ceiling = spec.flop_ceiling_tokens_per_s(peak, args.seq)
        data = synthetic_data(spec.vocab_size, args.seq, n=max(args.packs) * 2)
        tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0})()
        base = build_base(cfg, device, dtype, args.quantization)
        passes = [True] if args.liger == "on" else [False]
        if args.liger == "auto" and device.type == "cuda":
            if liger_installed():
                passes.append(True)
            else:
                print("liger_kernel not installed: skipping the Liger pass", flush=True)
        for liger in passes:
            if liger:  # the engine's switch, as PackSession applies it (on: errors if it can't)
                apply_fused_kernels(base, "on", device=device)
            cases = [("peft", 1, False)] + [
                (graph_label(f"packed-{k}", g), k, g) for k in args.packs
                for g in GRAPH_MODES[args.graphs]
            ]  # fmt: skip
            for label, k, graphs in cases:
                warmup = graph_warmup(args.warmup, graphs)
                cfgs = adapter_configs(k, args.rank)
                pred = predicted_bytes(spec, cfgs, args.seq, liger=liger, ckpt=False,
                                       quantization=args.quantization)  # fmt: skip
                ckpt = args.checkpointing == "on" or (
                    args.checkpointing == "auto" and capacity and pred > 0.9 * capacity
                )
                if ckpt:
                    pred = predicted_bytes(spec, cfgs, args.seq, liger=liger, ckpt=True,
                                           quantization=args.quantization)  # fmt: skip
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                try:
                    if label == "peft":
                        res = run_peft(base, data, args.seq, args.rank, device, dtype,
                                       warmup, args.steps)  # fmt: skip
                    else:
                        res = run_packed(base, tok, data, k, args.rank, args.seq, device, dtype,
                                         warmup, args.steps, ckpt, graphs)  # fmt: skip
                except torch.OutOfMemoryError:
                    print(f"{name:>18} {label:>16} liger={liger!s:5} OOM", flush=True)
                    rows.append({"model": name, "case": label, "liger": liger, "oom": True,
                                 "graphs": graphs, "quantization": args.quantization})  # fmt: skip
                    continue
                tps = res["tokens"] / res["step_s"]
                # on CPU there is no allocator peak to compare (the trainer reports RSS)
                cuda = device.type == "cuda"
                err = (res["peak_bytes"] - pred) / pred if cuda else float("nan")
                row = {
                    "model": name, "case": label, "adapters": k, "liger": liger,
                    "graphs": graphs, "warmup": warmup, "quantization": args.quantization,
                    "checkpointing": bool(ckpt), "kernels": args.kernels,
                    "tokens_per_s": tps, "ceiling_fraction": tps / ceiling,
                    "step_s": res["step_s"], "host_ms": res.get("host_ms"),
                    "graph_stats": res.get("graph_stats"),
                    "peak_gib": res["peak_bytes"] / 2**30,
                    "predicted_gib": pred / 2**30, "memory_error": err,
                    "oom_splits": res.get("oom_splits", 0),  # > 0: the peak is the OOM's
                }  # fmt: skip
                rows.append(row)
                mem_txt = (
                    f"peak {row['peak_gib']:7.2f} GiB  predicted {row['predicted_gib']:7.2f} GiB "
                    f"(error {err:+.1%})"
                    if cuda
                    else "memory n/a on CPU"
                )
                host = "n/a" if row["host_ms"] is None else f"{row['host_ms']:.1f}"
                print(
                    f"{name:>18} {label:>16} {args.quantization:>4} liger={liger!s:5} "
                    f"ckpt={bool(ckpt)!s:5} "
                    f"{tps:>10.0f} tok/s  {tps / ceiling:6.3f} of ceiling  "
                    f"step {res['step_s'] * 1e3:.1f} ms (host {host} ms)  {mem_txt}",
                    flush=True,
                )
        del base
        gc.collect()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        out = {"device": gpu, "peak_flops": peak, "seq": args.seq, "rank": args.rank,
               "quantization": args.quantization, "graphs": args.graphs, "rows": rows}  # fmt: skip
        suffix = "" if args.quantization == "none" else f"_{args.quantization}"
        atomic_write_json(args.out / f"engine_throughput{suffix}.json", out)


if __name__ == "__main__":
    main()
