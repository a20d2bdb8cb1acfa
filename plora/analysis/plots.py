"""Plots of plans and sweep results (matplotlib; no Ray, no torch).

Every function returns a :class:`matplotlib.figure.Figure` built without ``pyplot`` (no global
state, nothing to close, any backend), so notebooks display it and ``plora report`` saves it.
The Gantt charts live in :mod:`plora.analysis.gantt` and the shared figure helpers and curve
styles in :mod:`plora.analysis.style`; both are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from plora.analysis.gantt import assign_gpu_lanes, plot_jobs_gantt, plot_plan_gantt
from plora.analysis.style import LINESTYLES, curve_style, fig_ax

# --- sweep-result plots (from a sweep directory; see plora.analysis.load) -------------------


def varying_params(results: pd.DataFrame, params: Sequence[str] | None = None) -> list[list[str]]:
    """The hyperparameters that vary across ``results``, each once, in display order.

    Parameters whose values determine each other one to one (``alpha`` with ``rank`` when the
    space fixes ``alpha_ratio``) form one group: ``[["lr"], ["rank", "alpha"], ...]``; the first
    of a group is the one plotted. Only a relation the values show counts: parameters drawn
    afresh per config (``lr``, ``alpha``, ``seed`` of a random or Optuna sweep: no value repeats)
    are one to one by chance and stay apart. Constant and absent columns are left out.

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
            if keys[g[0]].nunique(dropna=False) == len(results):  # unique per config: no relation
                continue
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
    fig, ax = fig_ax(ax, figsize=(9, 5))
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
    category. Panels wrap at four per row. When ``metric`` is the same for every config (exact
    match 0 everywhere after a short sweep) a second set of panels shows ``eval_loss``, which
    still tells the configs apart.

    Args:
        results: ``SweepResults.results``.
        metric: results column, e.g. ``"eval_loss"``.
        params: hyperparameters to consider (default: all of them; constant ones are skipped).
        mode: ``"min"``/``"max"``; marks the best config when given.
    """
    df = results[results[metric].notna()] if metric in results.columns else results.iloc[:0]
    groups = varying_params(df, params) if not df.empty else []
    shown = [(metric, mode)]
    flat = not df.empty and df[metric].nunique() <= 1
    if flat and metric != "eval_loss" and "eval_loss" in df and df["eval_loss"].nunique() > 1:
        shown.append(("eval_loss", "min"))
    panels = [(m, md, g) for m, md in shown for g in groups]
    ncols = min(4, max(1, len(groups)))
    nrows = max(1, len(shown) * -(-len(groups) // ncols))
    fig = Figure(figsize=(3.6 * ncols, 3.4 * nrows))
    axes = np.atleast_1d(fig.subplots(nrows, ncols)).ravel()
    if not groups:
        axes[0].text(0.5, 0.5, "no varying hyperparameters", ha="center", va="center")
        return fig
    per_metric = -(-len(groups) // ncols) * ncols  # each metric's panels start a new row
    used = [k * per_metric + n for k in range(len(shown)) for n in range(len(groups))]
    for k, ax in enumerate(axes):
        ax.set_visible(k in used)
    for k, (m, md, group) in zip(used, panels, strict=True):
        _hp_panel(axes[k], df[df[m].notna()], group, m, md)
        if m == metric and flat:
            axes[k].set_title(f"{metric}: the same for every config", fontsize=8)
    fig.tight_layout()
    return fig


def _hp_panel(
    ax: Axes, df: pd.DataFrame, group: Sequence[str], metric: str, mode: str | None
) -> None:
    """One panel of :func:`plot_hp_effects`: ``metric`` against ``group[0]``."""
    best_idx = None
    if mode in ("min", "max") and len(df):
        best_idx = df[metric].idxmin() if mode == "min" else df[metric].idxmax()
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


__all__ = [
    "LINESTYLES",
    "assign_gpu_lanes",
    "best_config_table",
    "config_labels",
    "curve_style",
    "plot_hp_effects",
    "plot_jobs_gantt",
    "plot_loss_curves",
    "plot_plan_gantt",
    "varying_params",
]
