"""The local cluster ``plora sweep`` starts hands its workers the sweep's environment
(``plora.runtime.actors.cluster.WORKER_ENV``) through the processes' environment, not a job
``runtime_env``: an actor sees ``RAY_USAGE_STATS_ENABLED=0`` and ``TOKENIZERS_PARALLELISM=false``
although the driver was started without them, the job has no runtime_env (so actors may use
the workers Ray prestarts at init), and the driver's own environment is left as Ray leaves it. The
``ray start`` and fallback branches: ``tests/unit/test_cluster_path.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

DRIVER = """
import json, os
import ray
from plora.runtime.actors import cluster

starts = cluster.starts_local(None)
assert cluster.connect(None, num_gpus=1, cpu=True)

@ray.remote
class Probe:
    def env(self):
        return {k: os.environ.get(k) for k in cluster.WORKER_ENV}

try:
    probe = Probe.remote()
    print(json.dumps({
        "starts_local": starts,
        "actor": ray.get(probe.env.remote(), timeout=120),
        "runtime_env": dict(ray.get_runtime_context().runtime_env),
        "driver": {k: os.environ.get(k) for k in cluster.WORKER_ENV},
    }))
finally:
    cluster.shutdown(started=True)
"""


def test_a_local_clusters_actors_get_the_worker_env() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENIZERS_PARALLELISM",)}
    env.update({"RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "1"})  # the user's own setting
    out = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["actor"] == {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    # the driver keeps its own settings but for usage stats, which ray.init turns off itself
    assert got["driver"] == {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": None}
    if not got["starts_local"]:
        pytest.skip("a `ray start` cluster of this machine was joined (its runtime_env path)")
    assert got["runtime_env"] == {}  # no job runtime_env: the prestarted workers serve actors
