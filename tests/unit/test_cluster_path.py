"""The cluster path without a cluster (issue 14, item 5): a CPU sweep (``gpu_type: cpu``) asks Ray
for CPUs only, so it runs on nodes without GPUs; a relative ``--out`` under ``ray job submit`` is
refused before anything starts. The real ``ray job submit`` is tests/ray/test_job_submit.py."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from test_sweep_cli import assert_one_error, no_sweep_dir, run, sweep_file

import plora.runtime.actors.cluster as cluster
import plora.runtime.actors.group as group
import plora.runtime.driver as driver
from plora.config import ConfigError


@pytest.fixture
def no_ray(monkeypatch):
    """Connecting to Ray is where a sweep would start work: make it a visible failure."""

    def connect(*args: Any, **kwargs: Any) -> bool:
        raise AssertionError("reached Ray")

    monkeypatch.setattr(driver, "connect", connect)


@pytest.mark.parametrize("out", [["--out", "runs/qs"], []])
def test_relative_out_under_ray_job_submit_is_refused(tmp_path, monkeypatch, no_ray, out) -> None:
    monkeypatch.setenv(cluster.RAY_JOB_ENV, '{"runtime_env": {"working_dir": "."}}')
    monkeypatch.chdir(tmp_path)
    result = run("sweep", str(sweep_file(tmp_path)), *out)
    assert_one_error(result, "--out runs/", "ray job submit", "absolute path")
    assert not (tmp_path / "runs").exists()


def test_absolute_out_under_ray_job_submit_goes_on(tmp_path, monkeypatch, no_ray) -> None:
    monkeypatch.setenv(cluster.RAY_JOB_ENV, "{}")
    result = run("sweep", str(sweep_file(tmp_path)), "--out", str(tmp_path / "out"))
    assert_one_error(result, "reached Ray")  # past the check; the stub stops it there
    no_sweep_dir(tmp_path / "out")


def test_relative_out_outside_a_job_is_fine(monkeypatch) -> None:
    monkeypatch.delenv(cluster.RAY_JOB_ENV, raising=False)
    monkeypatch.delenv("RAY_JOB_ID", raising=False)
    cluster.check_job_out("runs/qs")  # no error


def test_cpu_sweep_needs_cpus_not_gpus(monkeypatch) -> None:
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert cluster.check_gpus(1, cpu=True) == 2.0
    with pytest.raises(ConfigError, match="wants 1 GPUs but the Ray cluster has 0"):
        cluster.check_gpus(1)
    assert cluster.worker_resources(cpu=True, num_slots=4) == (0.5, 0)
    assert cluster.worker_resources(cpu=True, num_slots=1) == (1.0, 0)
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    assert cluster.worker_resources(cpu=False, num_slots=2) == (1.0, 1)
    # a CPU sweep on a cluster with (logical) GPUs takes no more CPU per worker than GPU workers
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 2.0, "GPU": 8.0})
    assert cluster.worker_resources(cpu=True, num_slots=1) == (0.25, 0)
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {})
    with pytest.raises(ConfigError, match="no CPUs"):
        cluster.check_gpus(1, cpu=True)


def test_worker_group_bundles_have_no_gpu_on_cpu(monkeypatch) -> None:
    bundles: list[list[dict[str, float]]] = []
    options: list[dict[str, Any]] = []

    class Actor:
        def options(self, **kw: Any) -> Actor:
            options.append(kw)
            return self

        def remote(self, **kw: Any) -> Any:
            return self

        class load:  # an actor method handle
            @staticmethod
            def remote() -> str:
                return "ref"

    monkeypatch.setattr(group, "placement_group", lambda b, **kw: bundles.append(b) or "pg")
    monkeypatch.setattr(group, "PlacementGroupSchedulingStrategy", lambda **kw: None)
    monkeypatch.setattr(group, "_worker_cls", lambda: Actor())
    kw = dict(strategy=None, relay=None, engine=None, spec=None, name="g")
    group.start_group((0,), cpus_per_worker=0.5, gpus_per_worker=0, **kw)
    group.start_group((1,), cpus_per_worker=1.0, **kw)
    assert bundles == [[{"CPU": 0.5}], [{"CPU": 1.0, "GPU": 1}]]
    assert [o["num_gpus"] for o in options] == [0, 1]


@pytest.fixture
def fake_init(monkeypatch):
    """``ray.init`` recorded (its kwargs and the worker env vars ``os.environ`` held then)."""
    calls: list[dict[str, Any]] = []
    for key in cluster.WORKER_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster, "ray_finds_gpus", lambda: False)
    monkeypatch.setattr("plora.runtime.actors.reaper.start_reaper", lambda: None)

    def init(**kwargs: Any) -> None:
        env = {k: cluster.os.environ.get(k) for k in cluster.WORKER_ENV}
        calls.append({"kwargs": kwargs, "env": env})

    monkeypatch.setattr(cluster.ray, "init", init)
    return calls


def test_a_local_cluster_gets_the_worker_env_from_the_environment(fake_init, monkeypatch):
    monkeypatch.setattr(cluster, "starts_local", lambda address: True)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # the user's own, kept for the driver
    assert cluster.connect(None, num_gpus=1, cpu=True) is True
    (call,) = fake_init
    assert "runtime_env" not in call["kwargs"]  # actors may use the workers Ray prestarts
    assert call["env"] == cluster.WORKER_ENV  # the raylet and its workers inherit these
    assert cluster.os.environ["TOKENIZERS_PARALLELISM"] == "true"
    assert cluster.os.environ["RAY_USAGE_STATS_ENABLED"] == "0"  # the driver's, as before


def test_a_ray_start_cluster_gets_the_worker_env_as_runtime_env(fake_init, monkeypatch):
    monkeypatch.setattr(cluster, "starts_local", lambda address: False)
    cluster.connect(None, num_gpus=1, cpu=True)
    (call,) = fake_init
    assert call["kwargs"]["runtime_env"] == {"env_vars": cluster.WORKER_ENV}
    assert "TOKENIZERS_PARALLELISM" not in cluster.os.environ


def test_the_value_error_fallback_keeps_the_runtime_env(fake_init, monkeypatch):
    """``num_gpus`` given while Ray finds a `ray start` cluster: ValueError, then join it."""
    monkeypatch.setattr(cluster, "starts_local", lambda address: True)
    first: list[bool] = []

    def init(**kwargs: Any) -> None:
        fake_init.append({"kwargs": kwargs})
        if not first:
            first.append(True)
            raise ValueError("When connecting to an existing cluster, num_gpus must not be given")

    monkeypatch.setattr(cluster.ray, "init", init)
    assert cluster.connect(None, num_gpus=2) is False
    assert fake_init[0]["kwargs"]["num_gpus"] == 2 and "runtime_env" not in fake_init[0]["kwargs"]
    assert fake_init[1]["kwargs"]["runtime_env"] == {"env_vars": cluster.WORKER_ENV}
    assert "TOKENIZERS_PARALLELISM" not in cluster.os.environ  # restored after the failed init


def test_starts_local_follows_ray(monkeypatch):
    from ray._private.services import canonicalize_bootstrap_address

    assert cluster.starts_local("local")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # on this machine, as Ray itself decides it (its lookup scans the processes too)
    assert cluster.starts_local(None) == (canonicalize_bootstrap_address(None) is None)  # type: ignore[arg-type]
    monkeypatch.setattr(
        "ray._private.utils.read_ray_address", lambda temp_dir=None: "10.0.0.2:6379"
    )
    assert not cluster.starts_local(None)  # the last `ray start`'s cluster is joined
    monkeypatch.setattr("ray._private.utils.read_ray_address", lambda temp_dir=None: None)
    assert cluster.starts_local(None)
    assert not cluster.starts_local("auto")  # any running cluster, never a new one
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # Ray would join that one
    assert not cluster.starts_local(None)


def test_ray_finds_gpus_as_ray_counts_them_without_torch():
    """The driver asks before ``ray.init`` whether Ray will see GPUs (else it gives Ray logical
    ones); asking must not import torch (seconds on a slow host). The GPU machine's side:
    ``tests/gpu/test_engine_gpu.py::test_ray_finds_the_gpus_torch_sees``."""
    code = (
        "import sys\n"
        "from plora.runtime.actors import cluster\n"
        "from ray._private.resource_and_label_spec import ResourceAndLabelSpec\n"
        "found = cluster.ray_finds_gpus()\n"
        "spec = ResourceAndLabelSpec().resolve(is_head=True)\n"
        "print(found, (spec.num_gpus or 0) > 0, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[0] == out[1]  # what ray.init's own resource detection finds
    assert out[2] == "False"
