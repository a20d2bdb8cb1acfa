"""Set-up of ``benchmarks/e2e.py``: GPU sampling, the random-weight model, data, the sweep.

See ``benchmarks/e2e.py`` for what the benchmark does with them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import random
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

TINY = ("tiny-qwen2", "tiny-llama")
#: nvidia-smi name fragment -> plora ``hardware.gpu_type`` (first match wins).
GPU_TYPES = (
    ("H200", "H200"),
    ("H100", "H100"),
    ("B200", "B200"),
    ("L40S", "L40S"),
    ("A10G", "A10G"),
    ("A6000", "A6000"),
    ("4090", "RTX4090"),
    ("L4", "L4"),
    ("A10", "A10"),
)

# ------------------------------------------------------------------------- GPU sampling


def gpu_names() -> list[str]:
    """Names of the visible GPUs from ``nvidia-smi`` (empty without it); no CUDA context."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_type_of(name: str) -> str | None:
    """plora's ``hardware.gpu_type`` for an nvidia-smi GPU name (None when unknown)."""
    if "A100" in name:
        return "A100-80GB" if "80G" in name else "A100-40GB"
    return next((t for frag, t in GPU_TYPES if frag in name), None)


def choose_gpus(count: int, gpu_type: str | None) -> tuple[str, list[int], str, str]:
    """``(device, GPU indices, GPU name, plora gpu_type)`` for ``--gpus count``: the first
    ``count`` visible GPUs (in ``CUDA_VISIBLE_DEVICES`` order when it is set), or ``cpu`` without
    ``nvidia-smi``; ``gpu_type`` (``--gpu-type``) wins over the name's."""
    names = gpu_names()
    device = "cuda" if names else "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    indices = (
        [int(i) for i in visible.split(",")]
        if visible.replace(",", "").isdigit()
        else list(range(len(names)))
    )
    gpus = indices[:count] if device == "cuda" else []
    if device == "cuda" and len(gpus) < count:
        raise SystemExit(f"--gpus {count}: only {len(indices)} GPUs visible")
    gpu = (names[gpus[0]] if gpus[0] < len(names) else names[0]) if gpus else "cpu"
    gpu_type = gpu_type or (gpu_type_of(gpu) if gpus else "cpu")
    if gpu_type is None:
        raise SystemExit(
            f"unknown GPU {gpu!r}: pass --gpu-type (a key of plora.config.hardware.GPU_TYPES)"
        )
    return device, gpus, gpu, gpu_type


class GpuSampler:
    """Samples ``utilization.gpu`` of GPUs ``indices`` every ``period_s`` in a thread.

    ``busy`` = mean over samples of ``sum(utilization) / (100 * len(indices))``: the fraction of
    the run's GPU time during which a kernel was executing (nvidia-smi's definition).
    """

    def __init__(self, indices: list[int], period_s: float = 0.5) -> None:
        self.indices, self.period_s = indices, period_s
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuSampler:
        if self.indices:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        cmd = [
            "nvidia-smi",
            "--query-gpu=utilization.gpu",
            "--format=csv,noheader,nounits",
            "-i",
            ",".join(map(str, self.indices)),
        ]
        while not self._stop.is_set():
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
                values = [float(v) for v in out.split()]
                if len(values) == len(self.indices):
                    self.samples.append(values)
            except (OSError, subprocess.SubprocessError, ValueError):
                pass
            self._stop.wait(self.period_s)

    @property
    def busy(self) -> float | None:
        if not self.samples:
            return None
        return sum(sum(s) for s in self.samples) / (100.0 * len(self.indices) * len(self.samples))


# ------------------------------------------------------------------------- model and data


def model_slug(name: str) -> str:
    return name.replace("/", "--")


