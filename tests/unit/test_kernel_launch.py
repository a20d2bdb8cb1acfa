"""The launchers' host-side helpers (no kernel runs): the shared-memory retry of
``plora.kernels.ops._launch``, the cached tile configs and ``next_pow2``. They sit on every
launch's path (about a thousand a step), so they are cached and kept plain; these tests pin that
the caching changed nothing they decide."""

from __future__ import annotations

import pytest
import torch
import triton
from plora.kernels import configs, ops
from plora.kernels import triton_kernels as tk
from triton.runtime.errors import OutOfResources


class FakeKernel:
    """A launchable that fits shared memory only with ``fits`` pipeline stages or fewer."""

    def __init__(self, fits: int, name: str = "_fake_kernel") -> None:
        self.fits, self.stages = fits, []
        self.fn = type("Fn", (), {"__name__": name})()

    def __getitem__(self, grid):
        def run(*args, num_stages: int, **kwargs):
            self.stages.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(232448 * num_stages // 2, 232448, "shared memory")

        return run


@pytest.fixture(autouse=True)
def no_remembered_stages(monkeypatch):
    monkeypatch.setattr(ops, "_STAGES_THAT_FIT", {})


def test_launch_retries_with_fewer_stages_and_remembers_them():
    x = torch.zeros(4)
    kernel = FakeKernel(fits=2)
    ops._launch(kernel, (1,), (x,), {"BM": 64}, {"num_warps": 4, "num_stages": 4})
    assert kernel.stages == [4, 3, 2]
    ops._launch(kernel, (1,), (x,), {"BM": 64}, {"num_warps": 4, "num_stages": 4})
    assert kernel.stages[3:] == [2]  # remembered: straight to the stages that fit
    ops._launch(kernel, (1,), (x,), {"BM": 32}, {"num_warps": 4, "num_stages": 4})
    assert kernel.stages[4:] == [4, 3, 2]  # other constexprs: their own entry


def test_launch_default_stages_and_a_config_that_never_fits():
    x = torch.zeros(4)
    fits = FakeKernel(fits=3)
    ops._launch(fits, (1,), (x,), {}, {"num_warps": 4})
    assert fits.stages == [3] and not ops._STAGES_THAT_FIT  # Triton's default, nothing learnt
    never = FakeKernel(fits=0)
    with pytest.raises(OutOfResources):
        ops._launch(never, (1,), (x,), {}, {"num_stages": 2})
    assert never.stages == [2, 1]


def test_next_pow2_is_tritons():
    for n in [*range(-2, 4100), 2**20 - 1, 2**20, 2**20 + 1]:
        assert tk.next_pow2(n) == triton.next_power_of_2(max(n, 1)), n


def test_kernel_config_cached_copies_follow_overrides_and_dtype(monkeypatch):
    cpu = torch.device("cpu")
    first = configs.kernel_config("wgrad", cpu)
    first["BN"] = -1  # a caller's edits stay its own
    assert configs.kernel_config("wgrad", cpu) == configs._INTERPRETER_CONFIGS["wgrad"]
    monkeypatch.setitem(configs.CONFIG_OVERRIDES, "wgrad", {"BN": 32, "BT": 64, "BR": 16})
    assert configs.kernel_config("wgrad", cpu) == {"BN": 32, "BT": 64, "BR": 16}
    assert configs.kernel_config("wgrad", cpu, elem_size=4)["BT"] == 32  # float32: half the tile
    assert configs.CONFIG_OVERRIDES["wgrad"]["BT"] == 64  # the override itself untouched
