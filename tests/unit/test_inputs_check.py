"""``plora validate`` rejects what ``plora sweep`` would (issue 14, items 4 and 5): dataset files
and rows, model directories, hub ids without network (fast, one line); a space over
``planner.max_configs`` refused before it is expanded; adapters that name their base model so a
copied sweep directory still loads with ``AutoPeftModelForCausalLM``."""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
import yaml
from test_sweep_cli import assert_one_error, no_sweep_dir, run, sweep_file

from plora.config import ConfigError, SweepConfig

NO_SUCH_HUB_ID = "plora-test-org/no-such-model-7f3a"


def _space_of_a_million() -> dict:
    ten = list(range(1, 11))
    return {
        "lr": [i * 1.0e-4 for i in ten], "rank": ten, "alpha": ten, "batch_size": ten,
        "dropout": [i / 100 for i in range(10)], "max_steps": ten,
    }  # fmt: skip


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_a_million_configs_is_refused_at_once_naming_the_keys(tmp_path, command) -> None:
    path = sweep_file(tmp_path, space=_space_of_a_million())
    t0 = time.perf_counter()
    result = run(command, str(path))
    assert time.perf_counter() - t0 < 5.0  # it expanded nothing (was 171 s and 742 MB)
    assert_one_error(result, "1,000,000 configs", "planner.max_configs=10,000", "sweep.yaml")
    for key in ("lr", "rank", "alpha", "batch_size", "dropout", "max_steps"):
        assert f"space.{key} (10)" in result.output


def test_max_configs_is_configurable_and_size_needs_no_expansion(tmp_path) -> None:
    path = sweep_file(tmp_path, space=_space_of_a_million(), planner={"max_configs": 10**6})
    t0 = time.perf_counter()
    sweep = SweepConfig.from_yaml(path)
    assert sweep.num_configs == 10**6 and time.perf_counter() - t0 < 2.0
    assert sweep.size_factors()["space.rank"] == 10
    data = yaml.safe_load(path.read_text())
    data.update(search="random", num_samples=20001, planner={})
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(
        ConfigError,
        match=r"num_samples: 20,001 configs \(num_samples \(20001\)\).*lower num_samples",
    ):
        SweepConfig.from_yaml(path)


def _bad_dataset(tmp_path: Path, kind: str) -> dict:
    if kind == "directory":
        d = tmp_path / "data"
        d.mkdir()
        (d / "rows.txt").write_text('{"text": "a"}\n')
        return {"path": str(d)}
    f = tmp_path / "rows.jsonl"
    rows = {
        "bad_json": '{"text": "ok"}\n{"text": oops}\n',
        "no_fields": '{"text": "ok"}\n{"question": "what?"}\n',
        "not_object": '{"text": "ok"}\n[1, 2]\n',
    }[kind]
    f.write_text(rows * 3)
    return {"path": str(f), "max_seq_len": 32}


@pytest.mark.parametrize(
    ("kind", "needle"),
    [("directory", "save_to_disk"), ("bad_json", "invalid JSON"),
     ("no_fields", "rows.jsonl:2"), ("not_object", "not a JSON object")],
)  # fmt: skip
def test_validate_rejects_the_dataset_sweep_rejects(tmp_path, kind, needle) -> None:
    from plora.runtime.prepare import prepare

    path = sweep_file(tmp_path, dataset=_bad_dataset(tmp_path, kind))
    result = run("validate", str(path))
    assert_one_error(result, needle)
    with pytest.raises(ConfigError) as err:  # what `plora sweep` runs before training
        prepare(SweepConfig.from_yaml(path))
    assert result.output.split("error: ", 1)[1].split()[0] == str(err.value).split()[0]


def test_validate_rejects_a_model_directory_without_tokenizer(tmp_path) -> None:
    from plora.models import resolve_model_path

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(Path(resolve_model_path("tiny-qwen2")) / "config.json", model / "config.json")
    result = run("validate", str(sweep_file(tmp_path, model=str(model))))
    assert_one_error(result, "model.name_or_path=", "tokenizer")


def test_validate_ok_reports_the_data_it_read(tmp_path) -> None:
    result = run("validate", str(sweep_file(tmp_path)))
    assert result.exit_code == 0, result.output
    assert "ok (8 configs" in result.output and "2000 train / 200 eval rows" in result.output


