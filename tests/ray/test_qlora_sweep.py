"""A quickstart-sized QLoRA sweep end to end on CPU: ``plora sweep sweeps/qlora-tiny.yaml``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("torchao", reason="QLoRA needs torchao: pip install -e '.[qlora]'")


def test_qlora_sweep_trains_every_config_on_the_nf4_base(ray_cluster, tmp_path) -> None:
    from peft import PeftModel

    from plora.config import SweepConfig
    from plora.engine.adapters import add_adapter, inject, load_adapter_state_dict, use_slot
    from plora.models import load_model
    from plora.models.quantize import is_quantized
    from plora.tune.space import expand

    sweep_file = ROOT / "sweeps" / "qlora-tiny.yaml"
    sweep = SweepConfig.from_yaml(sweep_file)
    assert sweep.model.quantization == "nf4"
    out = tmp_path / "qlora"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "plora"), "sweep", str(sweep_file), "--out", str(out),
         "--address", ray_cluster.get_runtime_context().gcs_address],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    configs = expand(sweep)
    res = pd.read_parquet(out / "results.parquet").set_index("config_id")
    assert sorted(res.index) == sorted(c.config_id for c in configs)
    assert (res["status"] == "done").all() and res["eval_loss"].notna().all()
    # the good lr learns on the 4-bit base as on the dense one (quickstart: ~0.3 vs ~0.1)
    assert res["eval_metric"].max() - res["eval_metric"].min() >= 0.1
    meta = json.loads((out / "base_model.json").read_text())
    assert meta["quantization"] == "nf4"
    # the best adapter reloads with PEFT on the NF4 base and matches plora's packed layer
    best = res["eval_metric"].idxmax()
    cfg = next(c for c in configs if c.config_id == best)
    path = out / "adapters" / best
    base, _ = load_model(sweep.model)
    assert any(is_quantized(m) for m in base.modules())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, path).eval()(ids).logits
    mine, _ = load_model(sweep.model)
    inject(mine)
    add_adapter(mine, 0, cfg)
    from safetensors.torch import load_file

    load_adapter_state_dict(mine, 0, load_file(path / "adapter_model.safetensors"))
    with torch.no_grad(), use_slot(mine, 0):
        torch.testing.assert_close(got, mine(ids).logits, rtol=1e-5, atol=1e-5)
