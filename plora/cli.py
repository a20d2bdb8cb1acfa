"""The ``plora`` command line: ``plora plan | validate`` (and ``sweep | status | report``).

Commands only parse and print: the work is :mod:`plora.api` (plan, run, load). Bad input of any kind
(a :class:`~plora.config.ConfigError`, including the planner's ``NoFeasibleJobError``) ends the
command with one red ``error: ...`` line on stderr, exit code 2 and nothing written; use
:func:`user_errors` and :func:`plora.api.load_sweep` in new commands to get the same behaviour.
Any other exception is caught by the app's one error boundary (:class:`_ErrorBoundary`): one line
``error: plora CMD failed: TYPE: CAUSE; WHAT TO DO`` and exit 2, or the traceback with
``plora --debug`` / ``PLORA_DEBUG=1``. Ctrl-C in ``plora sweep`` prints how to ``--resume``
(exit 130).
Heavy modules (torch, ray, cvxpy, matplotlib) are imported inside commands, so ``plora --help``
starts fast.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import typer.exceptions
from typer.core import TyperGroup

from plora.api import BaselineOption, PlanReport, load_sweep, make_plan
from plora.api import load as load_results
from plora.config import ConfigError
from plora.utils import fmt_duration

if TYPE_CHECKING:
    from plora.planner import Plan


def _click_exits() -> tuple[type[BaseException], ...]:
    """Typer's and click's own ways out (exit codes, usage errors): typer vendors click as
    ``typer._click`` (0.2x), older typers raise click's classes."""
    kinds: list[type[BaseException]] = [typer.Exit, typer.Abort]
    kinds += [getattr(typer.exceptions, "TyperException", typer.Exit)]
    with contextlib.suppress(ImportError):
        import click

        kinds += [click.exceptions.Exit, click.ClickException, click.Abort]
    return tuple(kinds)


_CLICK_EXITS = _click_exits()


class _ErrorBoundary(TyperGroup):
    """The one error boundary of every ``plora`` command.

    A :class:`ConfigError` that a command did not catch is printed as it is; any other exception
    becomes one line ``error: plora CMD failed: TYPE: CAUSE; WHAT TO DO`` and exit code 2, unless
    ``--debug`` (or ``PLORA_DEBUG=1``) asks for the traceback instead. Typer's and click's own
    exits (``--help``, usage errors, :func:`fail`) pass through.
    """

    def invoke(self, ctx: Any) -> Any:  # click's Context (typer vendors click as typer._click)
        try:
            return super().invoke(ctx)
        except _CLICK_EXITS:
            raise
        except ConfigError as err:
            fail(str(err))
        except Exception as err:
            if debug_enabled(ctx):
                raise
            fail(crash_line(ctx.invoked_subcommand, err))


