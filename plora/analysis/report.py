"""``plora report DIR [--out report.html|report.md]``: a sweep's results as one document.

The report holds a summary (configs, jobs, measured vs planned makespan, GPU utilization), the
best-config table, and three figures: jobs on GPUs, loss curves, hyperparameter effects. HTML
reports are self-contained (figures inlined as PNG); Markdown reports put the PNGs in a
``<name>_files/`` folder beside the file. Every file is written atomically.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any

import pandas as pd

from plora.analysis.load import SweepResults, load
from plora.config import ConfigError
from plora.utils import atomic_write_bytes, atomic_write_text

#: Configs whose loss curves the report draws (the best ones by the sweep metric).
MAX_CURVES = 12


def summary(res: SweepResults) -> dict[str, Any]:
    """Headline numbers of a sweep.

    ``gpu_utilization`` is busy GPU-time over available GPU-time,
    :math:`\\sum_j d_j (e_j - s_j) / (G \\cdot (\\max_j e_j - \\min_j s_j))`, with ``G`` the
    plan's GPU count (or the most GPU ids seen).
    """
    r, j = res.results, res.jobs
    status = r["status"].astype(str).str.lower() if "status" in r.columns else pd.Series([])
    out: dict[str, Any] = {
        "sweep": res.sweep.get("name") or res.path.name,
        "configs": len(r),
        "finished": int(status.isin(["finished", "completed", "done"]).sum()),
        "failed": int(status.isin(["failed", "error"]).sum()),
        "stopped": int(status.isin(["stopped", "early_stopped", "pruned"]).sum()),
        "jobs": len(j),
        "metric": res.metric,
        "mode": res.mode,
    }
    if res.missing:
        out["missing"] = res.missing_note.removeprefix("missing: ")
    num_gpus = res.plan.get("num_gpus")
    if not j.empty:
        makespan = float(j["end"].max() - j["start"].min())
        busy = float((j["num_gpus"] * (j["end"] - j["start"])).sum())
        if not num_gpus:
            ids = {g for ids in j["gpu_ids"] if ids is not None for g in ids}
            num_gpus = max(len(ids), int(j["num_gpus"].max()))
        out["makespan_s"] = makespan
        out["gpu_seconds"] = busy
        out["gpu_utilization"] = busy / (num_gpus * makespan) if makespan > 0 else math.nan
    out["num_gpus"] = num_gpus
    for key in ("makespan_s", "lower_bound_s", "ratio_bound", "solver"):
        if key in res.plan:
            out[f"planned_{key}"] = res.plan[key]
    if not r.empty and res.metric in r.columns:
        top = res.best(k=1)
        if not top.empty:
            out["best_config_id"] = str(top["config_id"].iloc[0])
            out["best_" + res.metric] = float(top[res.metric].iloc[0])
    return out


def write_report(
    sweep_dir: str | Path | SweepResults, out: str | Path | None = None, *, k: int = 10
) -> Path:
    """Write the report of ``sweep_dir`` and return its path.

    A partial sweep directory (interrupted, still running, a file damaged) is reported as far as
    it goes, with a "missing" line in the summary; one with neither results nor a single training
    step is an error.

    Args:
        sweep_dir: a sweep directory (or what :func:`plora.analysis.load` read from one).
        out: ``.html`` or ``.md`` file (default ``<sweep_dir>/report.html``).
        k: rows in the best-config table.

    Raises:
        ConfigError: unreadable sweep dir, nothing to report yet, or an ``out`` suffix other
            than .html/.htm/.md.
    """
    from plora.analysis import plots

    res = sweep_dir if isinstance(sweep_dir, SweepResults) else load(sweep_dir)
    if not _has_results(res) and res.metrics.empty:
        raise ConfigError(
            f"sweep dir {str(res.path)!r}: nothing to report yet: no config has ended and no "
            f"training step was recorded (every config is queued or running"
            f"{'; ' + res.missing_note if res.missing else ''}); "
            f"see `plora status {res.path}`, wait for the sweep or --resume it"
        )
    out = Path(out) if out is not None else res.path / "report.html"
    suffix = out.suffix.lower()
    if suffix not in (".html", ".htm", ".md", ".markdown"):
        raise ConfigError(f"report --out {str(out)!r}: unknown format; use a .html or .md file")
    metric, mode = res.metric, res.mode
    figures = {
        "jobs_gantt": plots.plot_jobs_gantt(res.jobs, num_gpus=res.plan.get("num_gpus")),
        "loss_curves": plots.plot_loss_curves(
            res.metrics, config_ids=_curve_ids(res), smooth=5, results=res.results
        ),
        "hp_effects": plots.plot_hp_effects(res.results, metric, mode=mode),
    }
    pngs = {name: _png(fig) for name, fig in figures.items()}
    table = (
        plots.best_config_table(res.results, metric, mode, k=k)
        if metric in res.results.columns
        else pd.DataFrame()
    )
    facts = summary(res)
    if suffix in (".md", ".markdown"):
        files = out.with_name(out.stem + "_files")
        for name, data in pngs.items():
            atomic_write_bytes(files / f"{name}.png", data)
        atomic_write_text(out, _markdown(facts, table, {n: f"{files.name}/{n}.png" for n in pngs}))
    else:
        atomic_write_text(out, _html(facts, table, pngs))
    return out


def _has_results(res: SweepResults) -> bool:
    """Some config ended (done, stopped or failed): rows still queued or running do not count."""
    r = res.results
    if r.empty or "status" not in r.columns:
        return not r.empty
    return bool((~r["status"].astype(str).str.lower().isin(["queued", "running"])).any())


def _curve_ids(res: SweepResults) -> list[str] | None:
    if res.metric in res.results.columns and not res.results.empty:
        top = res.best(k=MAX_CURVES)
        if not top.empty:
            return list(top["config_id"])
    if res.metrics.empty:
        return None
    return list(dict.fromkeys(res.metrics["config_id"]))[:MAX_CURVES]


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        return f"{value:.4g}"
    return str(value)


_TITLES = {
    "jobs_gantt": "Jobs on GPUs",
    "loss_curves": f"Training loss (best {MAX_CURVES})",
    "hp_effects": "Hyperparameter effects",
}


def markdown_table(df: pd.DataFrame) -> str:
    """``df`` as a GitHub Markdown table (no extra dependency)."""
    if df.empty:
        return "_no rows_\n"
    head = "| " + " | ".join(str(c) for c in df.columns) + " |"
    rule = "|" + "|".join("---" for _ in df.columns) + "|"
    body = [
        "| " + " | ".join(_fmt(v).replace("|", "\\|") for v in row) + " |"
        for row in df.itertuples(index=False)
    ]
    return "\n".join([head, rule, *body]) + "\n"


def _markdown(facts: dict[str, Any], table: pd.DataFrame, images: dict[str, str]) -> str:
    parts = [f"# plora sweep report: {facts['sweep']}\n", "## Summary\n"]
    parts += [f"- **{k}**: {_fmt(v)}" for k, v in facts.items() if k != "sweep"]
    parts += [
        "",
        f"## Best configs by {facts['metric']} ({facts['mode']})\n",
        markdown_table(table),
    ]
    for name, rel in images.items():
        parts += [f"## {_TITLES[name]}\n", f"![{name}]({rel})\n"]
    return "\n".join(parts)


def _html(facts: dict[str, Any], table: pd.DataFrame, pngs: dict[str, bytes]) -> str:
    esc = html.escape
    rows = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(_fmt(v))}</td></tr>"
        for k, v in facts.items()
        if k != "sweep"
    )
    best = (
        table.to_html(index=False, float_format=lambda v: f"{v:.4g}", border=0)
        if not table.empty
        else "<p>no finished configs</p>"
    )
    figs = "".join(
        f"<h2>{esc(_TITLES[n])}</h2><img alt='{n}' "
        f"src='data:image/png;base64,{base64.b64encode(data).decode()}'/>"
        for n, data in pngs.items()
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>plora report: {esc(str(facts['sweep']))}</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
        "table{border-collapse:collapse}td,th{padding:2px 10px;text-align:left}"
        "img{max-width:100%}</style></head><body>"
        f"<h1>plora sweep report: {esc(str(facts['sweep']))}</h1>"
        f"<h2>Summary</h2><table>{rows}</table>"
        f"<h2>Best configs by {esc(facts['metric'])} ({esc(facts['mode'])})</h2>{best}"
        f"{figs}</body></html>\n"
    )


__all__ = ["markdown_table", "summary", "write_report"]
