"""Reports people read (issue 14, item 6): the HP-effects plot shows every hyperparameter that
varies, once; loss curves stay readable past 10 configs (distinct colour + line style, labels
from the varying hyperparameters)."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
from matplotlib.colors import to_rgba

from plora.analysis import plots
from plora.config import LoRAConfig


def _results() -> pd.DataFrame:
    """24 configs varying lr, rank (alpha = 2 rank), target modules, dropout, rsLoRA, epochs."""
    rows = []
    grid = itertools.product((1e-4, 1e-3), (8, 16), ("attention", "all"), (0.0, 0.1), (False, True))
    for k, (lr, rank, targets, dropout, rslora) in enumerate(grid):
        if k >= 24:
            break
        c = LoRAConfig(lr=lr, rank=rank, alpha=2 * rank, target_modules=targets, dropout=dropout,
                       use_rslora=rslora, epochs=1.0 + (k // 3) % 2, batch_size=4, seed=3)  # fmt: skip
        rows.append({"config_id": c.config_id, **c.hparams(), "status": "done",
                     "eval_loss": 1.0 + 0.01 * k})  # fmt: skip
    df = pd.DataFrame(rows)
    df["target_modules"] = df["target_modules"].map(",".join)
    return df


def test_hp_effects_shows_every_varying_parameter_once() -> None:
    res = _results()
    fig = plots.plot_hp_effects(res, "eval_loss", mode="min")
    labels = [ax.get_xlabel() for ax in fig.axes if ax.get_visible()]
    assert sorted(labels) == sorted(
        ["rank & alpha", "lr", "target_modules", "dropout", "use_rslora", "epochs"]
    )
    assert len(labels) == len(set(labels))
    # what varies, from the table itself: each varying column is named by exactly one panel
    varying = [c for c in ("lr", "rank", "alpha", "target_modules", "dropout", "use_rslora",
                           "epochs", "batch_size", "seed") if res[c].map(str).nunique() > 1]  # fmt: skip
    named = [p for label in labels for p in label.split(" & ")]
    assert sorted(named) == sorted(varying)


def test_loss_curves_distinct_and_labelled_past_ten() -> None:
    res = _results()
    ids = list(res["config_id"][:14])
    metrics = pd.DataFrame(
        [
            {"config_id": c, "step": s, "loss": 2.0 / s + k}
            for k, c in enumerate(ids)
            for s in (1, 2, 3)
        ]
    )
    fig = plots.plot_loss_curves(metrics, config_ids=ids, results=res)
    lines = fig.axes[0].get_lines()
    styles = {(to_rgba(line.get_color()), line.get_linestyle()) for line in lines}
    assert len(lines) == 14 and len(styles) == 14  # no two curves look the same
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(legend) == 14 and len(set(legend)) == 14
    assert all("lr=" in t and "rank=" in t and "target_modules=" in t for t in legend), legend
    assert not any(t in ids for t in legend)  # not hash ids


@pytest.mark.parametrize("k", [0, 9, 10, 39])
def test_curve_style_cycle(k) -> None:
    seen = {
        (plots.curve_style(i)["color"], plots.curve_style(i)["linestyle"]) for i in range(k + 1)
    }
    assert len(seen) == k + 1


def test_plots_on_an_axes_of_a_subfigure_return_the_root_figure() -> None:
    from matplotlib.figure import Figure

    root = Figure()
    ax = root.subfigures(1, 2)[1].subplots()
    fig = plots.plot_jobs_gantt(pd.DataFrame(), ax=ax)
    assert fig is root  # savefig-able, as the annotation says
    assert plots.plot_jobs_gantt(pd.DataFrame()) is not root  # no axes: a new figure


def test_hp_effects_of_a_random_sweep_give_each_drawn_parameter_its_axis() -> None:
    """Issue 29: lr, alpha and seed drawn afresh per config are one to one by chance; each gets
    its own readable axis (they shared one panel, "alpha & lr & seed", plotted against alpha)."""
    rows = [
        {"config_id": f"c{k}", "lr": 10 ** (-4 + k / 3), "alpha": 4.0 + 1.7 * k, "seed": 100 + k,
         "rank": (4, 8)[k % 2], "status": "done", "eval_loss": 1.0 + k / 10}
        for k in range(6)
    ]  # fmt: skip
    fig = plots.plot_hp_effects(pd.DataFrame(rows), "eval_loss", mode="min")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert sorted(ax.get_xlabel() for ax in axes) == ["alpha", "lr", "rank", "seed"]
    (lr,) = [ax for ax in axes if ax.get_xlabel() == "lr"]
    assert lr.get_xscale() == "log"
    assert sorted(lr.collections[0].get_offsets()[:, 0]) == pytest.approx([r["lr"] for r in rows])


def test_hp_effects_show_eval_loss_beside_a_metric_that_does_not_separate() -> None:
    """Issue 29: exact match 0 for every config (a short sweep) is a flat line in every panel;
    eval loss is drawn beside it."""
    res = _results()
    res["eval_metric"] = 0.0
    fig = plots.plot_hp_effects(res, "eval_metric", mode="max")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    by_metric = {m: [ax.get_xlabel() for ax in axes if ax.get_ylabel() == m]
                 for m in ("eval_metric", "eval_loss")}  # fmt: skip
    assert sorted(by_metric["eval_metric"]) == sorted(by_metric["eval_loss"])
    assert len(by_metric["eval_loss"]) == 6
    assert all("same for every config" in ax.get_title() for ax in axes
               if ax.get_ylabel() == "eval_metric")  # fmt: skip
    separating = plots.plot_hp_effects(res.assign(eval_metric=range(len(res))), "eval_metric")
    assert {ax.get_ylabel() for ax in separating.axes if ax.get_visible()} == {"eval_metric"}