@pytest.fixture
def hub_id_sweep(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return sweep_file(tmp_path, model=NO_SUCH_HUB_ID)


def test_hub_id_offline_is_one_fast_line_in_validate_and_sweep(tmp_path, hub_id_sweep, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for args in (["validate", str(hub_id_sweep)],
                 ["sweep", str(hub_id_sweep), "--out", str(tmp_path / "out")]):  # fmt: skip
        t0 = time.perf_counter()
        result = run(*args)
        assert time.perf_counter() - t0 < 15.0  # imports included; was 54 s of retries
        assert_one_error(result, f"model.name_or_path='{NO_SUCH_HUB_ID}'", "HF_HUB_OFFLINE")
    no_sweep_dir(tmp_path / "out")


def test_hub_unreachable_is_one_line(tmp_path, hub_id_sweep, monkeypatch) -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for command in ("validate", "plan"):  # plan reads the model's config from the hub too
        t0 = time.perf_counter()
        result = run(command, str(hub_id_sweep))
        assert time.perf_counter() - t0 < 15.0  # imports included; was about a minute of retries
        assert_one_error(result, "cannot reach the Hugging Face hub", "HF_HUB_OFFLINE=1")


def test_hub_that_never_answers_times_out(monkeypatch) -> None:
    from plora.config import ModelRef
    from plora.models.hub import check_hub_model

    server = socket.socket()  # the kernel completes the connection (backlog); nobody answers
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    t0 = time.perf_counter()
    try:
        with pytest.raises(ConfigError, match=r"within 0\.5s"):
            check_hub_model(ModelRef(name_or_path=NO_SUCH_HUB_ID), timeout_s=0.5)
    finally:
        server.close()
    assert time.perf_counter() - t0 < 4.0


def test_copied_sweep_dir_loads_with_auto_peft_from_anywhere(tmp_path, monkeypatch, one_thread):
    """Issue 29: the adapter names its base by the absolute path of the sweep's ``base_model/``
    (PEFT's way for a local base): with the model cache gone, a copy of the sweep directory
    loads with ``AutoPeftModelForCausalLM`` from any working directory; with the original gone
    too, the copy's own base loads it the explicit way."""
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    from plora.config import DatasetSpec, LoRAConfig, ModelRef
    from plora.engine import run_pack
    from plora.models import resolve_model_path, save_base_model

    cache = tmp_path / "cache"  # a private model cache, deleted below
    shutil.copytree(Path(resolve_model_path("tiny-qwen2")).parent, cache / "tiny")
    monkeypatch.setenv("PLORA_CACHE_DIR", str(cache))
    ref = ModelRef(name_or_path="tiny-qwen2")
    sweep_dir = tmp_path / "runs" / "qs"
    save_base_model(ref, sweep_dir / "base_model")
    cfg = LoRAConfig(config_id="c0", rank=4, alpha=8, lr=5e-3, batch_size=2, max_steps=2)
    data = DatasetSpec(builtin="arithmetic", num_examples=16, max_seq_len=32)
    run_pack(model=ref, configs=[cfg], dataset=data, out_dir=sweep_dir, evaluate=False)
    meta = json.loads((sweep_dir / "adapters" / "c0" / "adapter_config.json").read_text())
    assert meta["base_model_name_or_path"] == str(sweep_dir / "base_model")
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(sweep_dir / "base_model")
        want = PeftModel.from_pretrained(base, sweep_dir / "adapters" / "c0")(ids).logits
    shutil.rmtree(cache)
    copy = tmp_path / "elsewhere" / "qs"
    shutil.copytree(sweep_dir, copy)
    for cwd in (tmp_path, copy, copy / "adapters"):
        monkeypatch.chdir(cwd)
        with torch.no_grad():
            got = AutoPeftModelForCausalLM.from_pretrained(copy / "adapters" / "c0")(ids).logits
        torch.testing.assert_close(got, want)
    shutil.rmtree(tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(copy / "base_model")
        got = PeftModel.from_pretrained(base, copy / "adapters" / "c0")(ids).logits
    torch.testing.assert_close(got, want)


def test_adapter_base_name_by_kind(tmp_path) -> None:
    from plora.config import ModelRef
    from plora.engine.checkpoint import adapter_base_name

    hub = ModelRef(name_or_path="Qwen/Qwen2.5-0.5B")
    assert adapter_base_name(hub, "Qwen/Qwen2.5-0.5B", tmp_path) == "Qwen/Qwen2.5-0.5B"
    tiny = ModelRef(name_or_path="tiny-qwen2")
    assert adapter_base_name(tiny, "/cache/tiny-qwen2-x", tmp_path) == "/cache/tiny-qwen2-x"
    (tmp_path / "base_model").mkdir()
    assert adapter_base_name(tiny, "/cache/tiny-qwen2-x", tmp_path) == str(tmp_path / "base_model")
    (tmp_path / "base_model" / "config.json").write_text("{}")
    local = ModelRef(name_or_path=str(tmp_path / "base_model"))  # a local base: its absolute path
    assert adapter_base_name(local, str(tmp_path / "base_model"), tmp_path / "out") == str(
        tmp_path / "base_model"
    )


def test_builtin_task_size_is_bounded_and_validate_samples_it(tmp_path) -> None:
    path = sweep_file(tmp_path, dataset={"builtin": "arithmetic", "num_examples": 10**9})
    t0 = time.perf_counter()
    assert_one_error(run("validate", str(path)), "dataset.num_examples=1000000000", "at most")
    assert time.perf_counter() - t0 < 5.0  # was: generating 10^9 rows, never answering
    path = sweep_file(tmp_path, dataset={"builtin": "arithmetic", "num_examples": 100_000,
                                         "max_seq_len": 32})  # fmt: skip
    t0 = time.perf_counter()
    result = run("validate", str(path))
    assert result.exit_code == 0, result.output
    assert "/ 10000 eval rows (a sample of 5000 checked)" in result.output
    assert time.perf_counter() - t0 < 20.0
