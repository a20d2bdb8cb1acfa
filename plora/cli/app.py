"""The ``plora`` Typer app, its one error boundary and the helpers every command shares.

Commands live one group per module (:mod:`plora.cli.planning`: ``plan``, ``validate``;
:mod:`plora.cli.running`: ``sweep``; :mod:`plora.cli.results`: ``status``, ``report``) and register
on :data:`app` when :mod:`plora.cli` is imported.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import typer.exceptions
from typer.core import TyperGroup

from plora.config import ConfigError


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


__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_USER_ERROR",
    "app",
    "check_output_path",
    "crash_line",
    "debug_enabled",
    "fail",
    "plora_version",
    "print_warnings",
    "user_errors",
]
