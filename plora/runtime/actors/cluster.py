"""The Ray cluster a sweep runs on: connecting (or starting a local one), and its GPU pool.

Every problem a user can fix (an unreachable ``--address``, too few GPUs) is a one-line
:class:`~plora.config.ConfigError` raised before anything is started.

A local cluster this process starts is watched by :mod:`plora.runtime.actors.reaper`: if the driver
dies without :func:`shutdown`, the cluster's processes (Ray's agents included) are stopped too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from plora.config import ConfigError

#: The environment of every worker process of a sweep: no usage report; no tokenizers thread
#: pool (a forked worker process would deadlock in it).
WORKER_ENV: dict[str, str] = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}


def connect(address: str | None, *, num_gpus: int, cpu: bool = False) -> bool:
    """Connect to Ray; returns True when this call started a local (embedded) cluster.

    ``address`` None and no ``RAY_ADDRESS``: start a local Ray (or use a ``ray start`` one of this
    machine); ``local``: always start a new local Ray. On a machine without CUDA it gets
    ``num_gpus`` *logical* GPUs so jobs can be placed (the engine then runs on CPU), unless the
    sweep runs on CPU (``cpu``: ``hardware.gpu_type: cpu``), whose workers ask Ray for CPUs only.
    Otherwise connect to ``address`` (``auto``, ``ray://...`` or ``host:port``). Call
    :func:`shutdown` when done.

    The workers get :data:`WORKER_ENV`: a local cluster started here through its processes'
    environment (``os.environ`` holds it while ``ray.init`` runs, as it was afterwards but for
    ``RAY_USAGE_STATS_ENABLED=0``, which Ray sets itself for a cluster it starts), so the
    sweep's actors can use the workers Ray prestarts; a ``ray start`` cluster of this machine
    through the job's ``runtime_env``.

    Raises:
        ConfigError: the address cannot be reached.
    """
    if ray.is_initialized():
        return False
    where = "--address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS") or None
    runtime_env = {"env_vars": dict(WORKER_ENV)}
    if address is None or address == "local":
        kwargs: dict[str, Any] = {"address": address}
        if not cpu and not ray_finds_gpus():
            kwargs["num_gpus"] = num_gpus
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray's start-up lines (local instance started, token set-up) are not the user's news:
        # the embedded cluster starts quietly, later warnings of Ray still show.
        quiet: dict[str, Any] = {"logging_level": logging.ERROR}
        try:
            if starts_local(address):
                # The raylet started here and every worker it forks inherit this process's
                # environment, so the workers Ray prestarts at init already have WORKER_ENV and
                # the sweep's actors can use them; with a job runtime_env each actor would need a
                # fresh worker process started for it (seconds: the resident worker's start).
                # (ray.init sets RAY_USAGE_STATS_ENABLED=0 here itself for a cluster it starts;
                # the driver's other settings are its user's and come back after it)
                os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
                with _environ(WORKER_ENV):
                    ray.init(include_dashboard=False, log_to_driver=False, **quiet, **kwargs)
            else:  # a `ray start` cluster of this machine: its workers need the runtime_env
                ray.init(
                    include_dashboard=False,
                    log_to_driver=False,
                    runtime_env=runtime_env,
                    **quiet,
                    **kwargs,
                )
        except ValueError:  # a `ray start` cluster on this machine was found: use it as it is
            if "num_gpus" not in kwargs:
                raise
            ray.init(include_dashboard=False, log_to_driver=False, runtime_env=runtime_env, **quiet)
            return False
        finally:
            logging.getLogger("ray").setLevel(logging.WARNING)
        global _REAPER
        from plora.runtime.actors.reaper import start_reaper

        _REAPER = start_reaper()
        return True
    check_address(address)
    try:  # the job's runtime_env (``ray job submit --working-dir``) is left as submitted
        # quiet as a local start: Ray's "Connecting to / Connected to" lines are not news (a
        # ray:// client would forward the level to the server's ray.init: left as it is)
        quiet = {} if "://" in address else {"logging_level": logging.ERROR}
        ray.init(address=address, log_to_driver=False, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{where} {address}: cannot connect to a Ray cluster ({first}); start one with "
            "`ray start --head` or drop --address to run locally"
        ) from None
    finally:
        logging.getLogger("ray").setLevel(logging.WARNING)
    return False


def starts_local(address: str | None) -> bool:
    """Whether ``ray.init(address=address)`` starts a new local cluster, rather than joining the
    ``ray start`` cluster of this machine that Ray finds for ``address`` None, decided as Ray
    decides it: ``RAY_ADDRESS``, then the address file of the last ``ray start``
    (``ray._private.services.get_ray_address_from_environment``). Ray's own lookup also scans
    every running process for other clusters, only to warn when it finds several (0.5-1 s on a
    slow host, and ``ray.init`` scans again): this reads the file alone."""
    if address == "local":
        return True
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:  # an address (or "auto": any running cluster) is joined, never started
        return False
    try:
        from ray._private.utils import read_ray_address

        return read_ray_address() is None
    except Exception:  # Ray's internals moved or the lookup failed: the runtime_env works anywhere
        return False


def ray_finds_gpus() -> bool:
    """Whether a Ray started on this machine finds GPUs (:func:`local_gpu_count` > 0)."""
    return local_gpu_count() > 0


def local_gpu_count() -> int:
    """The GPUs a Ray started on this machine finds, counted as ``ray.init`` counts them
    (``CUDA_VISIBLE_DEVICES``, then NVML), without importing torch: ``torch.cuda`` costs the
    driver torch's import (3-5 s on a slow host), right before ``ray.init``."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        gpus = get_accelerator_manager_for_resource("GPU")
        if gpus is None:
            return _torch_gpu_count()
        visible = gpus.get_current_process_visible_accelerator_ids()
        if visible is not None:
            return len(visible)
        return int(gpus.get_current_node_num_accelerators())
    except Exception:  # Ray's internals moved: ask torch
        return _torch_gpu_count()


def check_local_gpus(num_gpus: int, *, cpu: bool = False, address: str | None = None) -> None:
    """Before a local Ray is started for the sweep (``address`` None or ``local``, no
    ``RAY_ADDRESS``, no ``ray start`` cluster here): ConfigError when this machine has GPUs but
    fewer than ``num_gpus``. Without any, Ray gets ``num_gpus`` logical ones (:func:`connect`:
    the engine runs on the CPU); a cluster that is joined is checked by :func:`check_gpus` once
    connected."""
    if cpu or not starts_local(address):
        return
    have = local_gpu_count()
    if 0 < have < num_gpus:
        raise ConfigError(
            f"the sweep wants {num_gpus} GPUs but this machine has {have} (as Ray counts them: "
            "CUDA_VISIBLE_DEVICES, else all it finds)", key="hardware.num_gpus", value=num_gpus,
            fix=f"lower hardware.num_gpus to {have}, or run on a Ray cluster with {num_gpus} "
            "GPUs (plora sweep --address, or RAY_ADDRESS)",
        )  # fmt: skip


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``values`` inside the block, as it was after it (the user's
    process, a notebook calling :func:`plora.api.run`, keeps its own settings)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_REAPER: Any = None  # the watchdog of the local cluster this process started


def shutdown(*, started: bool) -> None:
    """``ray.shutdown()`` when this process ``started`` its cluster (:func:`connect`), and stop
    its watchdog (nothing is left to stop)."""
    global _REAPER
    if started:
        ray.shutdown()
    if _REAPER is not None:
        _REAPER.release()
        _REAPER = None


#: Set by Ray's job supervisor in the environment of a ``ray job submit`` entrypoint.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def in_ray_job() -> bool:
    """Whether this process is the entrypoint of a ``ray job submit`` (or a Ray job's driver)."""
    return bool(os.environ.get(RAY_JOB_ENV) or os.environ.get("RAY_JOB_ID"))


def check_job_out(out: str | os.PathLike[str]) -> None:
    """Refuse a relative sweep directory under ``ray job submit``: the entrypoint runs in Ray's
    temporary copy of ``--working-dir``, on the head node only, which Ray deletes -- the sweep
    would land there unseen. ConfigError naming what to give instead."""
    if in_ray_job() and not Path(out).expanduser().is_absolute():
        raise ConfigError(
            f"--out {out}: a relative sweep directory under `ray job submit` would be written "
            f"into Ray's temporary copy of --working-dir ({Path.cwd()}), which Ray deletes; give "
            f"an absolute path on storage every node mounts, e.g. --out /mnt/shared/runs/{Path(out).name}"
        )


def check_address(address: str | None, *, timeout_s: float = 3.0) -> None:
    """Fail fast on an unreachable ``host:port`` (Ray itself retries for minutes)."""
    where = "--address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None or address == "auto" or address.startswith("local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"{where} {address}: not host:port, ray://host:port or auto; "
            "e.g. --address 10.0.0.1:6379"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"{where} {address}: cannot reach a Ray cluster ({e.strerror or e}); start one with "
            "`ray start --head` or drop --address to run locally"
        ) from None


