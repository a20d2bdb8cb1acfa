"""Whether a base model named by a Hugging Face hub id can be loaded here, answered in seconds.

``from_pretrained`` on a machine without network retries for about a minute and then raises a
long traceback; :func:`check_hub_model` answers first, with one :class:`ConfigError`:

* a built-in tiny model or a local directory: nothing to check;
* ``config.json`` of the id in the local HF cache: loadable offline, nothing to check;
* ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set and not cached: error, without any network;
* otherwise one HEAD request for ``config.json`` with a short timeout (no retries): an
  unreachable hub, an unknown or gated repo is an error naming what to do.

``HF_ENDPOINT`` and ``HF_TOKEN`` are honoured as by ``huggingface_hub``.
"""

from __future__ import annotations

import os
from typing import Any

from plora.config import ConfigError

#: Seconds the hub check waits for the hub before calling it unreachable.
HUB_TIMEOUT_S = 5.0
_KEY = "model.name_or_path"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set to a true value."""
    return any(
        os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def check_hub_model(ref: Any, *, timeout_s: float = HUB_TIMEOUT_S, file: str | None = None) -> None:
    """Raise :class:`ConfigError` unless ``ref`` (a :class:`~plora.config.ModelRef`) can be
    loaded: see the module docstring. Never takes much longer than ``timeout_s``."""
    from pathlib import Path

    from huggingface_hub import try_to_load_from_cache

    name = str(ref.name_or_path)
    if getattr(ref, "is_builtin", False) or Path(name).expanduser().exists():
        return
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    if hub_offline():
        raise ConfigError(
            "hub model not in the local Hugging Face cache and HF_HUB_OFFLINE is set",
            key=_KEY, value=name, file=file,
            fix=f"download it first (`hf download {name}`) or give a local model directory",
        )  # fmt: skip
    _probe(name, timeout_s=timeout_s, file=file)


def _probe(name: str, *, timeout_s: float, file: str | None) -> None:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        get_hf_file_metadata(
            hf_hub_url(name, "config.json", endpoint=endpoint), timeout=timeout_s, endpoint=endpoint
        )
    except GatedRepoError:
        raise ConfigError(
            "gated model: this account may not download it", key=_KEY, value=name, file=file,
            fix="accept its licence on the hub and log in (`hf auth login` or HF_TOKEN)",
        ) from None  # fmt: skip
    except RepositoryNotFoundError:
        raise ConfigError(
            "no such model on the Hugging Face hub (or it is private)", key=_KEY, value=name,
            file=file, fix="check the id, log in for a private model, or give a local directory",
        ) from None  # fmt: skip
    except Exception as err:  # connection refused, DNS, timeout, proxy: httpx/requests types
        cause = type(err).__name__
        raise ConfigError(
            f"cannot reach the Hugging Face hub within {timeout_s:g}s ({cause})",
            key=_KEY, value=name, file=file,
            fix="check the network (or HF_ENDPOINT), or download the model and give its local "
            "directory, or set HF_HUB_OFFLINE=1 if it is in the cache",
        ) from None  # fmt: skip


__all__ = ["HUB_TIMEOUT_S", "check_hub_model", "hub_offline"]
