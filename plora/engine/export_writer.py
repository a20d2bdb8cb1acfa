"""PEFT exports written off a job's critical path: :class:`ExportWriter`.

A job takes a finished adapter's snapshot on its own thread
(:func:`plora.engine.checkpoint.snapshot_weights`: the weights on the host, independent of the
slot from then on) and hands the files to an ``ExportWriter``; its one background thread writes
them (:func:`plora.engine.checkpoint.write_peft_adapter`, atomically) in the order they came,
while the job evaluates the same adapters and trains on. :meth:`ExportWriter.wait` blocks until
every write handed over so far has finished and raises the first write's error, so a job reports
(or checkpoints) a result only once its adapter directory exists.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from plora.config import LoRAConfig
from plora.engine import checkpoint as ckpt


class ExportWriter:
    """Writes adapter snapshots to PEFT directories on one background thread, in order.

    ``with ExportWriter() as w: ...`` waits for the writes (without raising) and stops the
    thread on the way out; call :meth:`wait` first to get the errors.
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
            ckpt.peft_lora_config(config, base_model_name_or_path=base_model_name_or_path)
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

    def __enter__(self) -> ExportWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _timed_write(
    path: Path, config: LoRAConfig, tensors: dict[str, torch.Tensor], base: str | None
) -> float:
    t0 = time.perf_counter()
    ckpt.write_peft_adapter(path, config=config, tensors=tensors, base_model_name_or_path=base)
    return time.perf_counter() - t0


__all__ = ["ExportWriter"]
