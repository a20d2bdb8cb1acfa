"""Small shared helpers: atomic file writes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike[str], *, tmp_dir: str | os.PathLike[str] | None = None
) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (or in ``tmp_dir``, on the same filesystem); on
    success rename it over ``path``.

    Works for files and directories. On error the temporary is removed and ``path`` is left
    untouched, so readers never see a half-written file. ``tmp_dir`` keeps the temporary out of
    a directory that another process copies as it changes (Tune's driver staging directory).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    where = path.parent if tmp_dir is None else Path(tmp_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=where)) / "tmp"
    try:
        yield tmp
        if path.is_dir() and not path.is_symlink():
            old = path.with_name(f".{path.name}.old.{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def atomic_write_bytes(
    path: str | os.PathLike[str], data: bytes, *, tmp_dir: str | os.PathLike[str] | None = None
) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename; see
    :func:`atomic_path` for ``tmp_dir``)."""
    with atomic_path(path, tmp_dir=tmp_dir) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(
    path: str | os.PathLike[str], text: str, *, tmp_dir: str | os.PathLike[str] | None = None
) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode(), tmp_dir=tmp_dir)


def atomic_write_json(
    path: str | os.PathLike[str], obj: Any, *, tmp_dir: str | os.PathLike[str] | None = None
) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"
    atomic_write_text(path, text, tmp_dir=tmp_dir)


def fmt_duration(seconds: float) -> str:
    """``3725 -> '1h 02m'``, ``95 -> '1m 35s'``, ``4.2 -> '4.2s'``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, s = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {s:02d}s"
    hours, m = divmod(minutes, 60)
    return f"{hours}h {m:02d}m"


def torchao_first() -> None:
    """Import torchao quietly (:func:`import_torchao_quietly`) when it is installed and not yet
    imported: modules that import transformers or peft call this first. A torchao that does not
    import is left to transformers / peft to report."""
    import importlib.util

    if "torchao" not in sys.modules and importlib.util.find_spec("torchao") is not None:
        with contextlib.suppress(ImportError):
            import_torchao_quietly()


def import_torchao_quietly() -> Any:
    """Import torchao's NF4 module with warnings off during torchao's first import.

    On a machine without CUDA, torchao logs a warning for each CUDA-only extension it cannot
    load (the MX/CUTLASS kernels, which NF4 does not use) and torch one per enum torchao
    registers with torch.compile. transformers imports torchao (and its safetensors support)
    inside ``from_pretrained`` whenever it is installed, so :func:`plora.models.load_model`
    imports both first, through here. ``logging.disable`` is the switch that holds: torch's logging set-up resets
    per-logger levels during the import.
    """
    import logging

    previous = logging.root.manager.disable
    if "torchao" not in sys.modules:
        logging.disable(logging.WARNING)
    try:
        try:
            from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
        except ImportError:  # torchao < 0.15 kept it here
            from torchao.dtypes import nf4tensor as nf4_tensor

        with contextlib.suppress(ImportError):  # what transformers imports (registers MX enums)
            import torchao.prototype.safetensors.safetensors_support  # noqa: F401
    finally:
        logging.disable(previous)
    return nf4_tensor