app = typer.Typer(
    name="plora",
    cls=_ErrorBoundary,
    help="Packed LoRA hyperparameter sweeps: plan and run many LoRA configs at once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

#: Exit code for bad user input (a config, option or sweep file problem).
EXIT_USER_ERROR = 2


#: Exit code of a command stopped with Ctrl-C.
EXIT_INTERRUPTED = 130


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"plora {plora_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[
        bool,
        typer.Option(
            "--debug", help="Show the traceback of an unexpected error (also PLORA_DEBUG=1)."
        ),
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Packed LoRA hyperparameter sweeps: plan and run many LoRA configs at once."""


def plora_version() -> str:
    """The installed plora's version (``unknown`` when it is not installed as a package)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plora")
    except PackageNotFoundError:
        return "unknown"


def debug_enabled(ctx: typer.Context | None = None) -> bool:
    """``--debug`` was given (on ``ctx``'s root command) or ``PLORA_DEBUG`` is set to 1/true/yes."""
    if os.environ.get("PLORA_DEBUG", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return bool(ctx is not None and ctx.find_root().params.get("debug"))


def crash_line(command: str | None, err: BaseException) -> str:
    """The one line of an unexpected exception: what failed, its cause, what to do."""
    text = str(err).strip()
    cause = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
    cause = cause if len(cause) <= 300 else cause[:297] + "..."
    if isinstance(err, OSError):
        todo = "check that path (exists, free space, permissions) and rerun"
    elif isinstance(err, MemoryError):
        todo = "free memory or make the sweep smaller and rerun"
    else:
        todo = "rerun with --debug (or PLORA_DEBUG=1) for the traceback and report it"
    what = f"plora {command}" if command else "plora"
    return f"{what} failed: {cause}; {todo}"


# ------------------------------------------------------------------------------ shared helpers


def fail(message: str) -> NoReturn:
    """Print ``error: message`` as one red line on stderr and exit with code 2."""
    from rich.console import Console
    from rich.text import Text

    line = " ".join(message.split())
    Console(stderr=True, highlight=False, soft_wrap=True).print(Text("error: " + line, style="red"))
    raise typer.Exit(EXIT_USER_ERROR)


@contextlib.contextmanager
def user_errors(source: str | None = None) -> Iterator[None]:
    """Turn a :class:`ConfigError` raised inside into :func:`fail` (naming ``source`` if the
    error does not name a file yet)."""
    try:
        yield
    except ConfigError as err:
        fail(str(err.located(file=source) if source and not err.file else err))


def check_output_path(path: Path | None, option: str, suffixes: tuple[str, ...] | None) -> None:
    """Reject an output path with a wrong suffix, that is a directory or that cannot be written
    (the file, or the nearest existing folder it would be created in), before any work."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError("is a directory", key=option, value=str(path), fix="give a file name")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise ConfigError(f"unsupported file type {path.suffix or '(none)'!r}", key=option, value=str(path),
                          fix=f"use one of {', '.join(suffixes)}")  # fmt: skip
    probe = path.absolute().parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    why = None
    if path.exists() and not os.access(path, os.W_OK):
        why = "the file is not writable"
    elif not probe.is_dir():
        why = f"{probe} is not a directory"
    else:
        try:  # a real write: permissions, read-only mounts, /proc, root's os.access all told apart
            fd, tmp = tempfile.mkstemp(dir=probe, prefix=".plora-probe-")
            os.close(fd)
            os.unlink(tmp)
        except OSError as err:
            why = f"cannot create files in {probe} ({err.strerror or type(err).__name__})"
    if why:
        raise ConfigError(f"cannot write there: {why}", key=option, value=str(path),
                          fix="choose a path in a folder you can write, or fix its permissions")  # fmt: skip


def print_warnings(sweep: Any) -> None:
    """One ``warning: FILE: ...`` line on stderr per setting that cannot take effect
    (:func:`plora.config.advice.sweep_warnings`)."""
    from plora.config.advice import sweep_warnings

    for line in sweep_warnings(sweep):
        typer.echo(f"warning: {sweep.source or 'sweep'}: {line}", err=True)


# ------------------------------------------------------------------------------------ plan


def print_plan(report: PlanReport) -> None:
    """The job table and the makespan comparison, with rich."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    plan, sweep = report.plan, report.sweep
    hw = sweep.hardware
    title = (f"{sweep.name}: {plan.num_configs} configs of {sweep.model.name_or_path} on "
             f"{hw.num_gpus}x {hw.gpu_type} ({hw.gpu_memory_gib:g} GiB, load {hw.load_factor:g}), seq {sweep.seq_len}")  # fmt: skip
    rows = [
        [
            job.job_id, str(len(job.config_ids)), str(job.gpus), str(job.strategy or "-"),
            fmt_duration(job.start_s), fmt_duration(job.end_s), f"{job.memory_gib_per_gpu:.1f}",
            ",".join(map(str, job.gpu_ids)), " ".join(job.config_ids),
        ]
        for job in plan.jobs
    ]  # fmt: skip
    heads = ("job", "#", "d", "strategy", "start", "end", "GiB/GPU", "GPUs", "configs")
    fixed = sum(max([len(h), *(len(r[i]) for r in rows)]) + 2 for i, h in enumerate(heads[:-1]))
    budget = max(12, console.width - fixed - 2 * len(heads) - 4)  # + padding and separators
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in heads:
        table.add_column(
            col,
            justify="left" if col in ("job", "strategy", "GPUs", "configs") else "right",
            no_wrap=True,
        )
    for row in rows:
        ids = row[-1]
        table.add_row(*row[:-1], ids if len(ids) <= budget else ids[: budget - 1] + "…")
    console.print(table)
    name = "PLoRA" if plan is report.plora else f"baseline {report.plan_name}"
    console.print(f"{name} makespan: [bold]{fmt_duration(plan.makespan_s)}[/bold] "
                  f"({len(plan.jobs)} jobs, solver {plan.solver}, planned in {report.seconds:.2f}s)")  # fmt: skip
    if report.overheads:
        o, t = report.overheads, report.overheads["totals"]
        console.print(f"  in it: start-up {fmt_duration(o['worker_start_s'] + o['model_load_s'])} x{t['startups']:.0f} "
                      f"(worker {fmt_duration(o['worker_start_s'])} + model load {fmt_duration(o['model_load_s'])}, {o['source']}), "
                      f"job start {fmt_duration(o['job_start_s'])} x{len(plan.jobs)}, eval {fmt_duration(t['eval_s'])}, "
                      f"export {fmt_duration(t['export_s'])}, checkpoints {fmt_duration(t['checkpoint_s'])}, "
                      f"steps {fmt_duration(t['train_s'])} (GPU-group time)", soft_wrap=True)  # fmt: skip
    for key in ("min_gpu", "max_gpu", "tune"):
        label = key.replace("_", "-")
        if key in report.skipped:
            console.print(f"  vs {label}: n/a ({report.skipped[key]})", soft_wrap=True)
            continue
        base = report.baselines[key]
        speedup = (
            base.makespan_s / report.plora.makespan_s
            if report.plora.makespan_s > 0
            else float("nan")
        )
        console.print(f"  vs {label}: {fmt_duration(base.makespan_s)} ({len(base.jobs)} jobs) "
                      f"-> PLoRA is {speedup:.2f}x faster")  # fmt: skip
    console.print(f"  lower bound: {fmt_duration(plan.lower_bound_s)} (plan <= {plan.makespan_s / plan.lower_bound_s:.3f}x optimal)"
                  if plan.lower_bound_s > 0 else "  lower bound: 0")  # fmt: skip
    console.print(f"  Thm 6.1 ratio bound: {plan.ratio_bound:.3f}")
    for note in plan.notes:
        console.print(f"  note: {note}", soft_wrap=True)
    if sweep.search in ("optuna", "hyperopt"):
        console.print(f"  note: {sweep.search} proposes configs at run time; this plan packs "
                      f"{plan.num_configs} random draws of the space as an estimate", soft_wrap=True)  # fmt: skip


@app.command()
def plan(
    sweep_file: Annotated[Path, typer.Argument(metavar="SWEEP.yaml", help="Sweep definition.")],
    gpus: Annotated[int | None, typer.Option("--gpus", help="Override hardware.num_gpus.")] = None,
    gpu_memory_gib: Annotated[
        float | None, typer.Option("--gpu-memory-gib", help="Override hardware.gpu_memory_gib.")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the plan as JSON.")] = None,
    gantt: Annotated[
        Path | None, typer.Option("--gantt", help="Draw the plan's jobs on GPUs (.png/.pdf/.svg).")
    ] = None,
    baseline: Annotated[
        BaselineOption | None,
        typer.Option("--baseline", help="Output this baseline schedule instead of PLoRA's plan."),
    ] = None,
) -> None:
    """Plan a sweep: pack its configs into jobs on the GPUs and predict the makespan."""
    with user_errors(str(sweep_file)):
        check_output_path(out, "--out", (".json",))
        check_output_path(gantt, "--gantt", (".png", ".pdf", ".svg"))
        sweep = load_sweep(sweep_file, gpus=gpus, gpu_memory_gib=gpu_memory_gib)
        key = "--gpu-memory-gib" if gpu_memory_gib is not None else "hardware.gpu_memory_gib"
        report = make_plan(sweep, baseline=baseline, memory_key=key)
        image = _render_gantt(report.plan, gantt) if gantt else None
    print_plan(report)
    from plora.utils import atomic_write_bytes, atomic_write_json

    if out is not None:
        atomic_write_json(out, report.to_json_dict())
        typer.echo(f"wrote {out}")
    if gantt is not None and image is not None:
        atomic_write_bytes(gantt, image)
        typer.echo(f"wrote {gantt}")


def _render_gantt(plan: Plan, path: Path) -> bytes:
    from plora.analysis.plots import plot_plan_gantt

    fig = plot_plan_gantt(plan)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".").lower(), dpi=150, bbox_inches="tight")
    return buf.getvalue()


@app.command()
def validate(
    sweep_file: Annotated[Path, typer.Argument(metavar="SWEEP.yaml", help="Sweep definition.")],
) -> None:
    """Check a sweep file for training: values, search space, the dataset's files and rows, and
    that the base model and its tokenizer load (hub ids: a short timeout, HF_HUB_OFFLINE honoured)."""
    from plora import api

    with user_errors(str(sweep_file)):
        report = api.check(load_sweep(sweep_file))
    sweep = report.sweep
    print_warnings(sweep)
    kind = "configs" if sweep.search in ("grid", "random") else "trials (proposed by the searcher)"
    typer.echo(
        f"{sweep_file}: ok ({report.num_configs} {kind}, {sweep.search} search, model "
        f"{sweep.model.name_or_path}; data {report.train_rows} train / {report.eval_rows} eval "
        f"rows{f' (a sample of {report.sampled} checked)' if report.sampled else ''}, "
        f"metric {report.metric})"
    )


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
    ``--retry-failed``."""
    from plora import api
    from plora.runtime.driver import RunOptions
    from plora.runtime.progress import Progress

    try:
        with user_errors(str(sweep_file)):
            spec = load_sweep(sweep_file)
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
    for line in summary.data_lines:  # repeated at the end: the progress view may have hidden it
        typer.echo(line)
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


@app.command()
def status(
    sweep_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A `plora sweep --out` dir.")],
) -> None:
    """Show a sweep directory: configs by status, jobs, the latest plan, the best configs."""
    from plora.runtime.progress import status_text

    with user_errors():
        text = status_text(str(sweep_dir))
    typer.echo(text)


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


__all__ = ["EXIT_INTERRUPTED", "EXIT_USER_ERROR", "app", "crash_line", "fail", "user_errors"]
