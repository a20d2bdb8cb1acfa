"""Shared pieces of the engine tests: a tiny random base model, toy data and the PEFT reference.

The reference trains ONE adapter the ordinary way -- ``peft.get_peft_model`` on a fresh copy of
the base, the model's own mean token loss (``labels=``), ``torch.optim.AdamW``,
``transformers.get_scheduler``, ``clip_grad_norm_`` -- over the same data order
(``AdapterStream``), padding only its own batch. It shares no code with the packed engine
except the data stream and (for dropout) the keyed mask function.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, get_scheduler

from plora.config import LoRAConfig
from plora.engine.data import AdapterStream, Example, TokenizedDataset
from plora.engine.lora import dropout_mask, module_key

VOCAB = 61
PAD = 0


def tiny_model(
    family: str = "qwen2",
    seed: int = 0,
    *,
    hidden: int = 32,
    intermediate: int = 48,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
) -> nn.Module:
    """A random causal LM (default: 2 layers, 4 heads, GQA with 2 KV heads; untied head),
    float32, eval-free (dropout 0)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=PAD,
    )
    cfg = Qwen2Config(**common) if family == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = (Qwen2ForCausalLM if family == "qwen2" else LlamaForCausalLM)(cfg)
    return model.float()


def toy_dataset(n: int = 24, seed: int = 0, *, fixed_len: int | None = None) -> TokenizedDataset:
    """Random sequences of 5..14 tokens; the first 1..3 tokens are prompt (label -100)."""
    rng = random.Random(seed)
    train = []
    for _ in range(n):
        length = fixed_len or rng.randint(5, 14)
        ids = [rng.randint(3, VOCAB - 1) for _ in range(length)]
        prompt = rng.randint(1, 3)
        labels = [-100] * prompt + ids[prompt:]
        train.append(Example(input_ids=ids, labels=labels, prompt="", answer=None, label=None))
    return TokenizedDataset(train=train, eval=train[:4], metric="none", labels=None)


@dataclass
class _Tok:
    pad_token_id: int = PAD
    eos_token_id: int = 2


TOKENIZER = _Tok()


def collate(examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-pad one adapter's batch to its own longest example."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), PAD)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
        mask[i, : len(e.input_ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class KeyedDropout(nn.Module):
    """Dropout with the engine's keyed per-row masks, to put into a PEFT reference."""

    def __init__(self, p: float, seed: int, key: int, clock: list[int]) -> None:
        super().__init__()
        self.p, self.seed, self.key, self.clock = p, seed, key, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        masks = [
            dropout_mask(
                seed=self.seed, step=self.clock[0], row=j, key=self.key, shape=x.shape[1:], p=self.p
            )
            for j in range(x.shape[0])
        ]
        return x * torch.stack(masks)


_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def peft_reference(
    base: nn.Module,
    config: LoRAConfig,
    init: dict[str, torch.Tensor],
    dataset: TokenizedDataset,
    steps: int,
    *,
    total_steps: int | None = None,
    keyed_dropout: bool = False,
    copy_base: bool = True,
) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
    """Train ``config`` alone with PEFT for ``steps`` steps from PEFT-keyed weights ``init``.

    ``copy_base=False`` trains on ``base`` itself (a fresh model the caller built: torchao's
    NF4 weights re-quantize when deep-copied, so QLoRA tests build each base anew).
    Returns the per-step losses, the final PEFT-keyed adapter weights and the PEFT model.
    """
    model = copy.deepcopy(base) if copy_base else base
    peft_cfg = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        lora_dropout=config.dropout,
        use_rslora=config.use_rslora,
    )
    pm = get_peft_model(model, peft_cfg)
    result = set_peft_model_state_dict(pm, init)
    assert not [k for k in result.unexpected_keys if "lora" in k]
    clock = [0]
    if keyed_dropout:
        for name, module in pm.named_modules():
            if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
                layer = int(name.split("layers.")[1].split(".")[0])
                module.lora_dropout["default"] = KeyedDropout(
                    config.dropout, config.seed, module_key(layer, name.rsplit(".", 1)[1]), clock
                )
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=config.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=config.weight_decay
    )
    sched = get_scheduler(
        _SCHEDULES[str(config.schedule)],
        opt,
        num_warmup_steps=config.warmup_steps,
        num_training_steps=total_steps or config.max_steps,
    )
    stream = AdapterStream(len(dataset.train), config.batch_size, config.seed)
    losses = []
    for step in range(steps):
        clock[0] = step
        batch = collate([dataset.train[i] for i in stream.next_batch()])
        batch = {k: v.to(params[0].device) for k, v in batch.items()}
        loss = pm(**batch).loss
        loss.backward()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(pm).items()}
    return losses, weights, pm


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a - b‖ / ‖b‖`` (absolute when ``b`` is zero)."""
    denom = float(b.norm())
    return float((a - b).norm()) / (denom if denom > 0 else 1.0)


def adapter_rel_err(packed: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """``‖θ_packed - θ_ref‖ / ‖θ_ref‖`` over all of the adapter's tensors together."""
    num = sum(float((packed[k] - ref[k]).pow(2).sum()) for k in ref)
    den = sum(float(ref[k].pow(2).sum()) for k in ref)
    return (num / den) ** 0.5


def assert_same_adapter(packed: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol=1e-5):
    """Same keys and ``‖Δθ‖/‖θ‖ <= tol`` over the whole adapter.

    Whole-adapter, not per tensor: Adam turns fp32 noise of ~1e-7 (base GEMMs over a
    different number of rows in the pack) into ~1e-5 on a single element whose gradient is
    near ``eps`` -- a real effect of the optimizer, not of packing (alone in a pack the
    weights are bitwise those of PEFT).
    """
    assert set(packed) == set(ref), sorted(set(packed) ^ set(ref))[:4]
    err = adapter_rel_err(packed, ref)
    assert err <= tol, f"adapter weights differ: relative error {err:.2e} > {tol}"
