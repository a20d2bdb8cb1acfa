"""Sweep-level configuration: validation, YAML round trips, error messages."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from plora.config import (
    BUILTIN_DATASETS,
    GPU_TYPES,
    PLANNER_SOLVERS,
    ConfigError,
    DatasetSpec,
    HardwareConfig,
    LoRAConfig,
    ModelRef,
    PlannerOptions,
    SearchAlgo,
    SearchSpace,
    SweepConfig,
)
from plora.cost import Strategy

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "sweeps").glob("*.yaml"))

MINIMAL = """\
name: t
model: tiny-qwen2
dataset: arithmetic
space:
  lr: 1.0e-3
  batch_size: 8
  rank: 8
  alpha: 16
  max_steps: 10
"""


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# --------------------------------------------------------------------------- shipped sweeps


def test_ship_the_four_sweeps() -> None:
    names = {p.name for p in SHIPPED}
    assert {
        "paper-table1.yaml",
        "quickstart.yaml",
        "optuna-tiny.yaml",
        "qwen2.5-0.5b-gpu.yaml",
    } <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_sweeps_round_trip(path: Path, tmp_path: Path) -> None:
    sweep = SweepConfig.from_yaml(path)
    text = sweep.to_yaml()
    again = SweepConfig.from_yaml(write(tmp_path, text, path.name))
    assert again == sweep
    assert again.to_dict() == sweep.to_dict()
    assert yaml.safe_load(text) == sweep.to_dict()


def test_paper_table1_is_the_papers_testbed() -> None:
    sweep = SweepConfig.from_yaml(REPO / "sweeps" / "paper-table1.yaml")
    assert sweep.model.name_or_path == "Qwen/Qwen2.5-7B"
    assert sweep.seq_len == 1024
    assert (sweep.hardware.num_gpus, sweep.hardware.gpu_memory_gib, sweep.hardware.load_factor) == (
        8,
        40.0,
        0.9,
    )
    assert sweep.search is SearchAlgo.GRID
    # planning needs no dataset file; training does
    assert not Path(sweep.dataset.path).exists()
    with pytest.raises(ConfigError, match=r"dataset\.path"):
        sweep.check_trainable()


def test_builtin_datasets_match_the_tasks() -> None:
    from plora.tasks import TASKS

    assert set(BUILTIN_DATASETS) == set(TASKS)


# ------------------------------------------------------------------------------ dataclasses


def test_model_ref_kinds(tmp_path: Path) -> None:
    assert ModelRef(name_or_path="tiny-llama").is_builtin
    hub = ModelRef(name_or_path="Qwen/Qwen2.5-7B", dtype="bf16")
    assert (hub.dtype, hub.is_builtin, hub.is_local) == ("bfloat16", False, False)
    assert "model directory not found" in error_of(ModelRef, name_or_path=str(tmp_path / "nope"))
    (tmp_path / "m").mkdir()
    assert "no config.json" in error_of(ModelRef, name_or_path=str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{}")
    assert ModelRef(name_or_path=str(tmp_path / "m")).is_local
    assert "dtype='int8'" in error_of(ModelRef, name_or_path="tiny-qwen2", dtype="int8")
    assert "not a hub id" in error_of(ModelRef, name_or_path="what is this?")


def test_dataset_spec() -> None:
    assert DatasetSpec(builtin="sentiment").num_examples == 2000
    assert "exactly one of path and builtin" in error_of(DatasetSpec)
    assert "exactly one" in error_of(DatasetSpec, path="a.jsonl", builtin="arithmetic")
    assert "eval_fraction=1.0" in error_of(DatasetSpec, builtin="arithmetic", eval_fraction=1.0)
    assert "did you mean 'sentiment'" in error_of(DatasetSpec, builtin="sentimnt")
    spec = DatasetSpec(path="/no/such/file.jsonl")  # fine until training
    assert "path='/no/such/file.jsonl'" in error_of(spec.check_files)


def test_hardware_defaults_and_aliases() -> None:
    assert HardwareConfig().gpu_memory_gib == 141.0  # H200
    hw = HardwareConfig(gpu_type="a100_40gb", num_gpus=8)
    assert (hw.gpu_type, hw.gpu_memory_gib) == ("A100-40GB", 40.0)
    assert hw.usable_gib == pytest.approx(36.0)
    mine = HardwareConfig(gpu_type="MyAccel", gpu_memory_gib=12, peak_tflops=100)
    assert (mine.gpu_memory_gib, mine.peak_tflops) == (12.0, 100.0)
    assert HardwareConfig(gpu_type="cpu").is_cpu
    assert "num_gpus=0" in error_of(HardwareConfig, num_gpus=0)
    assert "load_factor=0" in error_of(HardwareConfig, load_factor=0)
    assert "gpu_memory_gib=-1" in error_of(HardwareConfig, gpu_memory_gib=-1)
    assert set(GPU_TYPES) >= {"A100-40GB", "H100", "H200", "cpu"}
    assert all(g.memory_gib > 0 for g in GPU_TYPES.values())  # one table: memory and speed


def test_planner_options_strategies() -> None:
    opts = PlannerOptions(strategies=["tp", "fsdp", "tp"])
    assert opts.strategies == (Strategy.TP, Strategy.FSDP)
    assert "strategies='tp'" in error_of(PlannerOptions, strategies="tp")
    assert "solver='cplex'" in error_of(PlannerOptions, solver="cplex")
    from plora.planner.solver import SOLVERS

    assert set(PLANNER_SOLVERS) == set(SOLVERS)


def test_lora_config_is_unchanged() -> None:
    cfg = LoRAConfig(
        rank=16, alpha=32, lr=1e-4, batch_size=4, max_steps=10, target_modules="attention"
    )
    assert cfg.scale == 2.0
    assert cfg.config_id == cfg.fingerprint() and re.fullmatch(r"c[0-9a-f]{10}", cfg.config_id)
    assert LoRAConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------------------- loading


def test_minimal_sweep_defaults(tmp_path: Path) -> None:
    sweep = SweepConfig.from_yaml(write(tmp_path, MINIMAL))
    assert sweep.model == ModelRef(name_or_path="tiny-qwen2")
    assert sweep.dataset == DatasetSpec(builtin="arithmetic")
    assert (sweep.search, sweep.num_samples, sweep.metric, sweep.mode) == (
        "grid",
        1,
        "eval_loss",
        "min",
    )
    assert sweep.seq_len == 256
    assert isinstance(sweep.space, SearchSpace)
    assert sweep.source == str(tmp_path / "s.yaml")


def test_name_defaults_to_file_stem_and_mode_follows_metric(tmp_path: Path) -> None:
    text = MINIMAL.replace("name: t\n", "") + "metric: eval_metric\n"
    sweep = SweepConfig.from_yaml(write(tmp_path, text, "my-sweep.yaml"))
    assert (sweep.name, sweep.mode) == ("my-sweep", "max")


def test_relative_paths_resolve_against_the_sweep_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    text = MINIMAL.replace(
        "dataset: arithmetic", "dataset: {path: data/train.jsonl, eval_path: ../ev.jsonl}"
    )
    sweep = SweepConfig.from_yaml(write(tmp_path / "sub", text))
    assert sweep.dataset.path == str(tmp_path / "sub" / "data" / "train.jsonl")
    assert sweep.dataset.eval_path == str(tmp_path / "ev.jsonl")


def test_local_model_dir_relative_to_sweep(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    sweep = SweepConfig.from_yaml(write(tmp_path, MINIMAL.replace("tiny-qwen2", "./base")))
    assert sweep.model.name_or_path == str(tmp_path / "base")


def test_seq_len_shorthand(tmp_path: Path) -> None:
    sweep = SweepConfig.from_yaml(write(tmp_path, MINIMAL + "seq_len: 512\n"))
    assert sweep.dataset.max_seq_len == 512 and sweep.seq_len == 512
    text = MINIMAL.replace(
        "dataset: arithmetic", "dataset: {builtin: arithmetic, max_seq_len: 128}"
    )
    msg = error_of(SweepConfig.from_yaml, write(tmp_path, text + "seq_len: 512\n"))
    assert "seq_len=512" in msg
    planner = SweepConfig.from_yaml(write(tmp_path, MINIMAL + "planner: {seq_len: 64}\n"))
    assert planner.seq_len == 64


def test_yaml_1_1_exponent_strings_are_numbers(tmp_path: Path) -> None:
    sweep = SweepConfig.from_yaml(write(tmp_path, MINIMAL.replace("lr: 1.0e-3", "lr: 2e-5")))
    assert sweep.space.lr.values == (2e-5,)


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (("  rank: 8", "  rank: -4"), (":7:", "space.rank=-4", "must be >= 1")),
        (("lr: 1.0e-3", "lr: {loguniform: {low: 0, high: 1.0e-3}}"), (":5:", "space.lr.low=0", "must be > 0")),
        (("max_steps: 10", "max_steps: 10\n  epochs: 1"), ("space.max_steps", "exactly one of epochs")),
        (("name: t", "name: 'bad name'"), (":1:", "name='bad name'",)),
        (("model: tiny-qwen2", "model: {dtype: bf16}"), ("model.name_or_path", "missing required key")),
        (("dataset: arithmetic", "dataset: {builtin: arithmetic, num_exmples: 5}"), ("dataset.num_exmples=5", "did you mean 'num_examples'")),
        (("name: t", "name: t\nnum_samples: 0"), (":2:", "num_samples=0")),
        (("name: t", "name: t\nhardware: [8]"), ("hardware=[8]", "must be a mapping")),
    ],
)  # fmt: skip
def test_errors_name_file_line_key_and_value(
    tmp_path: Path, edit: tuple[str, str], needles: tuple[str, ...]
) -> None:
    assert edit[0] in MINIMAL
    path = write(tmp_path, MINIMAL.replace(edit[0], edit[1]))
    msg = error_of(SweepConfig.from_yaml, path)
    assert msg.startswith(str(path))
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_missing_empty_and_non_mapping_files(tmp_path: Path) -> None:
    assert "file not found" in error_of(SweepConfig.from_yaml, tmp_path / "none.yaml")
    assert "empty sweep file" in error_of(SweepConfig.from_yaml, write(tmp_path, "# nothing\n"))
    assert "must be a mapping" in error_of(SweepConfig.from_yaml, write(tmp_path, "- 1\n- 2\n"))


def test_config_error_located_keeps_subclass_and_renders_one_line() -> None:
    class Special(ConfigError):
        pass

    err = Special("must be > 0", key="low", value=-1.0, fix="use\n a positive value")
    moved = err.located(file="x.yaml", prefix="space.lr", lines={"space.lr": 7})
    assert isinstance(moved, Special)
    assert str(moved) == "x.yaml:7: space.lr.low=-1.0: must be > 0; use a positive value"
    assert str(ConfigError("plain message")) == "plain message"


def test_replace_revalidates(tmp_path: Path) -> None:
    sweep = SweepConfig.from_yaml(write(tmp_path, MINIMAL))
    with pytest.raises(ConfigError, match="num_gpus=0"):
        dataclasses.replace(sweep.hardware, num_gpus=0)
    with pytest.raises(ConfigError, match="mode='max'"):
        dataclasses.replace(sweep, mode="max")


def test_gpu_names_are_spelling_insensitive_but_distinct() -> None:
    for name in GPU_TYPES:
        for spelling in (name, name.lower(), name.replace("-", "_"), name.replace("-", " ")):
            assert HardwareConfig(gpu_type=spelling).gpu_type == name
    assert HardwareConfig(gpu_type="A100-40G").gpu_type == "A100-40GB"
    assert "peak_tflops=0" in error_of(
        HardwareConfig, gpu_type="X", gpu_memory_gib=8, peak_tflops=0
    )


def test_unknown_gpu_plans_with_its_peak(tmp_path: Path) -> None:
    from plora.cost.build import build_cost_model

    text = MINIMAL.replace("model: tiny-qwen2", "model: Qwen/Qwen2.5-0.5B")
    hw = "hardware: {gpu_type: MI300X, gpu_memory_gib: 192, peak_tflops: 1307}\n"
    sweep = SweepConfig.from_yaml(write(tmp_path, text + hw))
    assert sweep.hardware.peak_tflops == 1307.0
    assert build_cost_model(sweep, use_profile=False).capacity(1) == pytest.approx(
        0.9 * 192 * 2**30
    )


def test_lora_to_dict_is_every_field_as_asdict_gives_it() -> None:
    """``to_dict`` reads the fields without ``dataclasses.asdict``'s deep copy: the same dict
    (keys in field order, tuples as lists, the schedule as str) for a config with no default
    left, and the same ``config_id`` hash as before (it hashes these values)."""
    c = LoRAConfig(rank=8, alpha=16.0, lr=3e-4, batch_size=4, target_modules=("q_proj", "o_proj"),
                   dropout=0.1, max_steps=50, warmup_steps=5, schedule="cosine",
                   weight_decay=0.01, max_grad_norm=None, use_rslora=True, seed=7)  # fmt: skip
    ref = dataclasses.asdict(c)
    ref["target_modules"], ref["schedule"] = list(ref["target_modules"]), str(ref["schedule"])
    assert c.to_dict() == ref and list(c.to_dict()) == list(ref)
    assert LoRAConfig.from_dict(c.to_dict()) == c
    hparams = {k: v for k, v in ref.items() if k != "config_id"}
    blob = json.dumps(hparams, sort_keys=True, default=str).encode()
    assert LoRAConfig(**{**dataclasses.asdict(c), "config_id": ""}).config_id == (
        "c" + hashlib.sha1(blob).hexdigest()[:10]
    )
