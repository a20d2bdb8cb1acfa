"""Gantt charts: the jobs a sweep ran on its GPUs, and a plan's jobs before anything runs.

Both return a :class:`matplotlib.figure.Figure` built without ``pyplot``; re-exported by
:mod:`plora.analysis.plots`.
"""

from __future__ import annotations

from typing import Any

import matplotlib
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from plora.analysis.style import fig_ax, listed_colours

# --- executed jobs (from a sweep directory; see plora.analysis.load) -------------------------


def assign_gpu_lanes(jobs: pd.DataFrame, num_gpus: int | None = None) -> list[list[int]]:
    """GPU ids for each job row of ``jobs``, for drawing.

    Rows with ``gpu_ids`` keep them. Otherwise jobs are placed in start order on the
    lowest-numbered GPUs free at their start (per ``node``), as the runtime's placement groups
    would; when timing noise leaves too few free GPUs, the earliest-freed ones are used.

    Args:
        jobs: ``SweepResults.jobs`` (``start``, ``end``, ``num_gpus``, optional ``gpu_ids``,
            ``node``).
        num_gpus: GPUs per node (default: the largest job, at least the most ever busy).

    Returns:
        One list of GPU ids per row, in row order.
    """
    n = len(jobs)
    out: list[list[int]] = [[] for _ in range(n)]
    given = jobs["gpu_ids"] if "gpu_ids" in jobs.columns else pd.Series([None] * n)
    nodes = jobs["node"] if "node" in jobs.columns else pd.Series([""] * n)
    width = int(num_gpus or max([int(g) for g in jobs["num_gpus"]] or [1]))
    free_at: dict[Any, list[float]] = {}
    for i in sorted(range(n), key=lambda r: (float(jobs["start"].iloc[r]), r)):
        ids = given.iloc[i]
        if ids is not None and len(ids) > 0:
            out[i] = [int(g) for g in ids]
            continue
        need = int(jobs["num_gpus"].iloc[i])
        start, end = float(jobs["start"].iloc[i]), float(jobs["end"].iloc[i])
        lanes = free_at.setdefault(nodes.iloc[i], [float("-inf")] * max(width, need))
        while len(lanes) < need:
            lanes.append(float("-inf"))
        eps = 1e-6 * max(1.0, abs(start))
        idle = [g for g, t in enumerate(lanes) if t <= start + eps]
        if len(idle) < need:
            idle = sorted(range(len(lanes)), key=lambda g: (lanes[g], g))
        chosen = sorted(idle[:need])
        for g in chosen:
            lanes[g] = end
        out[i] = chosen
    return out


def plot_jobs_gantt(
    jobs: pd.DataFrame, *, num_gpus: int | None = None, ax: Axes | None = None
) -> Figure:
    """Gantt chart of executed jobs on GPUs: one row per (node, GPU), one bar per job.

    Each job is one colour across all its GPUs, labelled with its number of configs; failed
    jobs are hatched.

    Args:
        jobs: ``SweepResults.jobs``.
        num_gpus: GPUs per node (see :func:`assign_gpu_lanes`).
        ax: axes to draw on (a new figure when ``None``).
    """
    fig, ax = fig_ax(ax, figsize=(10, max(2.0, 0.5 + 0.45 * max(1, num_gpus or 4))))
    if jobs.empty:
        ax.text(0.5, 0.5, "no jobs", ha="center", va="center", transform=ax.transAxes)
        return fig
    lanes = assign_gpu_lanes(jobs, num_gpus)
    nodes = jobs["node"] if "node" in jobs.columns else pd.Series([""] * len(jobs))
    keys = sorted({(str(nodes.iloc[i]), g) for i, ids in enumerate(lanes) for g in ids})
    row = {k: r for r, k in enumerate(keys)}
    cmap = matplotlib.colormaps["tab20"]
    for i, ids in enumerate(lanes):
        start, end = float(jobs["start"].iloc[i]), float(jobs["end"].iloc[i])
        failed = (
            str(jobs["status"].iloc[i]).lower() in ("failed", "error")
            if "status" in jobs
            else False
        )
        for g in ids:
            ax.barh(
                row[(str(nodes.iloc[i]), g)],
                end - start,
                left=start,
                height=0.8,
                color=cmap(i % 20),
                edgecolor="black",
                linewidth=0.5,
                hatch="//" if failed else None,
            )
        mid = row[(str(nodes.iloc[i]), ids[0])] if ids else 0
        ax.text(
            (start + end) / 2,
            mid,
            f"{jobs['job_id'].iloc[i]} ({len(jobs['config_ids'].iloc[i])})",
            ha="center",
            va="center",
            fontsize=7,
        )
    multi_node = len({k[0] for k in keys}) > 1
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"{n}:GPU{g}" if multi_node else f"GPU {g}" for n, g in keys])
    ax.invert_yaxis()
    ax.set_xlabel("time since first job start (s)")
    ax.set_title("Jobs on GPUs (label: job id (configs))")
    fig.tight_layout()
    return fig


