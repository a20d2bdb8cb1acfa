"""``plora status`` and ``plora report``: read a (possibly partial) sweep directory."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from plora.api import load as load_results
from plora.cli.app import app, check_output_path, user_errors


@app.command()
def status(
    sweep_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A `plora sweep --out` dir.")],
) -> None:
    """Show a sweep directory: configs by status, jobs, the latest plan, the best configs."""
    from plora.analysis.plan_check import plan_check
    from plora.runtime.progress import status_text

    with user_errors():
        text = status_text(str(sweep_dir))
    typer.echo(text)
    # a finished first run: how well its plan foretold it, part by part (else nothing to say)
    with contextlib.suppress(ValueError, KeyError, OSError):
        typer.echo(f"first plan vs the run: {plan_check(sweep_dir).describe()}")


@app.command()
def report(
    sweep_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A `plora sweep --out` dir.")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Report file, .html or .md (default DIR/report.html)."),
    ] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Rows in the best-config table.")] = 10,
) -> None:
    """Write a sweep's report: best configs, a Gantt chart of its jobs, loss curves, HP effects.

    A partial sweep directory is reported as far as it goes (a note says what is missing); one
    without any result or training step is an error (exit 2)."""
    from plora.analysis.report import write_report

    with user_errors():
        res = load_results(sweep_dir)
        out = out if out is not None else res.path / "report.html"
        check_output_path(out, "--out", None)  # write_report checks the format
        path = write_report(res, out, k=top)
    if res.missing:
        typer.echo(f"note: {sweep_dir} is partial; {res.missing_note}", err=True)
    typer.echo(f"wrote {path}")


__all__ = ["report", "status"]
