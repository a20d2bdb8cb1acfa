"""Plots of plans and sweep results (matplotlib; no Ray, no torch).

Every function returns a :class:`matplotlib.figure.Figure` built without ``pyplot`` (no global
state, nothing to close, any backend), so notebooks display it and ``plora report`` saves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

# --- sweep-result plots (from a sweep directory; see plora.analysis.load) -------------------


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
    fig, ax = _fig_ax(ax, figsize=(10, max(2.0, 0.5 + 0.45 * max(1, num_gpus or 4))))
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


#: Line styles that, crossed with the 10 colours of ``tab10``, tell 40 curves apart.
LINESTYLES: tuple[str, ...] = ("-", "--", "-.", ":")


def _listed_colours(name: str) -> Sequence[Any]:
    """The colours of matplotlib's qualitative colormap ``name`` (a ``ListedColormap``)."""
    cmap = matplotlib.colormaps[name]
    if not isinstance(cmap, ListedColormap):
        raise TypeError(f"colormap {name!r} is not a ListedColormap")
    return cast(Sequence[Any], cmap.colors)  # the qualitative maps list RGB tuples


def curve_style(k: int) -> dict[str, Any]:
    """Colour and line style of the ``k``-th curve: 10 colours, then the next line style, so
    the first 40 curves all differ (matplotlib's default cycle repeats after 10)."""
    colours = _listed_colours("tab10")
    return {"color": colours[k % 10], "linestyle": LINESTYLES[(k // 10) % len(LINESTYLES)]}


def varying_params(results: pd.DataFrame, params: Sequence[str] | None = None) -> list[list[str]]:
    """The hyperparameters that vary across ``results``, each once, in display order.

    Parameters whose values determine each other one to one (``alpha`` with ``rank`` when the
    space fixes ``alpha_ratio``) form one group: ``[["lr"], ["rank", "alpha"], ...]``; the first
    of a group is the one plotted. Constant and absent columns are left out.

    Args:
        results: ``SweepResults.results``.
        params: candidate columns (default: every hyperparameter, ``HPARAM_COLUMNS``).
    """
    from plora.sweepdir.schema import HPARAM_COLUMNS

    keys = {
        p: results[p].map(_hashable) for p in (params or HPARAM_COLUMNS) if p in results.columns
    }
    varying = [p for p, col in keys.items() if col.nunique(dropna=False) > 1]
    groups: list[list[str]] = []
    for p in varying:
        for g in groups:
            pair = pd.DataFrame({"a": keys[g[0]], "b": keys[p]})
            one_to_one = (
                pair.groupby("a", dropna=False)["b"].nunique(dropna=False) == 1
            ).all() and (pair.groupby("b", dropna=False)["a"].nunique(dropna=False) == 1).all()
            if one_to_one:
                g.append(p)
                break
        else:
            groups.append([p])
    return groups


def _hashable(v: Any) -> Any:
    if isinstance(v, list | tuple | np.ndarray):
        return ",".join(map(str, v))
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "none"
    return v


def config_labels(results: pd.DataFrame, config_ids: Sequence[str]) -> dict[str, str]:
    """A legend label per config from the hyperparameters that vary in the sweep
    (``lr=0.001 rank=16 target_modules=all``), the id where nothing varies or it is unknown."""
    if results.empty or "config_id" not in results.columns:
        return {str(c): str(c) for c in config_ids}
    shown = [g[0] for g in varying_params(results)]
    rows = results.drop_duplicates("config_id").set_index("config_id")
    out = {}
    for cid in config_ids:
        if cid not in rows.index or not shown:
            out[str(cid)] = str(cid)
            continue
        r = rows.loc[cid]
        out[str(cid)] = " ".join(f"{p}={_short(r[p])}" for p in shown)
    return out


def _short(v: Any) -> str:
    v = _hashable(v)
    if isinstance(v, float):
        return f"{v:.3g}"
    text = str(v)
    presets = {"q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj": "all",
               "q_proj,k_proj,v_proj,o_proj": "attention", "gate_proj,up_proj,down_proj": "mlp"}  # fmt: skip
    return presets.get(text, text.replace("_proj", ""))


def plot_loss_curves(
    metrics: pd.DataFrame,
    *,
    config_ids: Sequence[str] | None = None,
    smooth: int = 1,
    x: str = "step",
    ax: Axes | None = None,
    results: pd.DataFrame | None = None,
    labels: dict[str, str] | None = None,
) -> Figure:
    """Training loss per config against ``x`` (``step``, ``tokens`` or ``time``).

    Each curve has its own colour and line style (:func:`curve_style`: distinct up to 40) and is
    labelled by the hyperparameters that vary (:func:`config_labels`, given ``results``); the
    legend sits beside the axes.

    Args:
        metrics: ``SweepResults.metrics``.
        config_ids: configs to draw (default: all; the legend is shown for <= 40).
        smooth: centred rolling-mean window in steps (1 = raw).
        x: x-axis column.
        ax: axes to draw on.
        results: ``SweepResults.results``, for the labels.
        labels: config id -> label (default: from ``results``, else the ids).
    """
    fig, ax = _fig_ax(ax, figsize=(9, 5))
    if metrics.empty:
        ax.text(0.5, 0.5, "no metrics", ha="center", va="center", transform=ax.transAxes)
        return fig
    ids = list(config_ids) if config_ids is not None else list(dict.fromkeys(metrics["config_id"]))
    if labels is None:
        labels = config_labels(results if results is not None else pd.DataFrame(), ids)
    for k, cid in enumerate(ids):
        m = metrics[metrics["config_id"] == cid].sort_values(x)
        y = m["loss"].rolling(max(1, smooth), center=True, min_periods=1).mean()
        ax.plot(m[x], y, label=labels.get(str(cid), str(cid)), linewidth=1.2, **curve_style(k))
    ax.set_xlabel(x)
    ax.set_ylabel("train loss" + (f" (rolling mean, {smooth})" if smooth > 1 else ""))
    ax.set_title(f"Training loss, {len(ids)} configs")
    if 0 < len(ids) <= 10 * len(LINESTYLES):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def plot_hp_effects(
    results: pd.DataFrame,
    metric: str,
    *,
    params: Sequence[str] | None = None,
    mode: str | None = None,
) -> Figure:
    """The metric against each hyperparameter that varies, one panel each, best config starred.

    Every varying hyperparameter appears once (:func:`varying_params`): ones that move together
    one to one (``alpha`` with ``rank`` under a fixed ``alpha_ratio``) share a panel named after
    both. Numeric hyperparameters are scattered (``lr`` on a log axis) with the per-value mean
    drawn; categorical ones (``target_modules``, ``schedule``, ``use_rslora``) as a strip per
    category. Panels wrap at four per row.

    Args:
        results: ``SweepResults.results``.
        metric: results column, e.g. ``"eval_loss"``.
        params: hyperparameters to consider (default: all of them; constant ones are skipped).
        mode: ``"min"``/``"max"``; marks the best config when given.
    """
    df = results[results[metric].notna()] if metric in results.columns else results.iloc[:0]
    groups = varying_params(df, params) if not df.empty else []
    ncols = min(4, max(1, len(groups)))
    nrows = max(1, -(-len(groups) // ncols))
    fig = Figure(figsize=(3.6 * ncols, 3.4 * nrows))
    axes = np.atleast_1d(fig.subplots(nrows, ncols)).ravel()
    if not groups:
        axes[0].text(0.5, 0.5, "no varying hyperparameters", ha="center", va="center")
        return fig
    for ax in axes[len(groups) :]:
        ax.set_visible(False)
    best_idx = None
    if mode in ("min", "max"):
        best_idx = df[metric].idxmin() if mode == "min" else df[metric].idxmax()
    for ax, group in zip(axes, groups, strict=False):
        p = group[0]
        col = df[p].map(_hashable)
        numeric = pd.to_numeric(col, errors="coerce")
        if numeric.notna().all() and not pd.api.types.is_bool_dtype(df[p]):
            xs = numeric.astype(float)
            ax.scatter(xs, df[metric], s=18, alpha=0.7)
            means = df[metric].groupby(xs).mean().sort_index()
            ax.plot(means.index.astype(float), means.to_numpy(), color="black", linewidth=1)
            if p == "lr" or ((xs > 0).all() and xs.max() / xs.min() >= 100):
                ax.set_xscale("log")
            bx = None if best_idx is None else float(xs.loc[best_idx])
        else:
            cats = sorted(col.astype(str).unique())
            pos = {c: k for k, c in enumerate(cats)}
            ax.scatter([pos[str(v)] for v in col], df[metric], s=18, alpha=0.7)
            ax.set_xticks(range(len(cats)))
            ax.set_xticklabels([_short(c) for c in cats], rotation=30, ha="right", fontsize=7)
            bx = None if best_idx is None else pos[str(col.loc[best_idx])]
        if bx is not None:
            ax.scatter([bx], [df.loc[best_idx, metric]], marker="*", s=160, color="red")
        ax.set_xlabel(" & ".join(group))
        ax.set_ylabel(metric)
    fig.tight_layout()
    return fig


def best_config_table(
    results: pd.DataFrame, metric: str, mode: str = "min", k: int = 10
) -> pd.DataFrame:
    """The ``k`` best configs: id, varying hyperparameters, metrics and GPU-seconds."""
    from plora.analysis.load import HPARAM_COLUMNS, best

    top = best(results, metric, mode, k=k)
    hps = [c for c in HPARAM_COLUMNS if c in results.columns and results[c].nunique() > 1]
    cols = ["config_id", *hps, metric]
    cols += [
        c
        for c in ("eval_loss", "eval_metric", "final_train_loss", "steps", "gpu_seconds")
        if c in top.columns and c not in cols
    ]
    return top[[c for c in cols if c in top.columns]]


def _fig_ax(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        fig = ax.figure
        while not isinstance(fig, Figure):  # an axes of a SubFigure: its root Figure
            fig = fig.figure
        return fig, ax
    fig = Figure(figsize=figsize)
    return fig, fig.subplots()


# --- plan plots (from a plora.planner.Plan, before anything runs) -----------------------------


def _plan_lanes(plan: Any) -> list[tuple[int, ...]]:
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
    fig, ax = _fig_ax(ax, figsize=(11, 1.2 + 0.42 * g))
    span = max([plan.makespan_s, plan.lower_bound_s, 1e-9])
    unit, scale = ("h", 3600.0) if span >= 7200 else ("min", 60.0) if span >= 120 else ("s", 1.0)
    colors = _listed_colours("tab20")
    for i, (job, ids) in enumerate(zip(plan.jobs, _plan_lanes(plan), strict=True)):
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
