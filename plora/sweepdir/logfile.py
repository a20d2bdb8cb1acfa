"""``plora.log``: everything the driver process logs during a sweep, in the sweep directory.

plora's console is plora's: while a sweep runs, the console shows plora's own warnings (its
loggers, ``plora.*``, at WARNING and above) and nothing of the libraries beside it; the log file
gets every record at INFO and above of every logger of the driver process -- plora's, the
libraries' (transformers, peft, torch, a searcher), Python warnings (``warnings.warn``, through
``logging.captureWarnings``) -- with time and logger name. Loggers with handlers of their own
that do not propagate (Ray's ``ray`` logger) keep them.

Records logged before the directory exists (a new sweep's directory is published atomically
after its first plan) wait in memory and are written when it appears; a sweep that fails before
then writes none. The file is append-only (a resumed sweep adds to it).
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import sys
from collections.abc import Iterator
from pathlib import Path

from plora.sweepdir.schema import LOG_FILE

#: Records kept while the sweep directory does not exist yet (the set-up's: a few dozen).
_EARLY_RECORDS = 100_000
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _is_plora(record: logging.LogRecord) -> bool:
    return record.name == "plora" or record.name.startswith("plora.")


class SweepLog:
    """The handlers of one sweep's logging (see the module docstring); :func:`sweep_log`."""

    def __init__(self) -> None:
        self.early = logging.handlers.MemoryHandler(
            _EARLY_RECORDS, flushLevel=logging.CRITICAL + 1, flushOnClose=False
        )
        self.early.setLevel(logging.INFO)
        self.console = logging.StreamHandler(sys.stderr)
        self.console.setLevel(logging.WARNING)
        self.console.addFilter(_is_plora)
        self.file: logging.FileHandler | None = None

    def attach(self, directory: str | Path) -> None:
        """Write to ``directory/plora.log`` from now on, the records kept so far first."""
        if self.file is not None:
            return
        self.file = logging.FileHandler(Path(directory) / LOG_FILE, mode="a", encoding="utf-8")
        self.file.setLevel(logging.INFO)
        self.file.setFormatter(logging.Formatter(_FORMAT))
        self.early.setTarget(self.file)
        self.early.flush()
        root = logging.getLogger()
        root.removeHandler(self.early)
        root.addHandler(self.file)


@contextlib.contextmanager
def sweep_log() -> Iterator[SweepLog]:
    """Route the driver's logging for one sweep (console: plora's warnings; file: everything
    from INFO, once :meth:`SweepLog.attach` names the directory); restored on exit."""
    log = SweepLog()
    root = logging.getLogger()
    level = root.level
    if level > logging.INFO:  # NOTSET (0) lets every record through already
        root.setLevel(logging.INFO)
    root.addHandler(log.early)
    root.addHandler(log.console)
    logging.captureWarnings(True)
    try:
        yield log
    finally:
        logging.captureWarnings(False)
        for handler in (log.early, log.console, log.file):
            if handler is not None:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)
