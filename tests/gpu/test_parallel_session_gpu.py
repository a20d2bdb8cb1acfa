"""A d = 2 job's resident engine on two GPUs with NCCL (tp, fsdp, fsdp_offload, pp): the same
requests as ``tests/dist/test_parallel_session.py`` (rank 0's control, abort, resume, a second
job), in bf16, against the one-GPU engine. Needs two CUDA devices.

The tolerance is measured, not assumed. In bf16 (weights and autocast) the adapters of two
correct runs part at the first rounding that differs, and AdamW's normalised steps carry that
through every step (lr up to 2e-2 here). The one-GPU reference is run twice, once as a sweep
runs it (graphed step, Liger's kernels where installed) and once with every kernel choice
switched the other way (eager, stock ops): their distance is the spread of correct one-GPU
training. A d = 2 run is one more such variant (the base GEMMs and norms summed in another
order over two GPUs), so it must lie within twice that spread of the reference; a lost
all-reduce, a wrong shard or a skipped step moves an adapter by far more.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _engine_testlib import adapter_rel_err
from _own_gpu import run_on_own_gpu
from safetensors.torch import load_file
from test_parallel_session import PACK, SECOND, SPEC, STOP_B_AFTER, _free_port, _Hooks
from test_parallel_session import _request as request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]
#: A d = 2 adapter lies within this many one-GPU spreads of the one-GPU reference.
SPREADS = 2.0


def _adapters(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {cid: load_file(root / "adapters" / cid / "adapter_model.safetensors")
            for cid in ("a", "b", "c")}  # fmt: skip


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    """The one-GPU engine's adapters and results, as a sweep runs it, and the spread: the
    worst distance over the adapters between that run and one with the other kernels."""
    from plora.config import CudaGraphs
    from plora.config.fused import FusedKernels
    from plora.engine.api import EngineSpec
    from plora.engine.session import PackSession

    other = {"cuda_graphs": CudaGraphs.OFF, "fused_kernels": FusedKernels.OFF}
    runs = {}
    for name, options in (("sweep", {}), ("other", other)):
        out = tmp_path_factory.mktemp(f"one-{name}")
        session = PackSession(EngineSpec(**SPEC, **options))
        results = {}
        for jid, configs in (("j1", PACK), ("j2", SECOND)):
            results.update(session.run(request(jid, configs, out), _Hooks()).results)
        runs[name] = (_adapters(out), results)
        del session
        torch.cuda.empty_cache()
    (ref, results), (other, _) = runs["sweep"], runs["other"]
    spread = max(adapter_rel_err(other[c], ref[c]) for c in ref)
    print(f"one-GPU spread (graphed+fused vs eager+stock): {spread:.3e}")
    return ref, results, spread


@pytest.mark.parametrize("strategy", ["tp", "fsdp", "fsdp_offload", "pp"])
def test_parallel_session_on_two_gpus(strategy, tmp_path, one_gpu) -> None:
    mp.spawn(
        run_on_own_gpu,
        args=("test_parallel_session", "_rank", strategy, _free_port(), str(tmp_path), "nccl"),
        nprocs=2,
        join=True,
    )
    ref, results, spread = one_gpu
    outcomes = json.loads((tmp_path / strategy / "outcomes.json").read_text())
    if strategy == "fsdp_offload":  # loaded on the host: the base's shards stay there, pinned
        layout = outcomes["layout"]
        assert layout["offloaded_units"] == 3 and layout["offloaded_pinned"], layout
        assert layout["lora_on_device"], layout
    assert outcomes["first"]["b"]["steps"] == STOP_B_AFTER
    assert outcomes["again"]["a"]["status"] == "completed"
    got = _adapters(tmp_path / strategy)
    errors = {cid: adapter_rel_err(got[cid], ref[cid]) for cid in ref}
    print(strategy, {c: f"{e:.3e}" for c, e in errors.items()}, f"spread {spread:.3e}")
    for cid, err in errors.items():
        assert err <= SPREADS * spread, (cid, err, spread)
        assert any(v.abs().max() > 1e-4 for k, v in got[cid].items() if "lora_B" in k)
        steps = (outcomes["second"] if cid == "c" else outcomes["again"])[cid]["steps"]
        assert results[cid].steps == steps
