"""Compile a pack's Triton kernels before its first step, while the base model still loads.

A cold worker process JIT-compiles every packed-LoRA kernel variant its first step launches:
5-8 s on the lent H100 and H200 (``ptxas`` runs per variant), all of it on the sweep's
critical path after the model has loaded. Which variants a step needs depends only on things
known before the model is: the projections' ``(in, out)`` and bias (from the model's config,
:class:`plora.model_spec.ModelSpec`), the compute dtype, the pack's ranks, slot count and
dropout, and the step's token count (the measured fused/unfused mode is chosen per shape).

:func:`warm_pack_kernels` runs one forward and backward of a stand-in
:class:`~plora.engine.lora.PackedLoRALinear` per distinct projection shape, with the pack's
slots and a step's rows, through the same code path as the trainer
(:func:`plora.engine.fused.fused_forward`). The resident worker runs it for its first job in a child
process (:func:`start_warmup`) while its own load (mostly importing transformers) goes on; the
first step then finds the kernels in Triton's on-disk cache. It never changes results: the stand-in layers are thrown
away, and a variant it missed is simply compiled at the first step, as before.

Where the engine runs Liger-Kernel's fused ops (``training.fused_kernels``), a second child
(:func:`start_fused_warmup`) runs :func:`warm_fused_layer`: one random decoder layer of the base's
architecture, patched the same way, forward and backward at the step's rows and gradient-free
forwards at a packed evaluation forward's rows. The worker waits for it a few seconds at most
(``plora.runtime.actors.worker.FUSED_WARMUP_WAIT_S``), then stops it: it holds GPU memory that the first
step's plan did not count.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from plora.config import LoRAConfig
from plora.engine.api import EngineSpec, PackRequest
from plora.engine.eval_rows import rows_per_forward
from plora.model_spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupReport:
    """What :func:`warm_pack_kernels` did."""

    shapes: tuple[tuple[int, int, bool], ...] = ()
    """``(in, out, bias)`` of each stand-in layer run forward and backward."""
    tokens: int = 0
    """Tokens of the stand-in step (rows x sequence length)."""
    seconds: float = 0.0
    skipped: str | None = None
    """Why nothing ran (no CUDA, no kernels, an unsupported model), else None."""
    fused_layer_s: float | None = None
    """Seconds of :func:`warm_fused_layer` (Liger-Kernel's ops); None where they were not run."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def failed(cls, e: BaseException) -> WarmupReport:
        """Skipped because of ``e`` (its first line)."""
        return cls(skipped=f"{type(e).__name__}: {e}".splitlines()[0][:200])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WarmupReport:
        shapes = tuple(tuple(s) for s in data.get("shapes", ()))
        return cls(**{**data, "shapes": shapes})


def warm_pack_kernels(
    spec: ModelSpec,
    configs: Sequence[LoRAConfig],
    *,
    seq_len: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    max_rows: int | None = None,
    eval_rows: int | None = None,
) -> WarmupReport:
    """Compile the packed-LoRA kernels one training step (and one packed-evaluation forward) of
    ``configs`` launches.

    Args:
        spec: the base model's shapes (its config; no weights needed).
        configs: the pack, in slot order (slot ``i`` = ``configs[i]``, as the trainer adds them).
        seq_len: the step's padded sequence length (the dataset's ``max_seq_len``).
        device: the CUDA device the pack trains on; anything else returns at once.
        dtype: the base model's compute dtype.
        max_rows: the trainer's micro-batch row limit (None: one micro-batch).
        eval_rows: rows of one packed-evaluation forward to warm as well (0: none; None: the
            rows of a full-width forward, :func:`~plora.engine.eval_rows.rows_per_forward`).

    Returns:
        A :class:`WarmupReport`; failures are logged and reported, never raised (the first step
        compiles whatever is missing).
    """
    from plora.engine.fused import kernel
    from plora.engine.lora import PackedLoRALinear, Routing, module_key

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not configs:
        return WarmupReport(skipped="not a CUDA pack")
    if dtype not in (torch.bfloat16, torch.float16) or kernel() is None:
        return WarmupReport(skipped="no Triton kernels for this dtype")
    t0 = time.perf_counter()
    rows = [c.batch_size for c in configs]
    rows_per_step = step_rows(configs, max_rows)
    if eval_rows is None:
        eval_rows = rows_per_forward(seq_len)
    targets = {t for c in configs for t in c.target_modules}
    shapes: dict[tuple[int, int, bool], str] = {}  # one stand-in per distinct shape
    for name in spec.projection_shapes:
        if name in targets:
            shapes.setdefault((*spec.projection_shape(name), spec.has_bias(name)), name)
    try:
        for (fan_in, fan_out, bias), name in shapes.items():
            base = nn.Linear(fan_in, fan_out, bias=bias, device=device, dtype=dtype)
            layer = PackedLoRALinear(base, key=module_key(0, name))
            segments, start = [], 0
            for slot, (cfg, n) in enumerate(zip(configs, rows, strict=True)):
                layer.add_slot(
                    slot, rank=cfg.rank, scale=cfg.scale, dropout=cfg.dropout, seed=cfg.seed
                )
                take = max(0, min(n, rows_per_step - start))
                segments.append((slot, start, start + take))
                start += take
            layer.routing = Routing(
                segments=tuple(s for s in segments if s[2] > s[1]),
                dropout_keys={s: (0, 0) for s in range(len(configs))},
            )
            x = torch.randn(rows_per_step, seq_len, fan_in, device=device, dtype=dtype)
            x.requires_grad_(True)
            y = layer(x)
            y.backward(torch.randn_like(y))
            if eval_rows:  # packed evaluation: forward only, eval mode (no dropout)
                layer.eval()
                half = eval_rows // 2 if len(configs) > 1 else eval_rows  # two slots' rows
                pieces = ((0, 0, half), (1, half, eval_rows)) if half < eval_rows else ()
                layer.routing = Routing(segments=pieces or ((0, 0, eval_rows),))
                with torch.no_grad():
                    layer(torch.randn(eval_rows, seq_len, fan_in, device=device, dtype=dtype))
            del x, y, layer, base
        _warm_cross_entropy(spec.vocab_size, device=device, dtype=dtype)
        torch.cuda.synchronize(device)
    except Exception as e:  # never fatal: the first step compiles what is missing
        report = WarmupReport.failed(e)
        log.warning("kernel warm-up skipped: %s", report.skipped)
        return report
    return WarmupReport(
        shapes=tuple(shapes),
        tokens=rows_per_step * seq_len,
        seconds=time.perf_counter() - t0,
    )


def step_rows(configs: Sequence[LoRAConfig], max_rows: int | None) -> int:
    """Rows of one (micro-batch) step of ``configs``: their batch sizes, at most ``max_rows``."""
    total = sum(c.batch_size for c in configs)
    return min(max_rows or total, total)


def _warm_cross_entropy(vocab: int, *, device: torch.device, dtype: torch.dtype) -> None:
    """The packed loss's cross-entropy kernel, with and without the gradient, at the
    vocabulary's width (the training step and the packed evaluation launch both)."""
    from plora.kernels.cross_entropy import cross_entropy_

    logits = torch.randn(2, vocab, device=device, dtype=dtype)
    targets = torch.zeros(2, dtype=torch.long, device=device)
    cross_entropy_(logits, targets)
    cross_entropy_(logits, targets, torch.ones(2, device=device))


def warm_fused_layer(
    model_ref: str,
    setting: str,
    *,
    rows: int,
    seq_len: int,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> bool:
    """Compile Liger-Kernel's RMSNorm, SwiGLU and RoPE as the pack's steps and its packed
    evaluation launch them (:func:`plora.engine.liger.apply_fused_kernels`): one decoder layer of
    the base's architecture, random frozen weights, forward and backward on ``rows`` rows (the
    input requiring the gradient, as the LoRA factors make it), then forwards without gradients
    on a full-width evaluation forward's rows (:func:`~plora.engine.eval_rows.rows_per_forward`).
    Whether the ops are fused here (``setting``: ``training.fused_kernels``); errors are the
    caller's.

    RoPE's kernel compiles per row count and per whether the row width is a multiple of 16
    (Triton specializes integer arguments so): the step runs at the graphed steps' width (a
    length bucket, :func:`~plora.engine.graphed.bucket_length`) and one token shorter (the
    first, eager step's width is its longest row's), the evaluation at a width divisible by 16
    and one token shorter (its forwards' widths are their longest rows')."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from plora.engine.graphed import bucket_length
    from plora.engine.liger import apply_fused_kernels

    cfg = AutoConfig.from_pretrained(model_ref)
    cfg.num_hidden_layers = 1
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:1]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.requires_grad_(False)
    if not apply_fused_kernels(model, setting, device=device):
        return False
    decoder, embed = model.get_decoder(), model.get_input_embeddings()

    def run(n: int, width: int, *, grad: bool) -> None:
        ids = torch.randint(0, cfg.vocab_size, (n, width), device=device)
        with torch.set_grad_enabled(grad):
            x = embed(ids).requires_grad_(grad)
            hidden = decoder(inputs_embeds=x, use_cache=False)[0]
            if grad:
                hidden.backward(torch.ones_like(hidden))

    step = bucket_length(seq_len)
    for width in (step, step - 1):
        run(rows, width, grad=True)
    scored = max(17, seq_len // 16 * 16)
    for width in (scored, scored - 1):
        run(rows_per_forward(seq_len), width, grad=False)
    return True


def start_warmup(spec: EngineSpec, request: PackRequest) -> subprocess.Popen[str] | None:
    """Start :func:`warm_pack_kernels` for ``request``'s pack in a child process (None off CUDA).

    A child, not a thread: Triton's compiler holds the GIL for much of its work, so a thread
    slowed the parent's imports as much as it saved (measured on the lent H100). The child
    compiles on its own core into Triton's on-disk cache, which the parent's first step reads.
    The caller owns the process (:func:`finish_warmup`).
    """
    if not _cuda_pack(spec, request):
        return None
    job = {
        "model": spec.model.name_or_path,
        "configs": [c.to_dict() for c in request.configs],
        "seq_len": spec.dataset.max_seq_len,
        "max_rows": request.rows_limit(spec.max_rows),
    }
    return spawn_warmup(job)


def start_fused_warmup(spec: EngineSpec, request: PackRequest) -> subprocess.Popen[str] | None:
    """Start :func:`warm_fused_layer` for ``request``'s pack in a child process of its own,
    beside :func:`start_warmup`'s (None off CUDA or with ``training.fused_kernels: off``).

    Its own process: it imports transformers and builds a layer, which the packed kernels' child
    need not wait for (what it has not cached when it is stopped, the first step compiles)."""
    if not _cuda_pack(spec, request) or str(spec.fused_kernels) == "off":
        return None
    job = {
        "part": "fused",
        "model": spec.model.name_or_path,
        "fused_kernels": str(spec.fused_kernels),
        "rows": step_rows(request.configs, request.rows_limit(spec.max_rows)),
        "seq_len": spec.dataset.max_seq_len,
    }
    return spawn_warmup(job)


def _cuda_pack(spec: EngineSpec, request: PackRequest) -> bool:
    """Whether ``request``'s pack has configs and trains on CUDA here (what a warm-up needs)."""
    on_cuda = (spec.device or "cuda").startswith("cuda") and torch.cuda.is_available()
    return on_cuda and bool(request.configs)


def spawn_warmup(job: dict[str, Any]) -> subprocess.Popen[str]:
    """``python -m plora.engine.warmup`` with ``job`` (model, configs as dicts, seq_len,
    max_rows) on its stdin."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "plora.engine.warmup"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    stdin, proc.stdin = proc.stdin, None  # written here, so communicate() only reads
    assert stdin is not None
    with stdin:
        stdin.write(json.dumps(job))
    return proc


def finish_warmup(proc: subprocess.Popen[str] | None, timeout_s: float = 0.0) -> WarmupReport:
    """The child's report: waits up to ``timeout_s``, then stops a child still compiling (what
    it has not cached yet, the first step compiles)."""
    if proc is None:
        return WarmupReport(skipped="no warm-up process")
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return WarmupReport(skipped="still compiling when the first step began")
    except Exception as e:  # never the job's failure: its first step compiles instead
        return WarmupReport.failed(e)
    try:
        return WarmupReport.from_dict(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError):
        return WarmupReport(skipped=f"warm-up process exited with {proc.returncode}")


def _main() -> None:
    """``python -m plora.engine.warmup``: one :func:`start_warmup` job (JSON on stdin); with
    ``"part": "fused"`` (:func:`start_fused_warmup`), Liger-Kernel's ops instead."""
    job = json.loads(sys.stdin.read())
    if job.get("part") == "fused":
        report = _fused_layer_report(job)
    else:
        try:
            model = ModelSpec.from_hf_config(job["model"])
        except Exception as e:  # an architecture plora cannot read ahead: the first step compiles
            report = WarmupReport.failed(e)
        else:
            configs = [LoRAConfig.from_dict(c) for c in job["configs"]]
            report = warm_pack_kernels(
                model, configs, seq_len=job["seq_len"], device="cuda", max_rows=job["max_rows"]
            )
    print(json.dumps(report.to_dict()), flush=True)


def _fused_layer_report(job: dict[str, Any]) -> WarmupReport:
    """:func:`warm_fused_layer` for ``job`` (model, fused_kernels, rows, seq_len), reported."""
    t0 = time.perf_counter()
    try:
        fused = warm_fused_layer(
            job["model"], job["fused_kernels"], rows=job["rows"], seq_len=job["seq_len"]
        )
        torch.cuda.synchronize()
    except Exception as e:  # the first step compiles them instead
        return WarmupReport.failed(e)
    if not fused:
        return WarmupReport(skipped="Liger-Kernel's ops are not used here")
    took = time.perf_counter() - t0
    return WarmupReport(tokens=job["rows"] * job["seq_len"], seconds=took, fused_layer_s=took)


if __name__ == "__main__":
    _main()


__all__ = [
    "WarmupReport",
    "finish_warmup",
    "spawn_warmup",
    "start_fused_warmup",
    "start_warmup",
    "warm_fused_layer",
    "warm_pack_kernels",
]
