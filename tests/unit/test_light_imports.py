"""The sweep driver and ``plora plan`` import neither torch nor transformers nor Ray Tune.

They took 11 of the 13 s of ``import plora.runtime.driver`` on a 2-core host (2026-11-25); a
user waits for them before anything of the sweep starts.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "peft", "torchao", "ray.tune", "scipy")


@pytest.mark.parametrize("module", ["plora.runtime.driver", "plora.api", "plora.models.hub"])
def test_driver_side_modules_import_nothing_heavy(module):
    code = f"import sys, {module}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"
