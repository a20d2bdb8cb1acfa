"""The README's cluster path, for real (issue 14, items 5 and 7): a Ray head started here with
``ray start --head`` on 127.0.0.1 -- CPUs only, no GPU, token authentication on -- and the
quickstart submitted with ``ray job submit ... plora sweep sweeps/quickstart.yaml --address auto``.
The sweep (``gpu_type: cpu``) must ask Ray for CPUs only and finish; the sweep directory is
checked; the head is stopped whatever happens (``--block`` in its own process group, then any
process left that names this head's temp dir).

Does not use the session cluster of this tier; marker ``ray`` (this folder's conftest)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(
    not (BIN / "ray").is_file() or shutil.which("plora", path=str(BIN)) is None,
    reason="needs the ray CLI (ray[default], the dev extra) and plora in this venv",
)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _kill_leftovers(tag: str) -> None:
    """SIGKILL any process whose command line names this head's unique temp dir ``tag``."""
    me = os.getpid()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if int(proc.name) != me and tag in (proc / "cmdline").read_bytes().decode(
                errors="replace"
            ):
                os.kill(int(proc.name), signal.SIGKILL)


@pytest.fixture
def ray_head(tmp_path) -> Iterator[tuple[str, dict[str, str]]]:
    """A CPU-only Ray head with token auth on 127.0.0.1; yields (dashboard URL, client env)."""
    temp = tempfile.mkdtemp(prefix="plora-rjs-", dir="/tmp")  # short: Ray's unix socket paths
    gcs, dash, client, agent, agent_grpc, env_agent, metrics = _free_ports(7)
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "RAY_AUTH_MODE": "token",  # Ray's token authentication (on by default from Ray 2.61)
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
    }
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "ray_head.log", "w")  # noqa: SIM115  (closed below)
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
         f"--metrics-export-port={metrics}", "--num-cpus=2", "--num-gpus=0",
         f"--temp-dir={temp}", "--disable-usage-stats", "--include-dashboard=true"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:  # the job API answers once the dashboard is up
            ok = subprocess.run([str(BIN / "ray"), "job", "list", "--address", url],
                                env=env, capture_output=True, timeout=60).returncode == 0  # fmt: skip
            if ok:
                break
            if head.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(
                    "ray start --head failed:\n" + (tmp_path / "ray_head.log").read_text()[-3000:]
                )
            time.sleep(2)
        yield url, env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        _kill_leftovers(temp)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_quickstart_through_ray_job_submit_on_a_cpu_only_head(ray_head, tmp_path) -> None:
    url, env = ray_head
    # examples/cluster_submit.sh waits on the health check: public under token auth, while the
    # rest of the API wants the token
    assert urllib.request.urlopen(f"{url}/api/gcs_healthz", timeout=30).status == 200
    with pytest.raises(urllib.error.HTTPError) as denied_version:
        urllib.request.urlopen(f"{url}/api/version", timeout=30)
    assert denied_version.value.code in (401, 403)
    out = tmp_path / "runs" / "quickstart"
    cmd = [str(BIN / "ray"), "job", "submit", "--address", url, "--working-dir", ".", "--",
           "plora", "sweep", "sweeps/quickstart.yaml", "--address", "auto", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "succeeded" in text.lower() and "8 done, 0 stopped, 0 failed" in text, text[-4000:]
    res = pd.read_parquet(out / "results.parquet")
    assert len(res) == 8 and (res["status"] == "done").all()
    assert all(
        (out / "adapters" / cid / "adapter_config.json").is_file() for cid in res["config_id"]
    )
    assert (out / "base_model" / "config.json").is_file()
    jobs = pd.read_parquet(out / "jobs.parquet")
    assert (jobs["status"] == "done").all()
    # without the token the job API refuses: the README's lines need it (RAY_AUTH_TOKEN or file)
    anon = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
    anon["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "no-token")
    (tmp_path / "no-token").write_text("wrong-token\n")
    denied = subprocess.run([str(BIN / "ray"), "job", "list", "--address", url], env=anon,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert denied.returncode != 0 and "auth" in (denied.stdout + denied.stderr).lower()
