"""The CLI's one error boundary (issue 14, item 4): any exception in a command is one line and
exit 2, ``--debug`` / ``PLORA_DEBUG=1`` show the traceback; ``--version``; Ctrl-C in a sweep."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sweep_cli import assert_one_error, run, sweep_file

import plora.cli.planning


@pytest.fixture
def crashing_load(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("kaboom in the loader\nsecond line")

    monkeypatch.setattr(plora.cli.planning, "load_sweep", boom)
    monkeypatch.delenv("PLORA_DEBUG", raising=False)


@pytest.mark.parametrize("command", ["plan", "validate"])
def test_unexpected_exception_is_one_line_and_exit_2(tmp_path, crashing_load, command) -> None:
    result = run(command, str(sweep_file(tmp_path)))
    assert_one_error(
        result, f"plora {command} failed", "RuntimeError: kaboom in the loader", "--debug"
    )
    assert "second line" not in result.output and "Traceback" not in result.output


def test_os_error_names_the_path_and_what_to_do(tmp_path, monkeypatch) -> None:
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "x.parquet"))

    import plora.runtime.progress as progress

    monkeypatch.setattr(progress, "status_text", denied)
    result = run("status", str(tmp_path))
    assert_one_error(result, "plora status failed", "PermissionError", "x.parquet", "permissions")


@pytest.mark.parametrize("how", ["option", "env"])
def test_debug_shows_the_traceback(tmp_path, crashing_load, monkeypatch, how) -> None:
    args = ["validate", str(sweep_file(tmp_path))]
    if how == "option":
        args = ["--debug", *args]
    else:
        monkeypatch.setenv("PLORA_DEBUG", "1")
    result = run(*args)
    assert isinstance(result.exception, RuntimeError)  # not turned into an error line
    assert "error:" not in result.output and result.exc_info is not None


def test_config_error_keeps_its_message_with_debug(tmp_path) -> None:
    result = run("--debug", "validate", str(tmp_path / "missing.yaml"))
    assert result.exit_code == 2 and "missing.yaml" in result.output
    assert "failed:" not in result.output


def test_version() -> None:
    from importlib.metadata import version

    result = run("--version")
    assert result.exit_code == 0 and result.output.strip() == f"plora {version('plora')}"


def test_ctrl_c_in_sweep_hints_resume(tmp_path, monkeypatch) -> None:
    import plora.api

    out = tmp_path / "out"
    made = {}

    def interrupted(spec, out_, **kwargs):
        if made.get("dir"):
            out_.mkdir()
            (out_ / "state.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(plora.api, "run", interrupted)
    path = sweep_file(tmp_path)
    result = run("sweep", str(path), "--out", str(out))
    assert result.exit_code == 130 and len(result.output.strip().splitlines()) == 1
    assert "nothing was written" in result.output
    made["dir"] = True
    result = run("sweep", str(path), "--out", str(out))
    assert result.exit_code == 130 and len(result.output.strip().splitlines()) == 1
    assert f"plora sweep {path} --out {out} --resume" in result.output
    assert Path(out / "state.json").is_file()


def test_usage_errors_and_help_pass_through() -> None:
    result = run("validate")
    assert result.exit_code == 2 and "Missing argument" in result.output
    assert "failed:" not in result.output
    assert run("--help").exit_code == 0
