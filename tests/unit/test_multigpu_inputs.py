"""Bad multi-GPU input is one line before any job starts, and no sweep directory (issue 26, item 5).

More GPUs than this machine (a local Ray) or the cluster has, a job wider than the cluster's
largest node, and configs that fit no job the model can be split into: ``plora sweep`` stops
before Ray (this machine's GPUs), or once connected and before the sweep directory (the
cluster's GPUs, the fits check beside Ray's start); ``plora validate`` refuses the same; ``plora
plan`` is a what-if and plans any GPU count. Ray is stubbed: nothing here starts a cluster.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_sweep_cli import assert_one_error, no_sweep_dir, run, sweep_file

import plora.runtime.actors.cluster as cluster
import plora.runtime.driver as driver


class ReachedDispatch(Exception):
    """The sweep got past every check: the stub dispatcher stops it there."""


@pytest.fixture
def joined_cluster(monkeypatch):
    """``plora sweep`` joins a stubbed Ray cluster (``resources``, ``nodes``: what it reports)
    and stops at the dispatcher (``ReachedDispatch``) when every check passed."""
    state: dict[str, Any] = {"resources": {"CPU": 8.0, "GPU": 8.0}, "nodes": None}

    def nodes() -> list[dict[str, Any]]:
        gpus = state["nodes"] or [state["resources"].get("GPU", 0.0)]
        dead = {"Alive": False, "Resources": {"GPU": 64.0}}  # a dead node's GPUs do not count
        return [dead] + [{"Alive": True, "Resources": {"GPU": g}} for g in gpus]

    class Dispatcher:
        """Built once the cluster's GPUs are checked; handed a coordinator only once the
        inputs are (the prepare thread's checks)."""

        def __init__(self, **kwargs: Any) -> None:
            if state.get("stop_when_built"):
                raise ReachedDispatch("reached the dispatcher")

        def prestart(self, gpu_ids: Any) -> None:
            pass

        def attach(self, coord: Any, store: Any) -> None:
            if not state.get("attach"):
                raise ReachedDispatch("the dispatcher got a coordinator")

        def loop(self, launches: Any) -> None:
            raise ReachedDispatch("the dispatcher got jobs")

        def close(self) -> None:
            pass

    monkeypatch.setattr(driver, "connect", lambda *a, **k: False)
    monkeypatch.setattr(driver, "shutdown_cluster", lambda **k: None)
    monkeypatch.setattr(driver, "Dispatcher", Dispatcher)
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: dict(state["resources"]))
    monkeypatch.setattr(cluster.ray, "nodes", nodes)
    return state


