"""``plora sweep``: run a sweep on Ray with a live progress view; Ctrl-C says how to resume."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from plora.api import load_sweep
from plora.cli.app import EXIT_INTERRUPTED, app, print_warnings, user_errors
from plora.utils import fmt_duration


@app.command()
def sweep(
    sweep_file: Annotated[Path, typer.Argument(metavar="SWEEP.yaml", help="Sweep definition.")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Sweep directory (default runs/<name>).")
    ] = None,
    address: Annotated[
        str | None,
        typer.Option("--address", help="Ray cluster address (auto, host:port); default local."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the sweep in --out from its state.json.")
    ] = False,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", min=1, help="Train-state checkpoint every N steps.")
    ] = 50,
    checkpoint_minutes: Annotated[
        float | None,
        typer.Option(
            "--checkpoint-minutes", min=0.0, help="Also checkpoint every M minutes of a job."
        ),
    ] = None,
    force_unlock: Annotated[
        bool,
        typer.Option(
            "--force-unlock",
            help="Take over --out's lock held by a sweep on another host that is known dead.",
        ),
    ] = False,
    retry_failed: Annotated[
        bool,
        typer.Option(
            "--retry-failed",
            help="With --resume: give the configs that failed another attempt (as Ray Tune's "
            "Tuner.restore(resume_errored=True); off by default).",
        ),
    ] = False,
    log_to: Annotated[
        list[str] | None,
        typer.Option(
            "--log-to",
            metavar="SINK",
            help="Also send the live curves to mlflow or wandb (repeatable): the sweep file's "
            "logging: settings, else the sink's defaults (TensorBoard's go under --out unless "
            "the file says tensorboard: false).",
        ),
    ] = None,
    allow_changed: Annotated[
        bool,
        typer.Option(
            "--allow-changed",
            help="With --resume: continue with SWEEP.yaml although it differs from the sweep "
            "the directory ran (finished configs are kept, new ones trained).",
        ),
    ] = False,
) -> None:
    """Run a sweep on Ray: plan, train every config in packed jobs, re-plan as jobs finish.

    One sweep at a time writes a sweep directory: a second ``plora sweep`` (or ``--resume``) on
    the same ``--out`` is refused while the first runs (a lock beside the directory).
    ``--resume`` refuses a SWEEP.yaml that differs from the one the directory ran, naming the
    keys that changed, unless ``--allow-changed``; failed configs are retried only with
    ``--retry-failed``. Curves are written as configs train: ``tensorboard --logdir OUT``, and
    MLflow / W&B runs with ``--log-to`` or the sweep file's ``logging:``."""
    from plora import api
    from plora.runtime.driver import RunOptions
    from plora.runtime.progress import Progress

    try:
        with user_errors(str(sweep_file)):
            spec = load_sweep(sweep_file)
            if log_to:
                spec = dataclasses.replace(spec, logging=spec.logging.with_sinks(log_to))
            print_warnings(spec)
            out = out if out is not None else Path("runs") / spec.name
            workers = "workers" if spec.hardware.is_cpu else "GPUs"  # CPU sweeps: worker slots
            with Progress(workers=workers) as progress:
                summary = api.run(
                    spec,
                    out,
                    address=address,
                    resume=resume,
                    options=RunOptions(
                        checkpoint_every=checkpoint_every,
                        checkpoint_every_s=None
                        if checkpoint_minutes is None
                        else 60 * checkpoint_minutes,
                        force_unlock=force_unlock,
                        retry_failed=retry_failed,
                        allow_changed=allow_changed,
                    ),
                    on_update=progress,
                )
    except KeyboardInterrupt:
        typer.echo(interrupted_hint(sweep_file, out), err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    c = summary.counts
    typer.echo(
        f"sweep {summary.out}: {c['done']} done, {c['stopped']} stopped, {c['failed']} failed "
        f"in {fmt_duration(summary.wall_s)} (set-up {fmt_duration(summary.setup_s)}: Ray "
        f"{fmt_duration(summary.ray_start_s)}, then inputs {fmt_duration(summary.inputs_wait_s)}; "
        f"wind-down {fmt_duration(summary.teardown_s)}); see `plora status {summary.out}`"
    )
    if not resume:  # how well the plan foretold the sweep (a resumed run's first plan is older)
        from plora.analysis.plan_check import plan_check

        with contextlib.suppress(ValueError, OSError):
            check = plan_check(summary.out)
            typer.echo(
                f"plan: {fmt_duration(check.planned_s)} predicted, "
                f"{fmt_duration(check.measured_s)} taken from it ({check.ratio:.2f}x)"
            )
    for line in summary.data_lines:  # once, here: a line before would scroll off the progress
        typer.echo(line)
    if summary.samples_line:
        typer.echo(summary.samples_line)
    from plora.runtime.timeline import timeline_line

    typer.echo(timeline_line(summary.timeline))  # where the run's seconds went, from its start
    if not summary.ok:
        if not retry_failed:
            typer.echo(
                f"{c['failed']} configs failed (see `plora status {summary.out}`); "
                f"`plora sweep {sweep_file} --out {summary.out} --resume --retry-failed` "
                "gives them another attempt",
                err=True,
            )
        raise typer.Exit(1)


def interrupted_hint(sweep_file: Path, out: Path | None) -> str:
    """The one line ``plora sweep`` prints on Ctrl-C: how to continue."""
    if out is not None and (out / "state.json").is_file():
        return (f"interrupted: {out} keeps every finished config and the latest checkpoints; "
                f"continue with `plora sweep {sweep_file} --out {out} --resume`")  # fmt: skip
    return "interrupted before the sweep directory was created; nothing was written, rerun to start"


__all__ = ["interrupted_hint", "sweep"]
