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

from plora.cli.app import EXIT_INTERRUPTED, EXIT_USER_ERROR, app, crash_line, fail, user_errors

# Each command module registers its commands on `app` as it is imported, in `plora --help` order.
from plora.cli import planning  # noqa: F401  # isort: skip
from plora.cli import running  # noqa: F401  # isort: skip
from plora.cli import results  # noqa: F401  # isort: skip

__all__ = ["EXIT_INTERRUPTED", "EXIT_USER_ERROR", "app", "crash_line", "fail", "user_errors"]
