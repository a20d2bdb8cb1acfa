"""A sweep that wants more GPUs than the Ray cluster has: one line, before any job or sweep dir.

The stubbed variants (this machine's GPUs, a node narrower than a job, configs that fit no job)
are tests/unit/test_multigpu_inputs.py; here a real ``plora sweep --address`` joins the tier's
cluster of 8 logical GPUs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_more_gpus_than_the_cluster_has(ray_cluster, tmp_path) -> None:
    data = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text())
    data["hardware"] = {"gpu_type": "H100", "num_gpus": 16}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "plora"), "sweep", str(path), "--out", str(out),
         "--address", ray_cluster.get_runtime_context().gcs_address],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    want = "hardware.num_gpus=16: the sweep wants 16 GPUs but the Ray cluster has 8; lower"
    assert lines[0].startswith(f"error: {path}:") and want in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]  # no dir, no lock