def check_gpus(num_gpus: int, *, cpu: bool = False, max_degree: int = 1) -> float:
    """The cluster's GPU count (CPU count for a CPU sweep); ConfigError (keyed
    ``hardware.num_gpus``) when it has fewer GPUs than the sweep wants, or no node with
    ``max_degree`` GPUs (the most a job may span: a job's workers share one node,
    :func:`plora.runtime.actors.group.start_group`), or, on CPU (``hardware.gpu_type: cpu``: the "GPUs"
    are worker slots that ask Ray for CPUs only, :func:`worker_resources`), no CPU at all."""
    if cpu:
        cpus = float(ray.cluster_resources().get("CPU", 0.0))
        if cpus <= 0:
            raise ConfigError(
                "the Ray cluster has no CPUs for the sweep's workers", key="hardware.gpu_type",
                value="cpu", fix="add nodes with CPUs",
            )  # fmt: skip
        return cpus
    have = float(ray.cluster_resources().get("GPU", 0.0))
    if have < num_gpus:
        raise ConfigError(
            f"the sweep wants {num_gpus} GPUs but the Ray cluster has {have:g}",
            key="hardware.num_gpus", value=num_gpus,
            fix=f"lower hardware.num_gpus to {have:g} or less, or add GPU nodes",
        )  # fmt: skip
    if max_degree > 1:
        node = max(
            (float(n.get("Resources", {}).get("GPU", 0.0)) for n in ray.nodes() if n.get("Alive")),
            default=0.0,
        )
        if node < max_degree:
            raise ConfigError(
                f"with planner.strategies a job may span {max_degree} GPUs, but the largest node "
                f"of the Ray cluster has {node:g} (a job's GPUs share one node)",
                key="hardware.num_gpus", value=num_gpus,
                fix=f"lower hardware.num_gpus to {node:g}, or remove planner.strategies "
                "(one-GPU jobs use every node)",
            )  # fmt: skip
    return have


