"""End to end with plora's engine: ``plora sweep sweeps/quickstart.yaml`` on the test cluster."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[2]


def plora(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "plora"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_quickstart_sweep_trains_every_config_and_adapters_reload(ray_cluster, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from plora.config import SweepConfig
    from plora.space import expand

    address = ray_cluster.get_runtime_context().gcs_address
    out = tmp_path / "qs"
    t0 = time.monotonic()
    proc = plora("sweep", "sweeps/quickstart.yaml", "--out", str(out), "--address", address)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert wall < 300
    configs = expand(SweepConfig.from_yaml(ROOT / "sweeps/quickstart.yaml"))
    res = pd.read_parquet(out / "results.parquet").set_index("config_id")
    assert sorted(res.index) == sorted(c.config_id for c in configs)
    assert (res["status"] == "done").all()
    assert res["eval_metric"].notna().all() and res["eval_loss"].notna().all()
    assert ((res["eval_metric"] >= 0) & (res["eval_metric"] <= 1)).all()
    for c in configs:
        row = res.loc[c.config_id]
        assert row["steps"] == c.max_steps and row["rank"] == c.rank and row["lr"] == c.lr
    m = pd.read_parquet(out / "metrics.parquet")
    assert m.groupby("config_id")["step"].max().to_dict() == {
        c.config_id: c.max_steps for c in configs
    }
    first = m[m["step"] == 1].set_index("config_id")["loss"]
    last = m[m["step"] == m["step"].max()].set_index("config_id")["loss"]
    assert (last < first).mean() >= 0.75  # training reduced the loss for most configs

    base = AutoModelForCausalLM.from_pretrained(out / "base_model")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        ref = base(ids).logits
    for c in configs[:2]:
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(out / "base_model"), out / "adapters" / c.config_id
        )
        with torch.no_grad():
            assert not torch.allclose(model(ids).logits, ref)  # the trained adapter changes outputs

    status = plora("status", str(out))
    assert (
        status.returncode == 0
        and "done 8" in status.stdout
        and "best by eval_metric" in status.stdout
    )
