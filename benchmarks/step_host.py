"""Host time of one packed training step: how much of a step is Python and launches.

Builds a random-weight causal LM of an HF shape (a built-in tiny model, or a shipped config such
as ``Qwen/Qwen2.5-3B``; ``--layers`` shrinks or grows the depth), injects ``--adapters`` rank
``--rank`` adapters on every projection and runs packed steps. Prints, per configuration, the
median over the timed steps of:

* ``host ms``: step start until the last kernel is enqueued (``StepProfile.host_s``); on CPU
  everything runs synchronously, so it equals the step;
* ``step ms``: the whole step, synchronised;
* the trainable tensors the step touches (one A and one Bᵀ per packed layer).

CPU:  python benchmarks/step_host.py --layers 36 --adapters 16
GPU:  python benchmarks/step_host.py --model Qwen/Qwen2.5-3B --adapters 16 --seq 1024 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).parent))
import engine_throughput as et

from plora.engine.adapters import uninject
from plora.engine.trainer import PackedTrainer
from plora.model_spec import shipped_config_path
from plora.models import BUILTIN_MODELS
from plora.models.tiny import tiny_config


def hf_config(name: str, layers: int | None):
    """The HF config of ``name`` (built-in tiny model or shipped config), depth overridden."""
    if name in BUILTIN_MODELS:
        cfg = tiny_config(name)
    else:
        path = shipped_config_path(name)
        if path is None:
            raise SystemExit(f"--model {name}: not a built-in tiny model nor a shipped config")
        cfg = AutoConfig.from_pretrained(str(path))
    if layers is not None:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = cfg.layer_types[:1] * layers
    return cfg


def measure(args, adapters: int, device: torch.device) -> dict:
    """Median host and wall time per step of a pack of ``adapters`` adapters."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = hf_config(args.model, args.layers)
    base = et.build_base(cfg, device, dtype)
    data = et.synthetic_data(cfg.vocab_size, args.seq, n=4 * adapters)
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0})()
    total = args.warmup + args.steps
    trainer = PackedTrainer(base, tok, data, device=device, profile_steps=total)
    for c in et.adapter_configs(adapters, args.rank):
        trainer.add(c)
    walls = []
    for i in range(total):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        trainer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            walls.append(time.perf_counter() - t0)
    steps = trainer.profile().steps[args.warmup :]
    host = [getattr(s, "host_s", None) for s in steps]
    tensors = sum(1 for p in trainer.model.parameters() if p.requires_grad)
    uninject(base)
    return {
        "host_ms": 1e3 * statistics.median(host) if None not in host else float("nan"),
        "step_ms": 1e3 * statistics.median(walls),
        "tensors": tensors,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-qwen2")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--adapters", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {args.model} layers={args.layers or 'default'} rank={args.rank} seq={args.seq} "
          f"on {name}, torch {torch.__version__}")  # fmt: skip
    print(f"{'adapters':>8} {'tensors':>8} {'host ms':>9} {'step ms':>9}")
    for k in args.adapters:
        r = measure(args, k, device)
        print(f"{k:>8} {r['tensors']:>8} {r['host_ms']:>9.1f} {r['step_ms']:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