def build_model(name: str, dest: str) -> dict[str, Any]:
    """Save ``name`` as a HF directory at ``dest`` (see the module docstring); run in a child
    process so that this process never holds a CUDA context. Returns model facts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from plora.model_spec import shipped_config_path
    from plora.models import save_base_model
    from plora.models.tokenizer import VOCAB_SIZE, build_tokenizer
    from plora.utils import atomic_path

    if name in TINY:
        save_base_model(name, dest)
    else:
        path = shipped_config_path(name)
        if path is None:
            raise SystemExit(f"--model {name}: no architecture config in plora/models/configs/")
        cfg = AutoConfig.from_pretrained(str(path))
        tok = build_tokenizer("llama" if cfg.model_type == "llama" else "qwen2", 4096)
        cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
        cfg.pad_token_id = tok.pad_token_id
        assert cfg.vocab_size >= VOCAB_SIZE
        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        with atomic_path(dest) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    return model_facts(dest)


def model_facts(path: str | Path) -> dict[str, Any]:
    from plora.model_spec import ModelSpec

    spec = ModelSpec.from_hf_config(str(path))
    return {
        "params": spec.total_params,
        "vocab_size": spec.vocab_size,
        "layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
    }


def ensure_model(name: str, work: Path) -> tuple[Path, dict[str, Any]]:
    """The model directory under ``work/models`` (built on first use, in a spawned child)."""
    dest = work / "models" / (model_slug(name) + ("" if name in TINY else "-random-bf16"))
    if (dest / "config.json").is_file():
        return dest, model_facts(dest)
    if name in TINY:  # built and pretrained on the CPU: no CUDA context here either
        return dest, build_model(name, str(dest))
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return dest, pool.submit(build_model, name, str(dest)).result()


def make_rows(n: int, tokens: int, seed: int) -> list[dict[str, str]]:
    """``copy`` / ``reverse`` rows on random letters, about ``tokens`` bytes (= tokens) each."""
    rng = random.Random(seed)
    half = max(4, (tokens - 12) // 2)
    rows = []
    for _ in range(n):
        task = rng.choice(("copy", "reverse"))
        length = max(2, half + rng.randint(-half // 10, half // 10))
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))
        answer = text if task == "copy" else text[::-1]
        rows.append({"prompt": f"{task}: {text} ->", "completion": f" {answer}"})
    return rows


#: Words of :func:`gsm8k_rows`' questions.
WORDS = (
    "Natalia", "sold", "clips", "to", "her", "friends", "in", "April", "and", "then", "half",
    "as", "many", "in", "May", "How", "many", "did", "she", "sell", "altogether", "Weng", "earns",
    "an", "hour", "for", "babysitting", "Yesterday", "minutes", "Betty", "is", "saving", "money",
    "wallet", "costs", "each", "week", "apples", "boxes", "more", "than", "left", "total",
)  # fmt: skip


def gsm8k_rows(
    n: int, median: int, cut: int, seed: int, sigma: float = 0.6
) -> list[dict[str, str]]:
    """GSM8K-like prompt/completion rows: a word problem with numbers (about 40 % of the row)
    and a worked answer of running sums ending ``#### N``; each row's length (bytes = tokens) is
    lognormal with median ``median`` and shape ``sigma`` (GSM8K's question + answer is about
    250 tokens with a long tail), cut at ``cut`` (the sweep's ``max_seq_len``) less a margin
    for the tokenizer's specials."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = min(cut - 8, max(32, round(rng.lognormvariate(math.log(median), sigma))))
        nums = [rng.randint(2, 99) for _ in range(6)]
        words: list[str] = []
        while len(" ".join(words)) < 0.4 * length - 8:
            words.append(str(rng.choice(nums)) if rng.random() < 0.2 else rng.choice(WORDS))
        prompt = "Question: " + " ".join(words) + "?"
        steps, total, i = [], 0, 0
        while len(" ".join(steps)) < length - len(prompt) - 16:
            x = nums[i % len(nums)]
            steps.append(f"{total} + {x} = {total + x}.")
            total, i = total + x, i + 1
        answer = (" " + " ".join(steps))[: max(1, length - len(prompt) - 12)]
        rows.append({"prompt": prompt, "completion": f"{answer} #### {total}"})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    from plora.utils import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def grid(args: argparse.Namespace) -> tuple[list[float], list[int]]:
    """The lr and rank lists, trimmed so that lr x rank x batch size has ``--configs`` configs."""
    lrs, ranks, sizes = args.lrs, args.ranks, args.batch_sizes
    k = args.configs
    if k is None or k == len(lrs) * len(ranks) * len(sizes):
        return lrs, ranks
    pairs, left = divmod(k, len(sizes))
    for n_ranks in range(min(pairs, len(ranks)), 0, -1):
        if not left and pairs % n_ranks == 0 and pairs // n_ranks <= len(lrs):
            return lrs[: pairs // n_ranks], ranks[:n_ranks]
    raise SystemExit(
        f"--configs {k}: not a lr x rank x batch sub-grid of {len(lrs)} x {len(ranks)} x "
        f"{len(sizes)}"
    )


#: The PLoRA paper's Table 1 ranges (lr 2e-5 .. 4e-4, batch size 1 .. 32, rank 8 .. 128, alpha
#: r/4 .. 4r) as plora search-space domains: ``--draw K`` configs are K seeded random draws.
TABLE1: dict[str, Any] = {
    "lr": {"loguniform": [2.0e-5, 4.0e-4]},
    "batch_size": {"choice": [1, 2, 4, 8, 16, 32]},
    "rank": {"choice": [8, 16, 32, 64, 128]},
    "alpha_ratio": {"choice": [0.25, 0.5, 1.0, 2.0, 4.0]},
}


def space_dict(args: argparse.Namespace, lrs: list[float], ranks: list[int]) -> dict[str, Any]:
    """The sweep's hyperparameters: the grid ``lrs`` x ``ranks`` x ``--batch-sizes`` x
    ``--alpha-ratios`` (default alpha = 2 rank), or with ``--draw K`` the :data:`TABLE1`
    domains (drawn by the sweep's ``search: random``)."""
    if getattr(args, "draw", None):
        return dict(TABLE1)
    ratios = getattr(args, "alpha_ratios", [2.0])
    return {"lr": lrs, "rank": ranks, "alpha_ratio": ratios if len(ratios) > 1 else ratios[0],
            "batch_size": args.batch_sizes}  # fmt: skip


def varies_alpha(args: argparse.Namespace) -> bool:
    """Whether a config's name needs its alpha: drawn, or several ``--alpha-ratios``."""
    return bool(getattr(args, "draw", None)) or len(getattr(args, "alpha_ratios", [2.0])) > 1


def make_data(args: argparse.Namespace, n: int, seed: int) -> list[dict[str, str]]:
    """``n`` rows of ``--data``: copy/reverse of about ``--tokens``, or :func:`gsm8k_rows`."""
    if getattr(args, "data", "copy") == "gsm8k":
        return gsm8k_rows(n, args.tokens, args.max_seq_len, seed)
    return make_rows(n, args.tokens, seed)


def sweep_dict(args, model_dir: Path, data: dict[str, Path], lrs, ranks, gpu_type: str) -> dict:
    """plora's sweep file; ``--draw K``: ``search: random`` with ``num_samples: K`` and
    ``seed: --draw-seed`` (the list of configs both systems train is its expansion)."""
    draw = getattr(args, "draw", None)
    search = (
        {"search": "random", "num_samples": draw, "seed": args.draw_seed}
        if draw
        else {"search": "grid"}
    )
    return {
        "name": "e2e",
        "model": {"name_or_path": str(model_dir), "dtype": "auto"},
        "dataset": {
            "path": str(data["train"]),
            "eval_path": str(data["eval"]),
            "format": "prompt_completion",
            "num_examples": args.train_rows,
            "max_seq_len": getattr(args, "max_seq_len", None) or args.tokens + 40,
            "metric": "none",
        },
        "space": {
            **space_dict(args, lrs, ranks),
            "target_modules": "all",
            "dropout": getattr(args, "dropout", 0.0),
            "max_steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "schedule": args.schedule,
            "max_grad_norm": 1.0,
            "weight_decay": 0.0,
            "seed": 0,
        },
        **search,
        "metric": "eval_loss",
        "mode": "min",
        "hardware": {"gpu_type": gpu_type, "num_gpus": args.gpus},
        # jobs of several GPUs where the cost model prefers them (the planner's choice per pack)
        **({"planner": {"strategies": ["tp", "fsdp", "pp"]}} if args.gpus > 1 else {}),
        "training": {
            "fused_kernels": getattr(args, "fused_kernels", "auto"),
            "cuda_graphs": getattr(args, "plora_graphs", "auto"),
        },
    }


def plora_engine(args: argparse.Namespace, sweep: Any) -> dict[str, Any]:
    """What plora's engine runs, for the report: ``training.fused_kernels`` (``--fused-kernels``
    and what plora resolves it to: Liger-Kernel on the base, and the plan assumes it) and
    ``training.cuda_graphs`` (``--plora-graphs``; auto replays the steady step of one-GPU jobs
    as CUDA graphs on a GPU unless ``PLORA_CUDA_GRAPHS=0`` is set, recorded here too)."""
    from plora.cost.build import plan_fused_kernels

    return {
        "fused_kernels": {"setting": args.fused_kernels, "plora": plan_fused_kernels(sweep)},
        "cuda_graphs": {
            "setting": args.plora_graphs,
            "PLORA_CUDA_GRAPHS": os.environ.get("PLORA_CUDA_GRAPHS"),
        },
    }


def tune_spec(
    sweep: dict, configs: list[dict[str, Any]], *, gradient_checkpointing: bool = False
) -> dict:
    """What ``e2e_tune.py`` needs, from the same sweep definition; ``configs`` (key, lr, rank,
    batch_size, alpha per config: the sweep's expansion) become Tune's grid."""
    ds, sp = sweep["dataset"], sweep["space"]
    return {
        "model": sweep["model"]["name_or_path"],
        "train": ds["path"],
        "eval": ds["eval_path"],
        "max_seq_len": ds["max_seq_len"],
        "configs": configs,
        "gradient_checkpointing": gradient_checkpointing,
        "steps": sp["max_steps"],
        "warmup_steps": sp["warmup_steps"],
        "schedule": sp["schedule"],
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        "dropout": sp["dropout"],
        "max_grad_norm": sp["max_grad_norm"],
        "weight_decay": sp["weight_decay"],
        "seed": sp["seed"],
        "eval_batch_size": 8,
    }


def key(lr: float, rank: int, batch_size: int, alpha: float | None = None) -> str:
    """A config's name in the report: ``lr=...,r=...,bs=...`` (and ``,a=...`` when the sweep
    varies alpha)."""
    out = f"lr={lr:g},r={int(rank)},bs={int(batch_size)}"
    return out if alpha is None else f"{out},a={alpha:g}"
