"""The analysis notebooks run top to bottom: ``sweep_report`` on a real (small) quickstart sweep
run through the runtime, ``plan_explorer`` offline on the paper's sweep file."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "plora-test-python"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Jupyter data dir holding a kernelspec for this interpreter (the venv under test), so
    the notebooks import the same plora whatever kernels the machine has installed."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "plora test", "language": "python"})
    )
    return root


@pytest.fixture(scope="module")
def sweep_dir(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart sweep (8 configs), shortened to 10 steps on 400 examples, run for real."""
    from plora.config import SweepConfig
    from plora.runtime import RunOptions, run_sweep

    path = ROOT / "sweeps" / "quickstart.yaml"
    data = SweepConfig.from_yaml(path).to_dict()
    data["space"]["max_steps"] = 10
    data["dataset"]["num_examples"] = 400
    sweep = SweepConfig.from_dict(data, source=str(path), base_dir=path.parent)
    out = tmp_path_factory.mktemp("nb") / "quickstart"
    summary = run_sweep(sweep, out, options=RunOptions(checkpoint_every=None))
    assert summary.ok and summary.counts["done"] == 8, summary.counts
    return out


def execute(name: str, kernel_dir: Path, monkeypatch: pytest.MonkeyPatch, **env: str):
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        f"{name} is stored with outputs; clear them"
    )
    # raises CellExecutionError (with the traceback) when any cell fails
    NotebookClient(
        nb, kernel_name=KERNEL, timeout=180, resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    stdout = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")
    return pngs, stdout


def test_sweep_report_notebook(sweep_dir: Path, kernel_dir: Path, monkeypatch) -> None:
    pngs, stdout = execute(
        "sweep_report.ipynb", kernel_dir, monkeypatch, PLORA_SWEEP_DIR=str(sweep_dir)
    )
    # jobs Gantt, plan Gantt, loss curves, hyperparameter effects
    assert len(pngs) == 4
    assert f"{sweep_dir}: 8 configs" in stdout
    # the reloaded adapter is the best config, ranked here straight from results.parquet
    res = pd.read_parquet(sweep_dir / "results.parquet")
    res = res[res["status"] == "done"].sort_values("eval_metric", ascending=False, kind="stable")
    best = res.iloc[0]
    assert f"loaded {best['config_id']} (eval_metric = {best['eval_metric']:.4g})" in stdout
    assert re.search(r"'7\+9=' -> '.*'", stdout)


def test_plan_explorer_notebook(kernel_dir: Path, monkeypatch) -> None:
    pngs, stdout = execute("plan_explorer.ipynb", kernel_dir, monkeypatch)
    assert len(pngs) == 2  # the 40 and 80 GiB plans
    m = re.search(
        r"PLoRA ([\d.]+) h in (\d+) jobs; Min GPU ([\d.]+) h; Max GPU ([\d.]+) h; "
        r"lower bound ([\d.]+) h",
        stdout,
    )
    assert m, stdout
    plora_h, jobs, min_h, max_h, lb_h = (float(g) for g in m.groups())
    assert "120 configs of Qwen/Qwen2.5-7B on 8x A100-40GB (40 GiB)" in stdout
    assert jobs >= 1 and lb_h <= plora_h <= max(min_h, max_h)
