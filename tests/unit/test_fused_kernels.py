"""``training.fused_kernels``: one switch, resolved alike by the engine, the cost model and the
input checks; Liger-Kernel never applied on CPU and confined to the model it patches.

The numerics (a packed step with Liger equals the step without) are GPU tests:
``tests/gpu/test_liger_gpu.py``.
"""

from __future__ import annotations

import copy
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _engine_testlib import tiny_model

from plora.config import ConfigError, SweepConfig
from plora.config import fused as fused_cfg
from plora.config.fused import FusedKernels, fused_profile_key, use_fused_kernels
from plora.cost.build import build_cost_model, plan_fused_kernels
from plora.cost.priors import DEFAULT_COEFFICIENTS, measured_prior, step_prior
from plora.engine import liger

SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"
#: The real probe (``conftest._plan_without_liger`` replaces it in every unit test).
REAL_PROBE = fused_cfg.liger_installed


# ------------------------------------------------------------------------- resolution
@pytest.mark.parametrize(
    ("setting", "cuda", "model_type", "installed", "want"),
    [
        ("auto", True, "qwen2", True, True),
        ("auto", True, "llama", True, True),
        ("auto", False, "qwen2", True, False),  # never on CPU
        ("auto", True, "qwen2", False, False),  # not installed
        ("auto", True, "gpt2", True, False),  # a type plora does not patch
        ("off", True, "qwen2", True, False),
        ("on", True, "qwen3", True, True),
        (True, True, "mistral", True, True),  # YAML reads a bare `on` as true
        (False, True, "qwen2", True, False),
    ],
)
def test_resolution_table(setting, cuda, model_type, installed, want) -> None:
    assert use_fused_kernels(setting, cuda=cuda, model_type=model_type, installed=installed) is want


@pytest.mark.parametrize(
    ("cuda", "model_type", "installed", "needles"),
    [
        (True, "qwen2", False, ("Liger-Kernel is not installed", 'pip install "plora[liger]"')),
        (False, "qwen2", True, ("CUDA only", "use auto or off")),
        (True, "gpt2", True, ("'gpt2'", "use auto or off")),
    ],
)
def test_on_where_it_cannot_run_is_one_clear_line(cuda, model_type, installed, needles) -> None:
    with pytest.raises(ConfigError) as err:
        use_fused_kernels("on", cuda=cuda, model_type=model_type, installed=installed)
    text = str(err.value)
    assert "\n" not in text and text.startswith("training.fused_kernels='on': ")
    for needle in needles:
        assert needle in text


def test_unknown_setting_names_key_and_value() -> None:
    with pytest.raises(
        ConfigError, match=r"training.fused_kernels='fast': must be auto, on or off"
    ):
        use_fused_kernels("fast", cuda=True, model_type="qwen2", installed=True)


def test_probe_follows_the_environment(monkeypatch) -> None:
    monkeypatch.setattr(fused_cfg, "liger_installed", REAL_PROBE)
    monkeypatch.setattr(fused_cfg.importlib.util, "find_spec", lambda name: None)
    assert not fused_cfg.liger_installed()
    assert not use_fused_kernels("auto", cuda=True, model_type="qwen2")
    monkeypatch.setattr(fused_cfg.importlib.util, "find_spec", lambda name: object())
    assert use_fused_kernels("auto", cuda=True, model_type="qwen2")


# ------------------------------------------------------------------------- the sweep file
def _sweep(tmp_path: Path, training: str, gpu: str = "H100") -> SweepConfig:
    path = tmp_path / "s.yaml"
    path.write_text(
        "name: s\nmodel: Qwen/Qwen2.5-1.5B\n"
        "dataset: {builtin: arithmetic, num_examples: 200, max_seq_len: 256}\n"
        f"hardware: {{gpu_type: {gpu}, num_gpus: 1}}\n{training}"
        "space: {lr: 1.0e-4, batch_size: 2, rank: [8, 16], alpha_ratio: 2, max_steps: 20}\n"
    )
    return SweepConfig.from_yaml(path)


def test_sweep_default_is_auto_and_round_trips(tmp_path) -> None:
    assert _sweep(tmp_path, "").training.fused_kernels is FusedKernels.AUTO
    sweep = _sweep(tmp_path, "training: {fused_kernels: off}\n")
    assert sweep.training.fused_kernels is FusedKernels.OFF
    again = tmp_path / "again.yaml"
    sweep.to_yaml(again)
    assert "fused_kernels: 'off'" in again.read_text()
    assert SweepConfig.from_yaml(again) == sweep


