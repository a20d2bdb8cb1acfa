"""Seconds per forward + backward for a run of new padded lengths, per set of SDPA backends.

Why the engine leaves cuDNN attention out (``plora/engine/attention.py``): cuDNN builds a plan
on the host for each new ``(rows, length)`` shape, and packed rows are padded to each
micro-batch's longest row. A few decoder layers of a shipped architecture with random bf16
weights, ``--rows`` right-padded rows per step (CUDA only).

    python benchmarks/sdpa_shapes.py [--model Qwen/Qwen2.5-1.5B] [--layers 4] [--rows 64]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

LENGTHS = [640, 639, 634, 636, 632, 630, 602, 621, 639, 634, 640]
MODES: dict[str, list[SDPBackend] | None] = {
    "default": None,
    "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from plora.model_spec import shipped_config_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    args = ap.parse_args()
    cfg = AutoConfig.from_pretrained(str(shipped_config_path(args.model)))
    cfg.use_cache, cfg.num_hidden_layers = False, args.layers
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.requires_grad_(False)
    emb = model.get_input_embeddings()
    print(f"{torch.cuda.get_device_name()}: {args.model} x {args.layers} layers, {args.rows} rows")
    for n, name in enumerate(args.modes.split(",")):
        backends = MODES[name]
        times = []
        for i, length in enumerate(LENGTHS):
            length += n * 3 + i % 3 if n else 0  # lengths no earlier mode has seen
            ids = torch.randint(3, 4000, (args.rows, length), device="cuda")
            mask = torch.ones_like(ids)
            for r in range(0, args.rows, 3):
                mask[r, length - 1 - r % 40 :] = 0
            x = emb(ids).detach().requires_grad_(True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                model(inputs_embeds=x, attention_mask=mask).logits[:, -8:].float().sum().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        print(f"{name:10s} " + " ".join(f"{t:.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
