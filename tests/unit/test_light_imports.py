"""The sweep driver and ``plora plan`` import neither torch nor transformers nor Ray Tune, nor
pandas / pyarrow.

torch and transformers took 11 of the 13 s of ``import plora.runtime.driver`` on a 2-core host
(2026-11-25); pandas + pyarrow (the sweep directory's tables) another 0.7 s there and ~3 s on the
H100 host, all before ``ray.init``. A user waits for them before anything of the sweep starts, and
the resident worker's start (the sweep's critical path) waits for the cluster. pandas loads where
a table is read or written, or on the driver's prepare thread beside Ray's start.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

HEAVY = ("torch", "transformers", "peft", "torchao", "ray.tune", "scipy", "pandas", "pyarrow")

#: What ``plora sweep`` imports before it calls ``ray.init`` (``plora/cli/running.py``).
SWEEP_PATH = "plora.cli, plora.api, plora.runtime.driver, plora.runtime.progress"


def heavy_after(imports: str) -> str:
    """The heavy modules a fresh interpreter holds after ``import {imports}``."""
    code = f"import sys, {imports}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize(
    "module",
    [
        "plora.runtime.driver",
        "plora.api",
        "plora.models.hub",
        "plora.cli",
        "plora.runtime.progress",
        "plora.sweepdir.store",
        "plora.sweepdir.reader",
        SWEEP_PATH,
    ],
)
def test_driver_side_modules_import_nothing_heavy(module):
    heavy = heavy_after(module)
    assert heavy == "", f"{module} imported {heavy}"


def test_the_check_sees_a_heavy_import():
    """The check itself can fail: the analysis layer builds DataFrames at import time."""
    assert "pandas" in heavy_after("plora.analysis.load").split()


def test_prepare_loads_pandas(tmp_path):
    """The prepare step (the driver's thread beside ``ray.init``) leaves pandas imported, so the
    sweep directory's first table write does not wait for it on the driver's main thread."""
    data = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text())
    data["dataset"]["num_examples"] = 40
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    code = (
        "import sys\n"
        "from plora.config import SweepConfig\n"
        "from plora.runtime.prepare import prepare\n"
        f"sweep = SweepConfig.from_yaml({str(path)!r})\n"
        "assert 'pandas' not in sys.modules\n"
        "prepare(sweep)\n"
        "print('pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "True"
