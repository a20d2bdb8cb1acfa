"""One trial of ``benchmarks/e2e_tune.py``: an ordinary single-adapter fine-tune with PEFT.

What every Tune trial of the baselines runs, on whatever GPUs its mode gave it:

1. ``AutoModelForCausalLM.from_pretrained(model, dtype=bf16)`` (float32 on CPU), the tokenizer
   beside it;
2. ``get_peft_model(model, LoraConfig(r, lora_alpha, target_modules, lora_dropout))`` after
   ``torch.manual_seed(seed)`` (PEFT draws A from the global RNG; B = 0);
3. the JSONL prompt/completion rows tokenized as ``tok(prompt) + tok(completion) + [eos]``,
   labels -100 on the prompt, cut at ``max_seq_len``; batches of ``batch_size`` rows in an
   epoch-wise seeded order (``numpy.random.default_rng([seed, epoch]).permutation``: the order
   plora draws for a config with that seed, so both systems see the same batches and differ only
   in the LoRA A initialisation and the kernels), right-padded;
4. ``steps`` optimizer steps: the HF loss (mean over completion tokens), ``clip_grad_norm_``,
   ``torch.optim.AdamW`` (weight decay as configured) and transformers'
   ``get_{constant,linear,cosine}_schedule_with_warmup``;
5. the eval loss on the eval file (token-weighted mean NLL over completion tokens, what plora's
   ``eval_loss`` is), returned with the load, train and eval seconds (:func:`timed_trial`).

``gradient_checkpointing`` in the spec turns on ``model.gradient_checkpointing_enable()``
(non-reentrant), as users do for a base that does not otherwise fit. Under FSDP (``world > 1``)
each rank takes its share of every batch and of the eval rows, the sums all-reduced. It imports
nothing from plora.
"""

from __future__ import annotations

import json
import time

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
def eval_sums(model, rows, pad_id: int, device, batch_size: int) -> tuple[float, int]:
    """Summed NLL and count of the completion tokens of ``rows`` (bf16 autocast on a GPU)."""
    model.eval()
    total, count = 0.0, 0
    cuda = torch.device(device).type == "cuda"
    for i in range(0, len(rows), batch_size):
        batch = collate(rows[i : i + batch_size], pad_id, device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
            ).logits
        labels = batch["labels"][:, 1:].to(logits.device)
        total += F.cross_entropy(
            logits[:, :-1].float().flatten(0, 1),
            labels.flatten(),
            ignore_index=-100,
            reduction="sum",
        ).item()
        count += int((labels != -100).sum())
    return total, count


def eval_loss(model, rows, pad_id: int, device, batch_size: int) -> float:
    """Token-weighted mean NLL of the completion tokens of ``rows``."""
    total, count = eval_sums(model, rows, pad_id, device, batch_size)
    return total / max(count, 1)


def load_base(spec: dict, device: str, *, dtype: torch.dtype | None = None, **kwargs):
    """The tokenizer and the base model: ``dtype`` (default bf16 on a GPU, float32 on the CPU),
    moved to ``device`` unless ``kwargs`` place it (``device_map``)."""
    dtype = dtype or (torch.bfloat16 if device != "cpu" else torch.float32)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, **kwargs)
    if "device_map" not in kwargs:
        model = model.to(device)
    return model, tok


def with_lora(model, config: dict, spec: dict):
    """``get_peft_model`` with the config's rank and alpha, A drawn after ``manual_seed``."""
    from peft import LoraConfig, get_peft_model

    if spec.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(spec["seed"])
    lora = LoraConfig(
        r=config["rank"],
        lora_alpha=config["alpha"],
        target_modules=spec["target_modules"],
        lora_dropout=spec["dropout"],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def train_steps(model, tok, config: dict, spec: dict, device, *, rank: int = 0, world: int = 1):
    """``spec["steps"]`` optimizer steps of ``model`` (see the module docstring); this rank
    takes rows ``rank::world`` of each batch. Returns the last loss (a tensor)."""
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train = load_rows(spec["train"], tok, spec["max_seq_len"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config["lr"], weight_decay=spec["weight_decay"])
    sched = SCHEDULES[spec["schedule"]](opt, spec["warmup_steps"], spec["steps"])
    cuda = torch.device(device).type == "cuda"
    model.train()
    order = batches(len(train), config["batch_size"], spec["seed"])
    loss = torch.tensor(float("nan"))
    for _ in range(spec["steps"]):
        batch = collate([train[i] for i in next(order)[rank::world]], pad_id, device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        if spec["max_grad_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(params, spec["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return loss


def rank_rows(rows: list, rank: int, world: int) -> list:
    """Rows ``rank::world``, padded with label-less rows to the same count on every rank (each
    rank then runs as many batches: an FSDP forward is a collective)."""
    mine = rows[rank::world]
    pad = (rows[0][0], [-100] * len(rows[0][0]))
    return mine + [pad] * (-(-len(rows) // world) - len(mine))


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_trial(config: dict, spec: dict, load, device, *, rank: int = 0, world: int = 1) -> dict:
    """Load (``load()`` -> model, tokenizer), train and evaluate one config; its metrics. With
    ``world > 1`` the eval rows are split over the ranks and the sums all-reduced."""
    t0 = time.perf_counter()
    model, tok = load()
    sync(device)
    t1 = time.perf_counter()
    loss = train_steps(model, tok, config, spec, device, rank=rank, world=world)
    sync(device)
    t2 = time.perf_counter()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = rank_rows(load_rows(spec["eval"], tok, spec["max_seq_len"]), rank, world)
    total, count = eval_sums(model, rows, pad_id, device, spec["eval_batch_size"])
    if world > 1:
        import torch.distributed as dist

        sums = torch.tensor([total, float(count), loss.item()], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        total, count, loss = sums[0].item(), int(sums[1].item()), sums[2] / world
    return {
        "eval_loss": total / max(count, 1),
        "train_loss": float(loss),
        "load_s": t1 - t0,
        "train_s": t2 - t1,
        "eval_s": time.perf_counter() - t2,
    }
