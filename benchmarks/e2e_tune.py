"""The baseline of ``benchmarks/e2e.py``: a LoRA sweep the way users write it today.

Ray Tune + PEFT, one trial per config. Each trial is an ordinary single-adapter fine-tune:

1. ``AutoModelForCausalLM.from_pretrained(model, dtype=bf16)`` on the GPU Ray gave the trial
   (float32 on CPU), the tokenizer beside it;
2. ``get_peft_model(model, LoraConfig(r, lora_alpha, target_modules, lora_dropout))`` after
   ``torch.manual_seed(seed)`` (PEFT draws A from the global RNG; B = 0);
3. the JSONL prompt/completion rows tokenized as ``tok(prompt) + tok(completion) + [eos]``,
   labels -100 on the prompt, cut at ``max_seq_len``; batches of ``batch_size`` rows in an
   epoch-wise seeded order (``numpy.random.default_rng([seed, epoch]).permutation``: the order
   plora draws for a config with that seed, so both systems see the same batches and differ only
   in the LoRA A initialisation and the kernels), right-padded;
4. ``steps`` optimizer steps: bf16 autocast on the GPU, the HF loss (mean over completion
   tokens), ``clip_grad_norm_``, ``torch.optim.AdamW`` (weight decay as configured) and
   transformers' ``get_{constant,linear,cosine}_schedule_with_warmup``;
5. the eval loss on the eval file (token-weighted mean NLL over completion tokens, what plora's
   ``eval_loss`` is) and ``tune.report({"eval_loss": ...})``.

The grid is ``tune.grid_search`` over ``lr`` and ``rank`` (alpha = ``alpha_ratio`` x rank), run
by ``tune.Tuner(tune.with_resources(tune.with_parameters(train_lora, spec=spec), {"gpu": g,
"cpu": c}))``: ``g = 1`` is one trial per GPU, ``g = 0.25`` packs four trials (four processes,
four model copies) onto each GPU. ``c`` defaults to ``min(1, CPUs / trials at once)``.

This file is run as a script by ``benchmarks/e2e.py`` (which times it from start to exit)::

    python benchmarks/e2e_tune.py --spec SPEC.json --out RESULT.json --gpu-per-trial 1
    python benchmarks/e2e_tune.py --spec SPEC.json --out BASE.json --base-eval   # no adapter

``SPEC.json`` holds the model directory, the data files and the training settings (see
``benchmarks/e2e_setup.py``'s ``tune_spec``). It imports nothing from plora.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

SCHEDULES = {
    "constant": lambda opt, warmup, steps: get_constant_schedule_with_warmup(opt, warmup),
    "linear": get_linear_schedule_with_warmup,
    "cosine": get_cosine_schedule_with_warmup,
}


def load_rows(path: str, tok, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` per JSONL row; loss on the completion and eos only."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = tok(row["prompt"])["input_ids"]
            completion = tok(row["completion"], add_special_tokens=False)["input_ids"]
            ids = prompt + completion + [tok.eos_token_id]
            labels = [-100] * len(prompt) + completion + [tok.eos_token_id]
            rows.append((ids[:max_seq_len], labels[:max_seq_len]))
    return rows


def collate(rows, pad_id: int, device: str) -> dict[str, torch.Tensor]:
    """Right-pad a list of ``(input_ids, labels)`` into model inputs on ``device``."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (x, y) in enumerate(rows):
        ids[r, : len(x)], labels[r, : len(y)], mask[r, : len(x)] = (
            torch.tensor(x),
            torch.tensor(y),
            1,
        )
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "labels": labels.to(device),
    }


def batches(n: int, batch_size: int, seed: int):
    """Endless batches of row indices, reshuffled every epoch (seeded)."""
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(n).tolist()
        for i in range(0, n, batch_size):
            yield order[i : i + batch_size]
        epoch += 1


