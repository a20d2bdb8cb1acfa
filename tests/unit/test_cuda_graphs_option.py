"""``training.cuda_graphs``: parsed at the door, and carried to every one-device trainer of a
sweep (auto -> ``PackedTrainer(cuda_graphs=None)``, on -> True, off -> False); a parallel
rank's trainer accepts it and runs eagerly.

What the graphed step computes is tested by ``tests/unit/test_graphed*.py`` and
``tests/gpu/test_graphs_gpu.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _engine_testlib import TOKENIZER, tiny_model, toy_dataset

from plora.config import ConfigError, CudaGraphs, DatasetSpec, LoRAConfig, ModelRef, SweepConfig
from plora.config.sweep_options import TrainingOptions
from plora.engine.api import EngineSpec, PackRequest


def _sweep(tmp_path: Path, training: str, gpu: str = "H100") -> SweepConfig:
    path = tmp_path / "s.yaml"
    path.write_text(
        "name: s\nmodel: tiny-qwen2\n"
        "dataset: {builtin: arithmetic, num_examples: 100, max_seq_len: 64}\n"
        f"hardware: {{gpu_type: {gpu}, num_gpus: 1}}\n{training}"
        "space: {lr: 1.0e-3, batch_size: 2, rank: 8, alpha_ratio: 2, max_steps: 5}\n"
    )
    return SweepConfig.from_yaml(path)


@pytest.mark.parametrize(
    ("value", "member", "flag"),
    [
        ("auto", CudaGraphs.AUTO, None),
        ("on", CudaGraphs.ON, True),
        ("off", CudaGraphs.OFF, False),
        (True, CudaGraphs.ON, True),  # YAML 1.1 reads a bare `on` as true
        (False, CudaGraphs.OFF, False),
        (CudaGraphs.OFF, CudaGraphs.OFF, False),
    ],
)
def test_each_value_maps_to_the_trainers_argument(value, member, flag) -> None:
    got = TrainingOptions(cuda_graphs=value).cuda_graphs
    assert got is member and got.trainer_arg is flag


def test_the_default_is_auto_and_the_yaml_round_trips(tmp_path) -> None:
    assert _sweep(tmp_path, "").training.cuda_graphs is CudaGraphs.AUTO
    for cpu in ("cpu", "H100"):  # on is valid on the CPU: the static-buffer step, eagerly
        sweep = _sweep(tmp_path, "training: {cuda_graphs: on}\n", gpu=cpu)
        assert sweep.training.cuda_graphs is CudaGraphs.ON
    sweep = _sweep(tmp_path, "training: {cuda_graphs: off}\n")
    again = tmp_path / "again.yaml"
    sweep.to_yaml(again)
    assert "cuda_graphs: 'off'" in again.read_text()
    assert SweepConfig.from_yaml(again) == sweep


@pytest.mark.parametrize("value", ["fast", "1", "[on]", "null"])
def test_a_bad_value_is_one_line_naming_file_key_and_value(tmp_path, value) -> None:
    with pytest.raises(ConfigError) as err:
        _sweep(tmp_path, f"training: {{cuda_graphs: {value}}}\n")
    text = str(err.value)
    assert f"{tmp_path / 's.yaml'}:5: training.cuda_graphs=" in text
    assert "must be auto, on or off" in text and "\n" not in text


def test_the_dispatcher_hands_the_setting_to_its_workers(tmp_path, monkeypatch) -> None:
    from plora.runtime.actors import dispatch
    from plora.runtime.options import RunOptions

    monkeypatch.setattr(dispatch, "start_relay", lambda *a, **k: None)  # no Ray here
    monkeypatch.setattr(dispatch, "worker_resources", lambda **k: (1.0, 1))
    for value, member in (("", CudaGraphs.AUTO), ("off", CudaGraphs.OFF)):
        training = f"training: {{cuda_graphs: {value}}}\n" if value else ""
        sweep = _sweep(tmp_path, training)
        d = dispatch.Dispatcher(sweep=sweep, options=RunOptions(), on_update=None)
        assert d.engine_spec.cuda_graphs is member


@pytest.mark.usefixtures("one_thread")
def test_a_resident_session_builds_each_packs_trainer_with_the_setting(
    tmp_path, monkeypatch
) -> None:
    from plora.engine import session as run
    from plora.engine.trainer import PackedTrainer

    data = DatasetSpec(builtin="arithmetic", num_examples=16, max_seq_len=32, eval_fraction=0.0)
    spec = EngineSpec(model=ModelRef(name_or_path="tiny-qwen2"), dataset=data, device="cpu")
    session = run.PackSession(spec)
    request = PackRequest(job_id="j", configs=(), out_dir=str(tmp_path))
    # on the CPU only `on` runs the static-buffer step (auto: graphs on CUDA only)
    for member, graphed in (
        (CudaGraphs.AUTO, False),
        (CudaGraphs.ON, True),
        (CudaGraphs.OFF, False),
    ):
        session.spec = dataclasses.replace(spec, cuda_graphs=member)
        assert (session._trainer(request).graphs is not None) is graphed
    given: list[bool | None] = []

    def trainer(*args, **kwargs) -> PackedTrainer:
        given.append(kwargs["cuda_graphs"])
        return PackedTrainer(*args, **kwargs)

    monkeypatch.setattr(run, "PackedTrainer", trainer)
    for member in CudaGraphs:
        session.spec = dataclasses.replace(spec, cuda_graphs=member)
        session._trainer(request)
    assert given == [None, True, False]  # auto, on, off


def test_a_parallel_ranks_trainer_accepts_the_setting_and_runs_eagerly() -> None:
    from plora.parallel import ParallelDims
    from plora.parallel.trainer import ParallelPackedTrainer

    trainer = ParallelPackedTrainer(
        copy.deepcopy(tiny_model("qwen2")), TOKENIZER, toy_dataset(), device="cpu",
        dims=ParallelDims(), mesh=None, cuda_graphs=True,
    )  # fmt: skip
    assert trainer.graphs is None
    trainer.add(LoRAConfig(config_id="a", rank=4, alpha=8, lr=1e-2, batch_size=2, max_steps=2))
    assert [m.config_id for m in trainer.step()] == ["a"]


# ------------------------------------------------------------------------- the plan
@pytest.mark.parametrize(
    ("training", "gpu", "env", "want"),
    [
        ("", "H100", None, True),  # auto: on for CUDA
        ("", "H100", "0", False),  # ... unless the environment turns it off
        ("", "H100", "Off", False),
        ("", "H100", "no", False),
        ("", "H100", "1", True),
        ("", "cpu", None, False),  # never on the CPU
        ("training: {cuda_graphs: on}\n", "H100", "0", True),  # asked for: what the engine runs
        ("training: {cuda_graphs: on}\n", "cpu", None, True),
        ("training: {cuda_graphs: off}\n", "H100", None, False),
    ],
)
def test_the_plan_assumes_what_the_engine_runs(tmp_path, monkeypatch, training, gpu, env, want):
    import torch

    from plora.cost.build import build_cost_model, plan_cuda_graphs
    from plora.cost.priors import step_prior
    from plora.engine.graphed import graphs_wanted

    if env is not None:
        monkeypatch.setenv("PLORA_CUDA_GRAPHS", env)
    sweep = _sweep(tmp_path, training, gpu=gpu)
    assert plan_cuda_graphs(sweep) is want
    device = torch.device("cpu" if gpu == "cpu" else "cuda")
    assert graphs_wanted(sweep.training.cuda_graphs.trainer_arg, device) is want
    cost = build_cost_model(sweep, use_profile=False)
    assert cost.cuda_graphs is want
    assert cost.coefficients == step_prior(gpu, False, cuda_graphs=want)


def test_graphed_steps_are_profiled_apart(tmp_path, monkeypatch) -> None:
    """``record_profile`` writes a graphed sweep's measurements under the key its plan read,
    which is not the eager sweep's."""
    from plora.config.fused import fused_profile_key
    from plora.cost.build import build_cost_model
    from plora.cost.overheads import OverheadKind, OverheadSample
    from plora.cost.profile import ProfileStore
    from plora.runtime.coordinator.costs import record_profile

    sweep, store = _sweep(tmp_path, ""), tmp_path / "profiles"
    assert fused_profile_key("m", False, True) == "m+graphs"
    assert fused_profile_key("m", True, True) == "m+liger+graphs"
    assert fused_profile_key("m", True, True) != fused_profile_key("m", True)
    cost = build_cost_model(sweep, profile_dir=store)
    assert cost.cuda_graphs
    sample = [OverheadSample(kind=OverheadKind.MODEL_LOAD, seconds=123.0)]
    assert record_profile(sweep, cost.refit_overheads([]), [], {}, sample, profile_dir=store) == 1
    key = fused_profile_key(sweep.model.profile_key, False, True)
    assert ProfileStore(store).path(key, "H100").is_file()
    assert not ProfileStore(store).path(sweep.model.profile_key, "H100").is_file()
    assert build_cost_model(sweep, profile_dir=store).overheads.model_load_s == 123.0
    eager = build_cost_model(sweep, profile_dir=store, cuda_graphs=False)
    assert eager.overheads.model_load_s != 123.0
