"""The cluster path without a cluster (issue 14, item 5): a CPU sweep (``gpu_type: cpu``) asks Ray
for CPUs only, so it runs on nodes without GPUs; a relative ``--out`` under ``ray job submit`` is
refused before anything starts. The real ``ray job submit`` is tests/ray/test_job_submit.py."""

from __future__ import annotations

from typing import Any

import pytest
from test_sweep_cli import assert_one_error, no_sweep_dir, run, sweep_file

import plora.runtime.cluster as cluster
import plora.runtime.driver as driver
import plora.runtime.group as group
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
