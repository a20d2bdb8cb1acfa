"""The packing win at small batches: one adapter's step against packed steps, measured and booked.

For each base shape (random bf16 weights, Qwen2.5-7B then -3B by default), each row length
(``gsm8k``: lognormal around 250 tokens, cut at 1,024, like GSM8K's prompts and answers under
Qwen's tokenizer; ``1024``: every row 1,024 tokens) and each batch size b (1, 4, 16, 32),
measures steady training steps of

* ``peft``: one PEFT adapter (``get_peft_model``, all seven projections) on the stock HF base,
  batch b right-padded to its longest row, bf16 autocast, AdamW: what a Ray Tune trial runs;
* ``plora-K``: :class:`plora.engine.PackedTrainer` with K adapters of batch b each (K in 1, 4,
  16, 32) with Liger-Kernel's fused ops on the base when installed (what ``plora sweep`` runs on
  a GPU), eager and with the step replayed as CUDA graphs (``training.cuda_graphs``).

and books each of them with the cost model's prior for this GPU type
(:func:`plora.cost.priors.step_prior`; PEFT with :attr:`~plora.cost.throughput.LoRALayout.PER_ADAPTER`
and the stock-HF coefficients): the booked step of every timed step at its own padded width,
averaged, against the measured mean. A cell whose padded tokens per step would pass
``--max-step-tokens`` or whose predicted memory passes 90 % of the GPU is not run (its row
says why). A plora cell times only steps of a padded width it has run before (on CUDA widths
are 64-token buckets: a bucket's first step meets new kernel shapes, and a graphed cell's
first step of a bucket runs eagerly and its second captures), as a long sweep amortizes them;
PEFT's rows pad to their exact longest, as users' collators do, so nearly every PEFT step of
GSM8K-like rows has a width of its own.

Rows are written to ``step_table.json`` after every cell, so a deadline (``--deadline-s``)
loses nothing measured. ``plora.cost.priors`` fits its per-GPU-type coefficients from the
committed JSON of this benchmark.

GPU:  PYTHONPATH=$PWD python benchmarks/step_table.py --out $OUT
CPU:  python benchmarks/step_table.py --smoke --out /tmp/st   (tiny shape, < 1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_throughput import (
    build_base,
    drop_trainer,
    measure_peak_flops,
    model_config,
    predicted_bytes,
    sync,
)

from plora.config import PROJECTIONS, LoRAConfig
from plora.config.fused import liger_installed
from plora.config.hardware import GPU_TYPES
from plora.cost.priors import DEFAULT_COEFFICIENTS, step_prior
from plora.cost.throughput import AdapterLoad, LoRALayout, StepTimeModel
from plora.engine.data import Example, TokenizedDataset
from plora.engine.example import IGNORE_INDEX
from plora.engine.liger import apply_fused_kernels
from plora.engine.trainer import PackedTrainer
from plora.model_spec import ModelSpec
from plora.utils import atomic_write_json

DEFAULT_MODELS = ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-3B")
LENGTHS = ("gsm8k", "1024")
#: GSM8K-like rows: lognormal with this median (tokens) and sigma, cut at 1,024.
GSM8K_MEDIAN, GSM8K_SIGMA, GSM8K_CAP = 250.0, 0.5, 1024
GRAPH_BUCKET = 64


def row_lengths(kind: str, n: int, cap: int, seed: int = 0) -> list[int]:
    """``n`` row lengths of ``kind`` (``gsm8k`` or a fixed count of tokens), each <= ``cap``."""
    if kind != "gsm8k":
        return [min(int(kind), cap)] * n
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(math.log(GSM8K_MEDIAN), GSM8K_SIGMA, n)
    return [int(v) for v in np.clip(np.rint(draws), 16, min(cap, GSM8K_CAP))]


def dataset(vocab: int, lengths: list[int]) -> TokenizedDataset:
    """Random rows of the given lengths, every token a target."""
    g = torch.Generator().manual_seed(0)
    train = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        train.append(Example(input_ids=ids, labels=ids, prompt="", answer=None, label=None))
    return TokenizedDataset(train=train, eval=[], metric="none", labels=None)


def configs(k: int, batch: int, rank: int) -> list[LoRAConfig]:
    """``k`` adapters of batch ``batch`` and rank ``rank`` on all seven projections."""
    return [
        LoRAConfig(config_id=f"a{i}", rank=rank, alpha=2 * rank, lr=1e-4, batch_size=batch,
                   target_modules="all", max_steps=100_000, seed=i)
        for i in range(k)
    ]  # fmt: skip


def expected_width(lengths: list[int], rows: int) -> float:
    """Expected longest of ``rows`` rows drawn from ``lengths`` (the padded width of a step)."""
    values, counts = np.unique(np.asarray(lengths), return_counts=True)
    cdf = np.cumsum(counts) / counts.sum()
    below = np.concatenate([[0.0], cdf[:-1]])
    return float(np.sum(values * (cdf**rows - below**rows)))


@dataclass
class Timed:
    """The timed steps of one cell: seconds, padded width, real tokens, padded tokens."""

    times: list[float]
    widths: list[int]
    tokens: list[int]
    padded: list[int]
    skipped: int = 0
    """Steps left out of the timing (graphed: the eager first step and the capture of a new
    length bucket)."""
    peak_bytes: int = 0


def run_plora(base, tok, data, k, batch, rank, device, dtype, *, graphs: bool, warmup: int,
              min_steps: int, max_steps: int, min_s: float, cap_s: float = 20.0) -> Timed:  # fmt: skip
    """Train ``k`` adapters of batch ``batch`` and time steady steps (see the module doc)."""
    trainer = PackedTrainer(base, tok, data, device=device,
                            dtype=dtype if device.type == "cuda" else None,
                            cuda_graphs=graphs, profile_steps=1)  # fmt: skip
    for c in configs(k, batch, rank):
        trainer.add(c)
    out = Timed([], [], [], [])
    graphs = graphs and device.type == "cuda"  # on the CPU every graphed step runs eagerly
    try:
        for _ in range(warmup):
            trainer.step()
        total, n, seen = 0.0, 0, set()
        while (
            n < max_steps
            and total < cap_s
            and (len(out.times) < min_steps or sum(out.times) < min_s)
        ):
            before = trainer.graphs.captures + trainer.graphs.eager_steps if graphs else 0
            trainer.step()
            n += 1
            s = trainer.last_step
            total += s.time_s
            fresh = s.seq_len not in seen  # a width's first step: new shapes (and its capture)
            seen.add(s.seq_len)
            if fresh or (graphs and trainer.graphs.captures + trainer.graphs.eager_steps != before):
                out.skipped += 1
                continue
            out.times.append(s.time_s)
            out.widths.append(s.seq_len)
            out.tokens.append(s.tokens)
            out.padded.append(s.padded_tokens)
            out.peak_bytes = max(out.peak_bytes, s.peak_memory_bytes)
        if graphs and trainer.graphs.disabled:
            raise RuntimeError(f"graphs turned off: {trainer.graphs.disabled}")
        if not out.times:
            raise RuntimeError(f"no step replayed in {n} steps")
    finally:
        drop_trainer(trainer, base)
    return out


def run_peft(base, data, batch, rank, device, dtype, *, warmup: int, min_steps: int,
             max_steps: int, min_s: float) -> Timed:  # fmt: skip
    """One PEFT adapter, batches of ``batch`` rows padded to their longest, AdamW."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                         target_modules=list(PROJECTIONS)))  # fmt: skip
    for p in pm.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
    auto = (
        torch.autocast("cuda", dtype=dtype) if device.type == "cuda" else contextlib.nullcontext()
    )
    pm.train()
    rows = data.train
    cursor = 0

    def step() -> tuple[float, int, int, int]:
        nonlocal cursor
        exs = [rows[(cursor + i) % len(rows)] for i in range(batch)]
        cursor += batch
        width = max(len(e.input_ids) for e in exs)
        ids = torch.zeros((batch, width), dtype=torch.long)
        labels = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, e in enumerate(exs):
            n = len(e.input_ids)
            ids[i, :n] = torch.tensor(e.input_ids)
            labels[i, :n] = torch.tensor(e.labels)
            mask[i, :n] = 1
        sync(device)
        t0 = time.perf_counter()
        ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
        with auto:
            loss = pm(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the trainer reads its loss back every step too
        sync(device)
        tokens = sum(len(e.input_ids) for e in exs)
        return time.perf_counter() - t0, width, tokens, batch * width

    out = Timed([], [], [], [])
    try:
        for _ in range(warmup):
            step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        while len(out.times) < max_steps and (len(out.times) < min_steps or sum(out.times) < min_s):
            dt, width, tokens, padded = step()
            out.times.append(dt)
            out.widths.append(width)
            out.tokens.append(tokens)
            out.padded.append(padded)
        if device.type == "cuda":
            out.peak_bytes = torch.cuda.max_memory_allocated(device)
    finally:
        pm.unload()
    return out


def booked(timer: StepTimeModel, k: int, batch: int, rank: int, widths: list[int]) -> float:
    """The cost model's step, averaged over the timed steps' own padded widths."""
    load = AdapterLoad(rank=rank, targets=tuple(PROJECTIONS), sequences=batch)
    return float(np.mean([timer.step_time((load,) * k, w) for w in widths]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS))
    ap.add_argument("--lengths", nargs="*", default=list(LENGTHS),
                    help="gsm8k (lognormal, median 250, cut at 1,024) and/or a fixed row length")  # fmt: skip
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 32])
    ap.add_argument("--packs", type=int, nargs="*", default=[1, 4, 16, 32])
    ap.add_argument("--graphs", choices=["off", "on", "both"], default="both")
    ap.add_argument("--no-peft", action="store_true")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-step-tokens", type=int, default=32_768,
                    help="cells whose expected padded tokens per step pass this are not run")  # fmt: skip
    ap.add_argument("--min-time-s", type=float, default=1.0, help="timed seconds per cell at least")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no cell after this many seconds (the JSON has what ran)")  # fmt: skip
    ap.add_argument("--gpu-type", default="H200", help="the cost-model GPU type to book with")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cap = 1024
    if args.smoke:
        args.models, args.batches, args.packs = ["smoke"], [1, 4], [1, 4]
        args.lengths, args.min_time_s, cap = ["gsm8k", "64"], 0.0, 64
        torch.set_num_threads(1)
    peak = measure_peak_flops(device, dtype)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    liger = device.type == "cuda" and liger_installed()
    gpu_spec = GPU_TYPES[args.gpu_type]
    print(f"device {gpu}: measured peak {peak / 1e12:.1f} TFLOP/s; plora with Liger: {liger}",
          flush=True)  # fmt: skip
    result = {"device": gpu, "peak_flops": peak, "gpu_type": args.gpu_type, "liger": liger,
              "rank": args.rank, "gsm8k": {"median": GSM8K_MEDIAN, "sigma": GSM8K_SIGMA,
                                           "cap": GSM8K_CAP},
              "command": " ".join(sys.argv), "rows": []}  # fmt: skip
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0})()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.graphs]

    def save() -> None:
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(args.out / "step_table.json", result)

    def late() -> bool:
        return args.deadline_s is not None and time.perf_counter() - start > args.deadline_s

    for name in args.models:
        if late():
            break
        cfg = model_config(name)
        spec = ModelSpec.from_hf_config(cfg)
        base = build_base(cfg, device, dtype)
        peft_timer = StepTimeModel(spec, gpu_spec, DEFAULT_COEFFICIENTS,
                                   layout=LoRALayout.PER_ADAPTER)  # fmt: skip
        cells = []
        for kind in args.lengths:
            lengths = row_lengths(kind, 4096, cap)
            data = dataset(spec.vocab_size, lengths)
            if not args.no_peft:
                cells += [(kind, lengths, data, "peft", 1, b, False) for b in args.batches]
            cells += [(kind, lengths, data, "plora", k, b, g)
                      for k in args.packs for b in args.batches for g in modes]  # fmt: skip
        # the stock base first (PEFT as users run it), then the Liger base (plora's)
        cells.sort(key=lambda c: c[3] != "peft")
        fused = False
        for kind, lengths, data, system, k, b, graphs in cells:
            if late():
                break
            if system == "plora" and liger and not fused:
                apply_fused_kernels(base, "on", device=device)
                fused = True
            width = expected_width(lengths, k * b)
            row = {"model": name, "lengths": kind, "system": system, "adapters": k, "batch": b,
                   "graphs": graphs, "liger": fused, "expected_width": width}  # fmt: skip
            cfgs = configs(k, b, args.rank)
            pred = predicted_bytes(spec, cfgs, math.ceil(width), liger=fused, ckpt=False)
            row["predicted_gib"] = pred / 2**30
            if k * b * width > args.max_step_tokens:
                row["not_run"] = f"{k * b * width:.0f} padded tokens per step > --max-step-tokens"
            elif capacity and pred > 0.9 * capacity:
                row["not_run"] = f"predicted {pred / 2**30:.0f} GiB > 90 % of the GPU"
            if "not_run" in row:
                result["rows"].append(row)
                continue
            small = k * b * width < 8192  # launch-bound cells: more steps for a stable mean
            steps = {"min_steps": 3, "max_steps": 60 if small else 16, "min_s": args.min_time_s}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                if system == "peft":
                    steps["max_steps"] = min(steps["max_steps"], 8)
                    t = run_peft(base, data, b, args.rank, device, dtype, warmup=2, **steps)
                    timer = peft_timer
                else:
                    t = run_plora(base, tok, data, k, b, args.rank, device, dtype,
                                  graphs=graphs, warmup=2, **steps)  # fmt: skip
                    timer = StepTimeModel(spec, gpu_spec, step_prior(args.gpu_type, fused, graphs))
            except (torch.OutOfMemoryError, RuntimeError) as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(
                    f"{name} {kind} {system}-{k} b{b} graphs={graphs}: {row['error']}", flush=True
                )
                result["rows"].append(row)
                save()
                continue
            step_s = float(np.mean(t.times))
            book = booked(timer, k, b, args.rank, t.widths)
            pairs = zip(t.tokens, t.widths, strict=True)
            flops = sum(n * spec.train_flops_per_token(w) for n, w in pairs)
            row.update(
                step_s=step_s, step_std_s=float(np.std(t.times)), steps=len(t.times),
                skipped=t.skipped, widths=t.widths, times=t.times,
                mean_width=float(np.mean(t.widths)),
                tokens_per_s=float(np.sum(t.tokens) / np.sum(t.times)),
                padded_tokens_per_s=float(np.sum(t.padded) / np.sum(t.times)),
                ceiling_fraction=flops / float(np.sum(t.times)) / peak,
                peak_gib=t.peak_bytes / 2**30, booked_s=book, booked_error=(book - step_s) / step_s,
            )  # fmt: skip
            result["rows"].append(row)
            save()
            print(f"{name:>16} {kind:>5} {system:>5}-{k:<2} b{b:<2} graphs={graphs!s:5} "
                  f"width {row['mean_width']:6.0f}  step {step_s * 1e3:8.1f} ms "
                  f"(±{row['step_std_s'] * 1e3:.1f}, {len(t.times)} steps)  "
                  f"{row['tokens_per_s']:8.0f} tok/s  {row['ceiling_fraction']:.3f} of peak  "
                  f"booked {book * 1e3:8.1f} ms ({row['booked_error']:+.1%})", flush=True)  # fmt: skip
        del base
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = time.perf_counter() - start
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
