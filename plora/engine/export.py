"""Adapters out in PEFT format, off a job's critical path.

* :func:`export_peft_adapter` writes ``adapter_config.json`` (a ``peft.LoraConfig`` saved by
  peft itself), ``adapter_model.safetensors`` with PEFT's key names
  (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``, float32) and
  ``plora_config.json``, so the directory reloads with ``PeftModel.from_pretrained(base, path)``.
  It is two halves that a job runs apart: :func:`snapshot_weights` (the device->host copy, one
  transfer per chunk, on the job's thread) and :func:`write_peft_adapter` (the files, atomically).
* :class:`ExportWriter` runs the second half on one background thread while the job evaluates
  the same adapters and trains on; :meth:`ExportWriter.wait` blocks until every write handed over
  so far has finished and raises the first write's error, so a job reports (or checkpoints) a
  result only once its adapter directory exists.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from plora.config import LoRAConfig
from plora.utils import atomic_path, torchao_first

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_lora_config(config: LoRAConfig, *, base_model_name_or_path: str | None = None) -> Any:
    """The ``peft.LoraConfig`` equivalent to ``config`` (task type CAUSAL_LM)."""
    torchao_first()  # peft imports torchao (when installed) noisily: quietly first
    from peft import LoraConfig, TaskType

    return LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,  # type: ignore[arg-type]  # peft annotates int; alpha = ratio x rank may be fractional
        target_modules=list(config.target_modules),
        lora_dropout=config.dropout,
        use_rslora=config.use_rslora,
        bias="none",
        task_type=TaskType.CAUSAL_LM,
        base_model_name_or_path=base_model_name_or_path or None,
    )


def adapter_base_name(ref: Any, model_path: str, out_dir: str | os.PathLike[str]) -> str:
    """What an adapter's ``adapter_config.json`` names as its base model -- what
    ``AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` loads, from any working directory:

    * a hub id: the id, as PEFT writes it (loads anywhere the hub or the HF cache is);
    * a built-in tiny model saved in the sweep directory (``base_model/``): that directory's
      absolute path (a copy of the sweep directory loads while it is there; where it is not, load
      the copy's own ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(COPY /
      "base_model"), ...)``);
    * a local model directory: its absolute path (not copied into the sweep).

    Args:
        ref: the sweep's :class:`~plora.config.ModelRef`.
        model_path: where the base model was loaded from (``plora.models.resolve_model_path``).
        out_dir: the sweep directory the adapters are written into.
    """
    from plora.models import is_builtin
    from plora.sweepdir.schema import BASE_MODEL_DIR

    builtin = is_builtin(ref)
    if builtin and (Path(out_dir) / BASE_MODEL_DIR).is_dir():
        return str((Path(out_dir) / BASE_MODEL_DIR).absolute())
    name = ref if isinstance(ref, str) else str(getattr(ref, "name_or_path", model_path))
    if not builtin and not Path(name).expanduser().exists():
        return name  # a hub id
    return str(Path(model_path).expanduser().absolute())


def export_peft_adapter(
    path: str | os.PathLike[str],
    *,
    config: LoRAConfig,
    weights: Mapping[str, torch.Tensor],
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write one adapter as a PEFT directory at ``path`` (atomically, replacing it):
    :func:`snapshot_weights`, then :func:`write_peft_adapter`.

    Args:
        config: the adapter's config (rank, alpha, targets, dropout, rsLoRA).
        weights: PEFT-keyed tensors (``plora.engine.adapters.adapter_state_dict``).
        base_model_name_or_path: recorded in ``adapter_config.json``.
    """
    return write_peft_adapter(
        path,
        config=config,
        tensors=snapshot_weights(weights),
        base_model_name_or_path=base_model_name_or_path,
    )


#: Most bytes of one device->host transfer of :func:`snapshot_weights` (bounds the temporary
#: float32 buffer it concatenates on the device).
SNAPSHOT_CHUNK_BYTES = 256 * 2**20


def snapshot_weights(
    weights: Mapping[str, torch.Tensor], *, chunk_bytes: int = SNAPSHOT_CHUNK_BYTES
) -> dict[str, torch.Tensor]:
    """float32 CPU copies of PEFT-keyed ``weights`` (same keys, order and shapes), taken now.

    The tensors of one device are flattened and concatenated there and cross to the host in one
    transfer per ``chunk_bytes`` (into pinned memory from CUDA) instead of one synchronising copy
    per tensor; the result's tensors are views of that host buffer. They never alias ``weights``,
    so the slot may be trained, removed or reused while they are written
    (:func:`write_peft_adapter`).

    Raises:
        ValueError: ``weights`` is empty or not PEFT-keyed.
    """
    bad = [k for k in weights if not k.startswith("base_model.model.")]
    if bad or not weights:
        raise ValueError(f"not PEFT-keyed adapter weights: {bad[:2] or 'empty'}")
    chunks: list[list[str]] = []  # consecutive keys of one device, <= chunk_bytes each
    nbytes = 0
    for key, value in weights.items():
        same = bool(chunks) and weights[chunks[-1][0]].device == value.device
        if same and nbytes + 4 * value.numel() <= chunk_bytes:
            chunks[-1].append(key)
            nbytes += 4 * value.numel()
        else:
            chunks.append([key])
            nbytes = 4 * value.numel()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for keys in chunks:
            # one concatenation (a new buffer: never the live weights), one conversion; exact
            # (bf16 and fp16 widen to float32 losslessly, whichever comes first)
            flat = torch.cat([weights[k].detach().reshape(-1) for k in keys]).to(torch.float32)
            if flat.device.type == "cuda":
                host = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                torch.cuda.current_stream(flat.device).synchronize()  # the one sync
                flat = host
            elif flat.device.type != "cpu":
                flat = flat.to("cpu")
            offset = 0
            for k in keys:
                n = weights[k].numel()
                out[k] = flat[offset : offset + n].view(weights[k].shape)
                offset += n
    return {k: out[k] for k in weights}


def write_peft_adapter(
    path: str | os.PathLike[str],
    *,
    config: LoRAConfig,
    tensors: Mapping[str, torch.Tensor],
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write a PEFT directory at ``path`` (atomically, replacing it) from CPU float32
    ``tensors`` (:func:`snapshot_weights`): ``adapter_config.json``,
    ``adapter_model.safetensors`` and ``plora_config.json``. Safe on a background thread."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.mkdir()
        peft_lora_config(config, base_model_name_or_path=base_model_name_or_path).save_pretrained(
            str(tmp)
        )
        save_file(dict(tensors), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / "plora_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return path


class ExportWriter:
    """Writes adapter snapshots to PEFT directories on one background thread, in order.

    :meth:`wait` collects the writes and their errors; :meth:`close` (always, at the end of a
    job) waits for what is left and stops the thread.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[str, Future[float]]] = []

    @property
    def pending(self) -> int:
        """Writes handed over and not yet collected by :meth:`wait`."""
        return len(self._pending)

    def submit(
        self,
        config_id: str,
        path: str | os.PathLike[str],
        *,
        config: LoRAConfig,
        tensors: dict[str, torch.Tensor],
        base_model_name_or_path: str | None = None,
    ) -> None:
        """Queue the PEFT directory of ``config_id`` at ``path`` from its snapshot ``tensors``
        (CPU tensors nothing else writes to)."""
        if self._pool is None:
            # peft (and what it imports, quietly: plora.utils.torchao_first) on this thread
            peft_lora_config(config, base_model_name_or_path=base_model_name_or_path)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plora-export")
        future = self._pool.submit(
            _timed_write, Path(path), config, tensors, base_model_name_or_path
        )
        self._pending.append((config_id, future))

    def wait(self) -> dict[str, float]:
        """Block until every queued write finished; ``{config_id: seconds its write took}``.

        Raises:
            Exception: the first failed write's own error (after all of them finished; a failed
                write leaves no directory behind, :func:`plora.utils.atomic_path`).
        """
        pending, self._pending = self._pending, []
        seconds: dict[str, float] = {}
        error: BaseException | None = None
        for cid, future in pending:
            try:
                seconds[cid] = seconds.get(cid, 0.0) + future.result()
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error
        return seconds

    def raise_failed(self) -> None:
        """Raise the error of the first write that already failed (without waiting)."""
        for _, future in self._pending:
            if future.done() and future.exception() is not None:
                self.wait()  # the others finish; raises the first error

    def close(self) -> None:
        """Wait for the queued writes (their errors dropped) and stop the thread."""
        for _, future in self._pending:
            future.exception()  # waits
        self._pending = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _timed_write(
    path: Path, config: LoRAConfig, tensors: dict[str, torch.Tensor], base: str | None
) -> float:
    t0 = time.perf_counter()
    write_peft_adapter(path, config=config, tensors=tensors, base_model_name_or_path=base)
    return time.perf_counter() - t0


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "SNAPSHOT_CHUNK_BYTES",
    "ExportWriter",
    "adapter_base_name",
    "export_peft_adapter",
    "peft_lora_config",
    "snapshot_weights",
    "write_peft_adapter",
]