def test_on_for_a_cpu_sweep_is_refused_at_the_door(tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        _sweep(tmp_path, "training: {fused_kernels: on}\n", gpu="cpu")
    text = str(err.value)
    assert f"{tmp_path / 's.yaml'}:5: training.fused_kernels='on'" in text
    assert "CUDA only" in text and "\n" not in text


def test_sweep_refuses_on_without_liger(tmp_path, monkeypatch) -> None:
    """``plora validate`` / ``plora sweep`` (``check_inputs``) name the key and the install."""
    from plora.runtime.prepare import check_fused_kernels

    sweep = _sweep(tmp_path, "training: {fused_kernels: on}\n")
    monkeypatch.setattr(fused_cfg, "liger_installed", lambda: False)
    with pytest.raises(ConfigError) as err:
        check_fused_kernels(sweep)
    text = str(err.value)
    assert text.startswith(f"{tmp_path / 's.yaml'}: training.fused_kernels='on': ")
    assert 'pip install "plora[liger]"' in text and "\n" not in text
    monkeypatch.setattr(fused_cfg, "liger_installed", lambda: True)
    assert check_fused_kernels(sweep) is True
    auto = _sweep(tmp_path, "")
    assert check_fused_kernels(auto) is True
    monkeypatch.setattr(fused_cfg, "liger_installed", lambda: False)
    assert check_fused_kernels(auto) is False


# ------------------------------------------------------------------------- the cost model
@pytest.mark.parametrize(
    ("training", "gpu", "installed", "want"),
    [
        ("", "H100", True, True),
        ("", "H100", False, False),
        ("", "cpu", True, False),
        ("training: {fused_kernels: off}\n", "H100", True, False),
        ("training: {fused_kernels: on}\n", "H100", False, True),  # plans what was asked
    ],
)
def test_cost_model_plans_what_the_engine_runs(
    tmp_path, monkeypatch, training, gpu, installed, want
):
    monkeypatch.setattr(fused_cfg, "liger_installed", lambda: installed)
    sweep = _sweep(tmp_path, training, gpu=gpu)
    assert plan_fused_kernels(sweep) is want
    cost = build_cost_model(sweep, use_profile=False)
    assert cost.memory.fused_kernels is want
    # the GPU type's prior, fused or not (graphed on a GPU: training.cuda_graphs auto)
    assert cost.coefficients == step_prior(gpu, want, cost.cuda_graphs)
    h200 = step_prior("H200", want)
    assert h200 == (measured_prior("plora", False) if want else DEFAULT_COEFFICIENTS)


def test_fused_plan_is_faster_and_smaller(tmp_path) -> None:
    """The switch reaches both models: fused steps are shorter and activations smaller."""
    from plora.tune.space import expand

    sweep = _sweep(tmp_path, "")
    cfg = expand(sweep)[0]
    stock = build_cost_model(sweep, use_profile=False, fused_kernels=False)
    fused = build_cost_model(sweep, use_profile=False, fused_kernels=True)
    assert fused.job_time([cfg], 1) < stock.job_time([cfg], 1)
    assert fused.config_memory(cfg, 1) < stock.config_memory(cfg, 1)


def test_fused_steps_are_profiled_apart(tmp_path, monkeypatch) -> None:
    """``record_profile`` writes under the key ``build_cost_model`` reads for the same switch."""
    from plora.cost.overheads import OverheadKind, OverheadSample
    from plora.cost.profile import ProfileStore
    from plora.runtime.coordinator.costs import record_profile

    monkeypatch.setattr(fused_cfg, "liger_installed", lambda: True)
    sweep = _sweep(tmp_path, "training: {cuda_graphs: off}\n")  # graphed: +graphs on top
    store = tmp_path / "profiles"
    cost = build_cost_model(sweep, profile_dir=store)
    sample = [OverheadSample(kind=OverheadKind.MODEL_LOAD, seconds=123.0)]
    assert record_profile(sweep, cost, [], {}, sample, profile_dir=store) == 1
    key = fused_profile_key(sweep.model.profile_key, True)
    assert key == "Qwen/Qwen2.5-1.5B+liger"
    assert ProfileStore(store).load(key, "H100") is not None
    assert build_cost_model(sweep, profile_dir=store).overheads.model_load_s == 123.0
    stock = build_cost_model(sweep, profile_dir=store, fused_kernels=False)
    assert stock.overheads.model_load_s != 123.0


# ------------------------------------------------------------------------- the engine
@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in ``liger_kernel.transformers`` that patches like Liger (instance norms and MLPs,
    module-wide classes and RoPE) with pass-through functions that count their calls."""
    calls = {"rope": 0, "norm": 0, "mlp": 0, "patch": 0}
    stock_rope = modeling_qwen2.apply_rotary_pos_emb

    def rope(*args, **kwargs):
        calls["rope"] += 1
        return stock_rope(*args, **kwargs)

    class FakeNorm(torch.nn.Module):
        pass

    def apply_liger_kernel_to_qwen2(*, model=None, **kwargs):
        calls["patch"] += 1
        calls["kwargs"] = kwargs
        modeling_qwen2.apply_rotary_pos_emb = rope
        modeling_qwen2.Qwen2RMSNorm = FakeNorm
        modeling_qwen2.Qwen2MLP = FakeNorm
        for layer in model.model.layers:
            for name, kind in (("input_layernorm", "norm"), ("mlp", "mlp")):
                module = getattr(layer, name)
                stock = type(module).forward

                def counted(self, *a, _stock=stock, _kind=kind, **k):
                    calls[_kind] += 1
                    return _stock(self, *a, **k)

                module.__dict__["forward"] = counted.__get__(module)

    names = ("rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", "swiglu", "model")
    apply_liger_kernel_to_qwen2.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]
    )  # Liger's own parameters (plora passes only what the patch accepts)
    pkg = types.ModuleType("liger_kernel")
    mod = types.ModuleType("liger_kernel.transformers")
    mod.apply_liger_kernel_to_qwen2 = apply_liger_kernel_to_qwen2  # type: ignore[attr-defined]
    pkg.transformers = mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", mod)
    monkeypatch.setattr(fused_cfg, "liger_installed", lambda: True)
    for name, value in list(vars(modeling_qwen2).items()):  # restored after the test
        monkeypatch.setattr(modeling_qwen2, name, value)
    return calls


def test_cpu_never_applies_liger(fake_liger) -> None:
    model = tiny_model("qwen2")
    before = dict(vars(modeling_qwen2))
    assert liger.apply_fused_kernels(model, "auto", device="cpu") is False
    assert liger.apply_fused_kernels(model, "auto") is False  # the model's own device: CPU
    assert fake_liger["patch"] == 0 and not liger.is_fused(model)
    assert dict(vars(modeling_qwen2)) == before
    assert all("forward" not in vars(m) for m in model.modules())
    with pytest.raises(ConfigError, match="CUDA only"):
        liger.apply_fused_kernels(model, "on", device="cpu")
    assert fake_liger["patch"] == 0


def test_patch_is_confined_to_its_model(fake_liger) -> None:
    """Liger's module-wide rebinding is undone: RoPE runs Liger's only inside the patched
    model's layers (also when checkpointing recomputes them), later models are stock."""
    model = tiny_model("qwen2")
    other = copy.deepcopy(model)
    classes = (modeling_qwen2.Qwen2RMSNorm, modeling_qwen2.Qwen2MLP)
    liger.patch_instance(
        model, sys.modules["liger_kernel.transformers"].apply_liger_kernel_to_qwen2
    )
    assert fake_liger["kwargs"] == {"rope": True, "rms_norm": True, "swiglu": True,
                                    "cross_entropy": False, "fused_linear_cross_entropy": False}  # fmt: skip
    assert (modeling_qwen2.Qwen2RMSNorm, modeling_qwen2.Qwen2MLP) == classes
    assert "forward" not in vars(model)  # no Liger loss: the model's forward is the stock one
    layers = len(model.model.layers)
    ids = torch.randint(3, 60, (2, 9))

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    out = model(input_ids=ids).logits
    assert fake_liger["rope"] == layers and fake_liger["norm"] == layers
    assert fake_liger["mlp"] == layers
    out.float().pow(2).mean().backward(inputs=[model.model.embed_tokens.weight.requires_grad_()])
    assert fake_liger["rope"] == 2 * layers  # recomputed in backward: Liger's again
    counts = dict(fake_liger)
    ref = other(input_ids=ids).logits  # a model never patched: stock RoPE, norms, MLPs
    assert {k: fake_liger[k] for k in ("rope", "norm", "mlp")} == {
        k: counts[k] for k in ("rope", "norm", "mlp")
    }
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # pass-through fakes: same numbers
    fresh = modeling_qwen2.Qwen2ForCausalLM(model.config)
    assert type(fresh.model.norm) is classes[0]


def test_apply_is_idempotent(fake_liger, monkeypatch) -> None:
    model = tiny_model("qwen2")
    # pretend the model runs on CUDA: the patch itself touches no kernel
    monkeypatch.setattr(liger, "use_fused_kernels", lambda *a, **k: True)
    assert liger.apply_fused_kernels(model, "on", device="cpu") is True
    assert liger.apply_fused_kernels(model, "on", device="cpu") is True
    assert fake_liger["patch"] == 1 and liger.is_fused(model)
    model(input_ids=torch.randint(3, 60, (1, 5)))
    assert fake_liger["rope"] == len(model.model.layers)  # wrapped once, not twice


def test_session_on_cpu_runs_stock_and_refuses_on(tmp_path, fake_liger) -> None:
    """The resident engine resolves the sweep's switch on the model it loads."""
    from plora.config import DatasetSpec, ModelRef
    from plora.engine import EngineSpec, PackSession

    data = DatasetSpec(builtin="arithmetic", num_examples=16, max_seq_len=32)
    spec = EngineSpec(model=ModelRef(name_or_path="tiny-qwen2"), dataset=data, device="cpu")
    session = PackSession(spec)
    assert session.fused_kernels is False and fake_liger["patch"] == 0
    on = EngineSpec(model=ModelRef(name_or_path="tiny-qwen2"), dataset=data, device="cpu",
                    fused_kernels=FusedKernels.ON)  # fmt: skip
    with pytest.raises(ConfigError, match="CUDA only"):
        PackSession(on)


@pytest.mark.skipif(not REAL_PROBE(), reason="liger_kernel not installed")
def test_real_liger_patches_every_supported_type() -> None:
    """Every type in LIGER_MODEL_TYPES has Liger's patch with the arguments plora passes, and on
    a (CPU-built, never run) model the patch binds Liger's norm and MLP and nothing else."""
    import liger_kernel.transformers as lk

    for model_type in fused_cfg.LIGER_MODEL_TYPES:
        params = inspect.signature(getattr(lk, f"apply_liger_kernel_to_{model_type}")).parameters
        assert {"rope", "rms_norm", "swiglu", "cross_entropy", "model"} <= set(params)
    for name in ("qwen2", "llama"):
        model = tiny_model(name)
        modeling = sys.modules[type(model).__module__]
        before = dict(vars(modeling))
        try:
            liger.patch_instance(model, getattr(lk, f"apply_liger_kernel_to_{name}"))
            changed = {k for k, v in vars(modeling).items() if before.get(k) is not v}
            assert changed == {"apply_rotary_pos_emb"}
            assert isinstance(modeling.apply_rotary_pos_emb, liger._LayerSwitch)
            layer = model.model.layers[0]
            assert layer.input_layernorm.forward.__func__ is lk.LigerRMSNorm.forward
            assert layer.mlp.forward.__func__ is lk.LigerSwiGLUMLP.forward
            assert "forward" not in vars(model)
        finally:
            for k, v in before.items():
                setattr(modeling, k, v)


def test_validate_refuses_on_without_liger(tmp_path, monkeypatch) -> None:
    """``plora validate`` (what ``plora sweep`` checks first) prints one line naming the file,
    the key and the install command, before any model is loaded for training."""
    from typer.testing import CliRunner

    from plora.cli import app

    path = tmp_path / "s.yaml"
    path.write_text(
        "name: s\nmodel: tiny-qwen2\n"
        "dataset: {builtin: arithmetic, num_examples: 50, max_seq_len: 64}\n"
        "hardware: {gpu_type: H100, num_gpus: 1}\ntraining: {fused_kernels: on}\n"
        "space: {lr: 1.0e-3, batch_size: 2, rank: 8, alpha_ratio: 2, max_steps: 5}\n"
    )
    monkeypatch.setattr(fused_cfg, "liger_installed", lambda: False)
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{path}: training.fused_kernels='on': Liger-Kernel is not installed" in lines[0]
    assert 'pip install "plora[liger]"' in lines[0]
    monkeypatch.setattr(fused_cfg, "liger_installed", lambda: True)
    assert CliRunner().invoke(app, ["validate", str(path)]).exit_code == 0