@torch.no_grad()
def eval_loss(model, rows, pad_id: int, device: str, batch_size: int) -> float:
    """Token-weighted mean NLL of the completion tokens of ``rows``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = collate(rows[i : i + batch_size], pad_id, device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
            ).logits
        labels = batch["labels"][:, 1:]
        total += F.cross_entropy(
            logits[:, :-1].float().flatten(0, 1),
            labels.flatten(),
            ignore_index=-100,
            reduction="sum",
        ).item()
        count += int((labels != -100).sum())
    return total / max(count, 1)


def load_base(spec: dict, device: str):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).to(device)
    return model, tok


def train_lora(config: dict, spec: dict) -> None:
    """The Tune trainable: one LoRA config, trained and evaluated (see the module docstring)."""
    from peft import LoraConfig, get_peft_model
    from ray import tune

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model, tok = load_base(spec, device)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(spec["seed"])
    rank = config["rank"]
    lora = LoraConfig(
        r=rank,
        lora_alpha=config["alpha_ratio"] * rank,
        target_modules=spec["target_modules"],
        lora_dropout=spec["dropout"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    train = load_rows(spec["train"], tok, spec["max_seq_len"])
    evals = load_rows(spec["eval"], tok, spec["max_seq_len"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config["lr"], weight_decay=spec["weight_decay"])
    sched = SCHEDULES[spec["schedule"]](opt, spec["warmup_steps"], spec["steps"])
    if device == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    model.train()
    order = batches(len(train), spec["batch_size"], spec["seed"])
    loss = torch.tensor(float("nan"))
    for _ in range(spec["steps"]):
        batch = collate([train[i] for i in next(order)], pad_id, device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        if spec["max_grad_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(params, spec["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    loss_eval = eval_loss(model, evals, pad_id, device, spec["eval_batch_size"])
    t3 = time.perf_counter()
    tune.report(
        {
            "eval_loss": loss_eval,
            "train_loss": loss.item(),
            "load_s": t1 - t0,
            "train_s": t2 - t1,
            "eval_s": t3 - t2,
        }
    )


def run_tune(spec: dict, args: argparse.Namespace) -> dict:
    import ray
    from ray import tune

    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    ray.init(
        num_gpus=args.gpus,
        num_cpus=args.ray_cpus,
        include_dashboard=False,
        runtime_env={
            "env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
        },
    )
    t1 = time.perf_counter()
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    concurrent = max(1.0, args.gpus / args.gpu_per_trial)
    cpu_per_trial = args.cpus_per_trial or min(1.0, cpus / concurrent)
    trainable = tune.with_resources(
        tune.with_parameters(train_lora, spec=spec),
        {"gpu": args.gpu_per_trial, "cpu": cpu_per_trial},
    )
    tuner = tune.Tuner(
        trainable,
        param_space={
            "lr": tune.grid_search(spec["lrs"]),
            "rank": tune.grid_search(spec["ranks"]),
            "alpha_ratio": spec["alpha_ratio"],
        },
        tune_config=tune.TuneConfig(metric="eval_loss", mode="min"),
        run_config=tune.RunConfig(
            name=args.name, storage_path=str(Path(args.storage).absolute()), verbose=1
        ),
    )
    grid = tuner.fit()
    t2 = time.perf_counter()
    trials = []
    for result in grid:
        cfg, m = result.config, result.metrics or {}
        trials.append(
            {
                "lr": cfg["lr"],
                "rank": cfg["rank"],
                "alpha": cfg["alpha_ratio"] * cfg["rank"],
                "eval_loss": m.get("eval_loss"),
                "train_loss": m.get("train_loss"),
                "load_s": m.get("load_s"),
                "train_s": m.get("train_s"),
                "eval_s": m.get("eval_s"),
                "error": None if result.error is None else str(result.error).splitlines()[0][:300],
            }
        )
    ray.shutdown()
    return {
        "device": "cuda" if cuda else "cpu",
        "gpu_per_trial": args.gpu_per_trial,
        "cpu_per_trial": cpu_per_trial,
        "ray_init_s": t1 - t0,
        "fit_s": t2 - t1,
        "shutdown_s": time.perf_counter() - t2,
        "trials": trials,
    }


def run_base_eval(spec: dict, args: argparse.Namespace) -> dict:
    model, tok = load_base(spec, args.device)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = load_rows(spec["eval"], tok, spec["max_seq_len"])
    return {"eval_loss": eval_loss(model, rows, pad_id, args.device, spec["eval_batch_size"])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="JSON: model, data files, training settings")
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--gpus", type=int, default=1, help="GPUs Ray may use (logical on CPU)")
    ap.add_argument("--gpu-per-trial", type=float, default=1.0, help="1: one trial per GPU")
    ap.add_argument(
        "--cpus-per-trial", type=float, default=None, help="default min(1, CPUs/trials at once)"
    )
    ap.add_argument("--ray-cpus", type=int, default=None, help="CPUs Ray may use (default all)")
    ap.add_argument("--storage", default="tune_results", help="Tune storage_path")
    ap.add_argument("--name", default="e2e-tune", help="Tune experiment name")
    ap.add_argument("--base-eval", action="store_true", help="only the base model's eval loss")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    spec = json.loads(Path(args.spec).read_text())
    result = run_base_eval(spec, args) if args.base_eval else run_tune(spec, args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    bad = [
        t
        for t in result.get("trials", [])
        if t["eval_loss"] is None or not math.isfinite(t["eval_loss"])
    ]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