@pytest.fixture
def two_local_gpus(monkeypatch):
    """This machine has 2 GPUs and ``plora sweep`` would start a local Ray on it; reaching Ray
    is a failure (the check comes before it)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "local_gpu_count", lambda: 2)
    monkeypatch.setattr(cluster, "starts_local", lambda address: True)

    def connect(*args: Any, **kwargs: Any) -> bool:
        raise AssertionError("reached Ray")

    monkeypatch.setattr(driver, "connect", connect)


def gpu_sweep(tmp_path, num_gpus: int, **changes: Any):
    return sweep_file(tmp_path, hardware={"gpu_type": "H100", "num_gpus": num_gpus}, **changes)


def test_more_gpus_than_this_machine_stop_sweep_and_validate_before_ray(
    tmp_path, two_local_gpus
) -> None:
    out = tmp_path / "out"
    path = gpu_sweep(tmp_path, 4)
    for args in (("sweep", str(path), "--out", str(out)), ("validate", str(path))):
        result = run(*args)
        assert_one_error(
            result,
            f"{path}:",
            "hardware.num_gpus=4: the sweep wants 4 GPUs but this machine has 2",
            "; lower hardware.num_gpus to 2",
        )
    no_sweep_dir(out)


def test_this_machines_gpus_bound_only_a_local_ray(tmp_path, two_local_gpus, monkeypatch) -> None:
    cluster.check_local_gpus(2)  # enough
    cluster.check_local_gpus(4, cpu=True)  # a CPU sweep's "GPUs" are worker slots
    monkeypatch.setattr(cluster, "local_gpu_count", lambda: 0)
    cluster.check_local_gpus(4)  # no GPU at all: Ray gets 4 logical ones, the engine runs on CPU
    monkeypatch.setattr(cluster, "local_gpu_count", lambda: 2)
    monkeypatch.setattr(cluster, "starts_local", lambda address: address is None)
    cluster.check_local_gpus(4, address="10.0.0.1:6379")  # a cluster: checked once joined


def test_plan_is_a_what_if_on_any_gpu_count(tmp_path, two_local_gpus) -> None:
    result = run("plan", str(gpu_sweep(tmp_path, 8)))
    assert result.exit_code == 0, result.output


def test_more_gpus_than_the_cluster_stop_sweep_before_its_dir(tmp_path, joined_cluster) -> None:
    joined_cluster["resources"] = {"CPU": 8.0, "GPU": 2.0}
    out, path = tmp_path / "out", gpu_sweep(tmp_path, 4)
    result = run("sweep", str(path), "--out", str(out))
    assert_one_error(
        result,
        f"{path}:",
        "hardware.num_gpus=4: the sweep wants 4 GPUs but the Ray cluster has 2",
        "; lower hardware.num_gpus to 2 or less, or add GPU nodes",
    )
    no_sweep_dir(out)


@pytest.mark.parametrize(
    ("strategies", "nodes", "error"),
    [
        (
            ["fsdp"],
            [4.0, 4.0],
            "a job may span 8 GPUs, but the largest node of the Ray cluster has 4",
        ),
        ([], [4.0, 4.0], None),  # one-GPU jobs: any node does
        # tiny-qwen2's 2 KV heads: its tp jobs span 2 GPUs at most
        (["tp"], [2.0, 2.0, 2.0, 2.0], None),
        (["tp"], [1.0] * 8, "a job may span 2 GPUs, but the largest node of the Ray cluster has 1"),
    ],
)
def test_a_job_wider_than_the_largest_node(tmp_path, joined_cluster, strategies, nodes, error):
    joined_cluster.update(nodes=nodes, stop_when_built=True)
    out = tmp_path / "out"
    path = gpu_sweep(tmp_path, 8, planner={"strategies": strategies})
    result = run("sweep", str(path), "--out", str(out))
    if error is None:
        assert "ReachedDispatch: reached the dispatcher" in result.output, result.output
    else:
        assert_one_error(
            result, f"{path}:", "hardware.num_gpus=8", error, "; lower hardware.num_gpus"
        )
    no_sweep_dir(out)


@pytest.mark.parametrize("command", ["sweep", "validate", "plan"])
def test_configs_that_fit_no_job_the_model_takes(tmp_path, joined_cluster, command) -> None:
    """tiny-qwen2 splits 2 ways (2 KV heads), never 4: a job that needs 4 is refused in one line,
    by ``plora sweep`` after Ray and before the sweep directory (no stray files)."""
    out = tmp_path / "out"
    hardware = {"gpu_type": "H100", "num_gpus": 4, "gpu_memory_gib": 0.02}
    path = sweep_file(tmp_path, hardware=hardware, planner={"strategies": ["tp"]})
    args = ("sweep", str(path), "--out", str(out)) if command == "sweep" else (command, str(path))
    assert_one_error(
        run(*args),
        f"{path}:",
        "hardware.gpu_memory_gib=0.02: config ",
        "tiny-qwen2 cannot take tp on 4 GPUs (num_key_value_heads=2 is not divisible by tp=4)",
    )
    no_sweep_dir(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_a_first_plan_that_places_nothing_leaves_no_dir(tmp_path, joined_cluster) -> None:
    """Given a cost model and configs (the Tune integration, tests), the driver skips the input
    checks; the coordinator's first plan still comes before the sweep directory is in place."""
    from plora.config import ConfigError, SweepConfig
    from plora.cost.build import build_cost_model
    from plora.tune.source import StaticSource
    from plora.tune.space import expand

    hardware = {"gpu_type": "H100", "num_gpus": 4, "gpu_memory_gib": 0.02}
    path = sweep_file(tmp_path, hardware=hardware, planner={"strategies": ["tp"]})
    sweep = SweepConfig.from_yaml(path)
    joined_cluster["attach"] = True  # the dispatcher takes its coordinator: the plan runs
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as err:
        driver.run_sweep(
            sweep, out, cost=build_cost_model(sweep), source=StaticSource(expand(sweep))
        )
    no_sweep_dir(out)
    assert str(err.value).startswith(f"{path}:")
    assert "tiny-qwen2 cannot take tp on 4 GPUs" in str(err.value)
