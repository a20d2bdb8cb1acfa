"""Analysis of a finished (or running) sweep: load its directory, rank configs, plot.

Notebooks in ``notebooks/`` and ``plora report`` only call these functions::

    from plora import analysis
    res = analysis.load("runs/quickstart")
    res.best(k=5)
    analysis.plot_jobs_gantt(res.jobs)
"""

from __future__ import annotations

from plora.analysis.load import HPARAM_COLUMNS, SweepResults, best, load

_PLOTS = (
    "assign_gpu_lanes",
    "best_config_table",
    "plot_hp_effects",
    "plot_jobs_gantt",
    "plot_loss_curves",
    "plot_plan_gantt",
)
_REPORT = ("markdown_table", "summary", "write_report")


def __getattr__(name: str):  # lazy: matplotlib only when a plot is asked for
    if name in _PLOTS:
        from plora.analysis import plots

        return getattr(plots, name)
    if name in _REPORT:
        from plora.analysis import report

        return getattr(report, name)
    raise AttributeError(f"module 'plora.analysis' has no attribute {name!r}")


__all__ = ["HPARAM_COLUMNS", "SweepResults", "best", "load", *_PLOTS, *_REPORT]
