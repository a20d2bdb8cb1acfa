"""Built-in tiny base models: ``tiny-qwen2`` and ``tiny-llama``.

Each is a real transformers architecture (``Qwen2ForCausalLM`` / ``LlamaForCausalLM``) at toy
size -- hidden 64, 2 layers, 4 query heads, 2 KV heads (GQA), MLP 128, vocabulary 259 (the
byte-level tokenizers of :mod:`plora.models.tokenizer`), 91 k / 107 k parameters (tied / untied
LM head) -- so every code path
(GQA, RoPE, tied/untied heads, PEFT target modules) is the one a real model takes, at a cost
of a few milliseconds per training step on a CPU.

A randomly initialised base model knows nothing, and LoRA on a random base learns almost
nothing in 100 steps (measured: eval loss stays at ~4.0 nats, near uniform over 100 tokens).
So the base is *pretrained*: a fixed recipe of :data:`PRETRAIN_STEPS` full-parameter AdamW
steps on text from every builtin task (:func:`plora.tasks.task_corpus`), from
``torch.manual_seed(seed)`` weights. The base then knows the byte statistics and the task
formats but is weak at each task (arithmetic exact match: tiny-qwen2 12 %, tiny-llama 24 %;
eval loss ~1 nat/token), so LoRA fine-tuning has something to adapt and hyperparameters
visibly matter (100 steps of LoRA: from 0 % at lr 3e-2 to ~30 % at lr 1e-3 on tiny-qwen2).

Pretraining takes ~10 s of one CPU core per model; the result is cached as a standard HF
directory under ``$PLORA_CACHE_DIR`` (default ``~/.cache/plora``) ``/tiny/<name>-<hash>``,
where the hash covers the architecture, the tokenizer and the recipe. It is built in a
temporary directory, marked complete last (:data:`COMPLETE_MARKER`), published with one atomic
rename and always *read back from disk*, so concurrent processes on one machine use identical
weights; a directory at that path without the marker (an interrupted build, anything else) is
set aside and built again, never loaded. Pretraining runs on the CPU, in float32, on one thread (reproducible
reductions), whatever device the model is later moved to. Another machine or torch version may
round differently and so build a slightly different base (seen: eval loss 1.063 vs 1.058 on the
arithmetic eval split); runs that must agree should share one built directory
(:func:`plora.models.save_base_model`) rather than build twice.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

from plora.config import ConfigError
from plora.models.tokenizer import VOCAB_SIZE, build_tokenizer
from plora.utils import atomic_write_text, torchao_first

if TYPE_CHECKING:  # the model classes (1.1 s, and torchao) only where a model is built
    from transformers import PreTrainedModel

_log = logging.getLogger(__name__)
_BUILD_S = 0.0
_BUILD_S_LOCK = threading.Lock()

#: Written last into a built entry: an entry without it (an interrupted build, a directory made
#: by anything else) is set aside and built again, never loaded.
COMPLETE_MARKER = ".plora-complete"
#: Bump when the architecture defaults or the pretraining recipe change (invalidates caches).
RECIPE_VERSION = 1
PRETRAIN_STEPS = 300
PRETRAIN_LR = 3e-3
PRETRAIN_BATCH = 32
PRETRAIN_CORPUS_SEED = 123
MAX_POSITIONS = 512

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=MAX_POSITIONS,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

#: name -> (config class, extra config kwargs, init seed, tokenizer flavour)
TINY_MODELS: dict[str, tuple[type[PretrainedConfig], dict, int, str]] = {
    "tiny-qwen2": (Qwen2Config, {"tie_word_embeddings": True, "rope_theta": 10000.0}, 0, "qwen2"),
    "tiny-llama": (LlamaConfig, {"tie_word_embeddings": False, "rope_theta": 10000.0}, 1, "llama"),
}


def tiny_config(name: str) -> PretrainedConfig:
    """The HF config of a built-in tiny model (no weights), e.g. for memory planning.

    Raises:
        ConfigError: ``name`` is not a built-in model.
    """
    cls, extra, _, _ = _lookup(name)
    cfg = cls(**_COMMON, **extra)
    cfg.dtype = torch.float32
    return cfg


def cache_root() -> Path:
    """Where built tiny models are cached: ``$PLORA_CACHE_DIR/tiny`` (default ``~/.cache/plora``)."""
    base = os.environ.get("PLORA_CACHE_DIR") or Path.home() / ".cache" / "plora"
    return Path(base) / "tiny"


def tiny_model_dir(name: str) -> Path:
    """Return the cached HF directory of ``name``, building (pretraining) it first if absent."""
    path = _model_dir(name)
    _ensure_built(name, path)
    return path


def ensure_tiny_model(name: str) -> float:
    """Build ``name``'s cached directory unless it is there; the seconds spent building it, or
    waiting for the process that builds it (0.0 when it was there)."""
    return _ensure_built(name, _model_dir(name))


def _ensure_built(name: str, path: Path) -> float:
    global _BUILD_S
    if _complete(path):
        return 0.0
    t0 = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    # One builder per machine: the sweep driver builds while its worker starts, and a second
    # builder would halve both on a small host (a fresh 2-core box: the worker's load took
    # 13.3 s beside the driver's build). Others wait on the lock, then read the result.
    with FileLock(path.parent / f".{path.name}.lock"):
        if not _complete(path):
            if path.exists():  # a directory this code did not publish whole: set it aside
                _discard(path)
            _build(name, path)
    spent = time.perf_counter() - t0
    with _BUILD_S_LOCK:  # callers on several threads (the driver: its prepare thread, its main)
        _BUILD_S += spent
    return spent


def _complete(path: Path) -> bool:
    """Whether ``path`` is a whole published entry: its marker is written last, inside the
    temporary directory, before the one rename that publishes it."""
    return (path / COMPLETE_MARKER).is_file() and (path / "config.json").is_file()


def _discard(path: Path) -> None:
    """Move an incomplete entry out of the way (one rename: readers never see it half gone)
    and delete it, saying what it held."""
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else ["(not a directory)"]
    _log.warning("tiny model cache %s is incomplete (holds %s): building it again", path, held)
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.broken.", dir=path.parent))
    os.rename(path, aside / "entry")
    shutil.rmtree(aside, ignore_errors=True)


def build_seconds() -> float:
    """Seconds this process has spent in :func:`ensure_tiny_model` building or waiting, in all:
    a worker keeps that one-time cost out of its measured start-up."""
    return _BUILD_S


def _model_dir(name: str) -> Path:
    cfg = tiny_config(name)
    key = json.dumps(
        {
            "name": name,
            "config": cfg.to_diff_dict(),
            "tokenizer": [TINY_MODELS[name][3], VOCAB_SIZE],
            "recipe": [RECIPE_VERSION, PRETRAIN_STEPS, PRETRAIN_LR, PRETRAIN_BATCH],
            "corpus": hashlib.sha256("\x00".join(_corpus()).encode()).hexdigest(),
            "seed": TINY_MODELS[name][2],
        },
        sort_keys=True,
        default=str,
    )
    return cache_root() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _build(name: str, path: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _pretrained_model(name, tiny_config(name)).save_pretrained(tmp)
        build_tokenizer(TINY_MODELS[name][3], MAX_POSITIONS).save_pretrained(tmp)
        for f in tmp.iterdir():  # on disk before the marker says so
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        atomic_write_text(
            tmp / COMPLETE_MARKER, json.dumps({"name": name, "recipe": RECIPE_VERSION})
        )
        # rename() onto an existing non-empty directory fails: a builder on another machine
        # sharing the cache that finished first wins, and readers never see a half-written or
        # swapped directory.
        with contextlib.suppress(OSError):
            os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _complete(path):
        raise RuntimeError(f"tiny model cache {path}: built, but the entry is not whole")


def _lookup(name: str) -> tuple[type[PretrainedConfig], dict, int, str]:
    try:
        return TINY_MODELS[name]
    except KeyError:
        raise ConfigError(
            f"model {name!r} is not a built-in tiny model; choose one of {', '.join(TINY_MODELS)}"
        ) from None


def _pretrained_model(name: str, cfg: PretrainedConfig) -> PreTrainedModel:
    """Seeded random init, then the fixed pretraining recipe (CPU, float32)."""
    # transformers' model classes import torchao whenever it is installed, with a page of
    # warnings: quietly first
    torchao_first()
    from transformers import AutoModelForCausalLM

    _, _, seed, flavour = TINY_MODELS[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reproducible reductions; and 2 threads on 2 busy cores thrash
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            return _pretrain(model, build_tokenizer(flavour, MAX_POSITIONS), name)
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _corpus() -> list[str]:
    from plora.tasks import task_corpus

    return task_corpus(2000, PRETRAIN_CORPUS_SEED)


def _pretrain(model: PreTrainedModel, tok, name: str) -> PreTrainedModel:
    corpus = [tok(t)["input_ids"] + [tok.eos_token_id] for t in _corpus()]
    rng = random.Random(f"pretrain:{name}")
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    model.train()
    for _ in range(PRETRAIN_STEPS):
        batch = rng.sample(corpus, PRETRAIN_BATCH)
        width = max(map(len, batch))
        ids = torch.tensor([b + [tok.pad_token_id] * (width - len(b)) for b in batch])
        labels = torch.tensor([b + [-100] * (width - len(b)) for b in batch])
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return model


__all__ = [
    "TINY_MODELS",
    "build_seconds",
    "cache_root",
    "ensure_tiny_model",
    "tiny_config",
    "tiny_model_dir",
]
