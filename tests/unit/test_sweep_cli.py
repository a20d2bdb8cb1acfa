"""``plora sweep`` / ``plora status``: bad inputs give one error line, exit 2, and no sweep dir."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from plora.cli import app

ROOT = Path(__file__).resolve().parents[2]


def sweep_file(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text())
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data[section] = {**(data.get(section) or {}), field: value}
            if field == "path":
                data[section].pop("builtin", None)
        else:
            data[section] = value
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def assert_one_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for n in needles:
        assert n in lines[0], lines[0]


def no_sweep_dir(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))
    assert not list(out.parent.glob(f".{out.name}.lock*"))  # the sweep's lock is released


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"dataset__path": "missing.jsonl"}, ("missing.jsonl", "not found")),
        ({"model": "./no/such/model/dir"}, ("model.name_or_path", "model directory not found")),
    ],
)
def test_bad_inputs_fail_before_any_dir(tmp_path, changes, needles) -> None:
    out = tmp_path / "out"
    assert_one_error(
        run("sweep", str(sweep_file(tmp_path, **changes)), "--out", str(out)), *needles
    )
    no_sweep_dir(out)


def test_empty_dataset(tmp_path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    out = tmp_path / "out"
    path = sweep_file(tmp_path, dataset__path=str(tmp_path / "empty.jsonl"))
    result = run("sweep", str(path), "--out", str(out))
    assert_one_error(result, "empty.jsonl")
    no_sweep_dir(out)


def test_unreachable_address(tmp_path) -> None:
    out = tmp_path / "out"
    result = run("sweep", str(sweep_file(tmp_path)), "--out", str(out), "--address", "127.0.0.1:1")
    assert_one_error(result, "--address 127.0.0.1:1", "cannot reach")
    no_sweep_dir(out)


def test_unwritable_out(tmp_path) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    out = blocker / "sub" / "out"
    assert_one_error(
        run("sweep", str(sweep_file(tmp_path)), "--out", str(out)), "--out", "writable"
    )


def test_existing_out_needs_resume_and_resume_needs_a_sweep(tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    path = str(sweep_file(tmp_path))
    assert_one_error(run("sweep", path, "--out", str(out)), "already exists", "--resume")
    assert_one_error(run("sweep", path, "--out", str(out), "--resume"), "no sweep to resume")
    assert_one_error(run("status", str(out)), "not a plora sweep directory")


def test_status_and_progress_read_a_sweep_dir(tmp_path) -> None:
    import io
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from runtime_fakes import AffineCost, GreedyPlanner, lora, outcome

    from plora.runtime.coordinator import Coordinator
    from plora.runtime.progress import Progress
    from plora.sweepdir.store import SweepStore

    store = SweepStore(tmp_path)
    (tmp_path / "sweep.yaml").write_text("name: s\nmetric: eval_metric\n")  # ranked by it
    configs = [lora(i, rank=30) for i in range(3)]
    coord = Coordinator(
        cost=AffineCost(), num_gpus=2, configs=configs, planner=GreedyPlanner(), store=store
    )
    launches = coord.start()
    buf = io.StringIO()
    show = Progress(stream=buf, live=False)
    show(coord.snapshot())
    assert "running 2 queued 1 failed 0 | jobs 2 | GPUs busy 2/2" in buf.getvalue()
    spec = launches[0]
    res = {c.config_id: {"status": "completed", "steps": 10, "eval_metric": 0.25 + i / 10, "eval_loss": 1.0}
           for i, c in enumerate(spec.configs)}  # fmt: skip
    coord.on_job_finished(spec.job_id, outcome(spec.job_id, res))
    result = run("status", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert (
        "not finished" in result.output
        and "done 1" in result.output
        and "running 2" in result.output
    )
    assert "best by eval_metric" in result.output and spec.config_ids[0] in result.output
    result = run("report", str(tmp_path), "--out", str(tmp_path / "r.md"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.md").is_file() and (tmp_path / "r_files" / "jobs_gantt.png").is_file()
    assert_one_error(run("report", str(tmp_path), "--out", str(tmp_path / "r.pdf")), ".html or .md")


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (["--log-to", "mlflow"], {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"},
         ("logging.mlflow", "MLflow cannot start (tracking URI http://127.0.0.1:9)")),
        (["--log-to", "wandb"], {"WANDB_MODE": "online"},
         ("logging.wandb", "W&B cannot log in", "mode: offline")),
        (["--log-to", "tensorboard"], {}, ("--log-to='tensorboard'", "must be one of mlflow, wandb")),
    ],
)  # fmt: skip
def test_a_sink_that_cannot_start_is_one_line_before_any_dir(tmp_path, monkeypatch, args, env,
                                                             needles) -> None:  # fmt: skip
    """An MLflow server that does not answer, W&B online without credentials: one line, exit 2,
    before Ray starts or anything is written (the sinks open before anything else starts)."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no W&B credentials
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    result = run("sweep", str(ROOT / "sweeps" / "quickstart.yaml"), "--out", str(out), *args)
    assert_one_error(result, *needles)
    no_sweep_dir(out)