def cpus_per_worker(*, cpu_slots: int | None = None) -> float:
    """CPUs to reserve per worker: 1, or the cluster's CPU/GPU ratio when smaller; for a CPU
    sweep of ``cpu_slots`` workers, its CPUs over the slots (over the GPUs, as GPU workers get,
    when the cluster has more) when smaller than 1."""
    res = ray.cluster_resources()
    gpus = float(res.get("GPU", 0.0))
    over = max(float(cpu_slots), gpus) if cpu_slots else (gpus or 1.0)
    return max(0.01, min(1.0, float(res.get("CPU", 1.0)) / over))


def worker_resources(*, cpu: bool, num_slots: int) -> tuple[float, int]:
    """``(cpus, gpus)`` each worker asks Ray for: a GPU and up to one CPU, or, for a CPU sweep
    (``hardware.gpu_type: cpu``), CPUs only -- so it runs on CPU nodes without GPUs."""
    if cpu:
        return cpus_per_worker(cpu_slots=num_slots), 0
    return cpus_per_worker(), 1


def _torch_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover
        return 0


__all__ = [
    "RAY_JOB_ENV",
    "WORKER_ENV",
    "check_address",
    "check_gpus",
    "check_job_out",
    "check_local_gpus",
    "connect",
    "cpus_per_worker",
    "in_ray_job",
    "local_gpu_count",
    "ray_finds_gpus",
    "shutdown",
    "starts_local",
    "worker_resources",
]
