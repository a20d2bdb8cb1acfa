"""One Ray cluster for the whole ray tier: 2 CPUs, 8 logical GPUs, no dashboard."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.ray)
            item.add_marker(pytest.mark.timeout(420))  # a stuck sweep fails, not hangs CI


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        ray.init(
            address="local",  # its own cluster, never one that `ray start` (or a Cluster) left
            num_cpus=2,
            num_gpus=8,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={
                "env_vars": {
                    "PYTHONPATH": path,
                    "PACKFN_STEP_S": "0.05",
                    "RAY_USAGE_STATS_ENABLED": "0",
                }
            },
        )
    yield ray
    ray.shutdown()