# --- plan plots (from a plora.planner.Plan, before anything runs) -----------------------------


def plan_lanes(plan: Any) -> list[tuple[int, ...]]:
    """GPU ids of each job of ``plan``: the planner's ``gpu_ids``, else the lowest GPUs free at
    the job's start (jobs in start order)."""
    free_at = [float("-inf")] * max(1, plan.num_gpus)
    lanes: list[tuple[int, ...]] = [()] * len(plan.jobs)
    for i in sorted(range(len(plan.jobs)), key=lambda j: (plan.jobs[j].start_s, j)):
        job = plan.jobs[i]
        ids = tuple(job.gpu_ids)
        if not ids:
            eps = 1e-6 * max(1.0, abs(job.start_s))
            idle = [g for g, t in enumerate(free_at) if t <= job.start_s + eps]
            if len(idle) < job.gpus:
                idle = sorted(range(len(free_at)), key=lambda g: (free_at[g], g))
            ids = tuple(sorted(idle[: job.gpus]))
        for g in ids:
            if g < len(free_at):
                free_at[g] = job.end_s
        lanes[i] = ids
    return lanes


def plot_plan_gantt(plan: Any, path: str | None = None, *, ax: Axes | None = None) -> Figure:
    """Gantt chart of a plan: one row per GPU, one bar per job over its predicted
    ``[start_s, end_s)``, spanning the job's GPUs and labelled ``job_id ×configs``.

    Dashed lines mark the makespan and the lower bound.

    Args:
        plan: a :class:`plora.planner.Plan` (jobs with ``gpu_ids``, ``gpus``, ``start_s``,
            ``end_s``, ``config_ids``) or its ``plan.json`` dict.
        path: also save the figure there (format from the suffix) when given.
        ax: axes to draw on (a new figure when ``None``).
    """
    from matplotlib.patches import Rectangle

    if isinstance(plan, dict):
        from plora.planner.types import Plan

        plan = Plan.from_json_dict(plan)
    g = max(1, plan.num_gpus)
    fig, ax = fig_ax(ax, figsize=(11, 1.2 + 0.42 * g))
    span = max([plan.makespan_s, plan.lower_bound_s, 1e-9])
    unit, scale = ("h", 3600.0) if span >= 7200 else ("min", 60.0) if span >= 120 else ("s", 1.0)
    colors = listed_colours("tab20")
    for i, (job, ids) in enumerate(zip(plan.jobs, plan_lanes(plan), strict=True)):
        x0, w = job.start_s / scale, (job.end_s - job.start_s) / scale
        runs: list[list[int]] = []
        for gid in sorted(ids):  # contiguous GPU ids -> one rectangle
            if runs and gid == runs[-1][-1] + 1:
                runs[-1].append(gid)
            else:
                runs.append([gid])
        for run in runs:
            y0, h = run[0] - 0.4, len(run) - 0.2
            ax.add_patch(
                Rectangle(
                    (x0, y0),
                    w,
                    h,
                    facecolor=colors[i % len(colors)],
                    edgecolor="black",
                    linewidth=0.6,
                )
            )
            label = f"{job.job_id} ×{len(job.config_ids)}"
            if w >= 0.06 * span / scale:
                ax.text(
                    x0 + w / 2,
                    y0 + h / 2,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    clip_on=True,
                )
    ax.axvline(
        plan.makespan_s / scale, color="black", linestyle="--", linewidth=1, label="makespan"
    )
    if plan.lower_bound_s > 0:
        ax.axvline(
            plan.lower_bound_s / scale,
            color="tab:red",
            linestyle=":",
            linewidth=1,
            label="lower bound",
        )
    ax.set_xlim(0, span / scale * 1.02)
    ax.set_ylim(g - 0.5, -0.5)
    ax.set_yticks(range(g), [f"GPU {k}" for k in range(g)])
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(
        f"{plan.num_configs} configs in {len(plan.jobs)} jobs on {plan.num_gpus} GPUs: "
        f"makespan {plan.makespan_s / scale:.2f} {unit}, lower bound {plan.lower_bound_s / scale:.2f} {unit}",
        fontsize=9,
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=150, bbox_inches="tight")
    return fig


__all__ = ["assign_gpu_lanes", "plan_lanes", "plot_jobs_gantt", "plot_plan_gantt"]
