"""Checks and the Markdown report of ``benchmarks/e2e.py`` (see its docstring)."""

from __future__ import annotations

import math
import sys
from importlib import metadata
from typing import Any

LABELS = {
    "plora": "plora sweep",
    "tune": "Ray Tune + PEFT, 1 GPU/trial",
    "tune-frac": "Ray Tune + PEFT, {f:g} GPU/trial",
    "tune-fsdp": "Ray Tune + Ray Train FSDP2 + PEFT, {f:g} GPUs/trial",
    "tune-devmap": "Ray Tune + PEFT, device_map=auto, {f:g} GPUs/trial",
}


def finite(x: Any) -> bool:
    """A real, finite number (not None, NaN or inf)."""
    return isinstance(x, int | float) and math.isfinite(x)


def compare(
    systems: dict[str, dict],
    keys: list[str],
    base: float | None,
    *,
    rtol: float,
    min_drop_ratio: float,
) -> dict[str, Any]:
    """Check the systems' eval losses against each other and against the base model.

    For each config ``k`` with eval loss ``L_s`` in system ``s`` and base-model loss ``L_0``:

    * finished: every system has a finite ``L_s`` (``missing`` lists the others);
    * trained: ``L_s < L_0`` (an adapter that never trained, or was lost, stays at ``L_0``);
    * agreement: ``(max_s L_s - min_s L_s) / min_s L_s <= rtol`` -- loose, since LoRA A starts
      from a different random draw in plora and in PEFT;
    * drop ratio: ``min_s (L_0 - L_s) / max_s (L_0 - L_s) >= min_drop_ratio`` -- the relative
      check tells little when the drop is small next to the loss; this one fails when a system
      trains at a fraction of another's pace (a wrong scale, lr or schedule) or not at all.

    Returns:
        The worst relative disagreement and drop ratio (config and systems), the failures, and
        ``ok``.
    """
    missing, untrained = [], []
    worst = {"rel_diff": 0.0, "config": None, "pair": None}
    drop = {"ratio": 1.0, "config": None, "pair": None}
    for k in keys:
        losses = {s: row["eval_loss"].get(k) for s, row in systems.items()}
        missing += [f"{s}:{k}" for s, v in losses.items() if v is None]
        have = {s: v for s, v in losses.items() if v is not None}
        untrained += [f"{s}:{k}" for s, v in have.items() if base is not None and not v < base]
        if len(have) < 2:
            continue
        lo, hi = min(have, key=have.get), max(have, key=have.get)
        rel = (have[hi] - have[lo]) / abs(have[lo])
        if rel >= worst["rel_diff"]:
            worst = {"rel_diff": rel, "config": k, "pair": [lo, hi]}
        if base is not None and base > have[lo]:
            ratio = max(0.0, base - have[hi]) / (base - have[lo])
            if ratio <= drop["ratio"]:
                drop = {"ratio": ratio, "config": k, "pair": [hi, lo]}
    ok = (
        not missing
        and not untrained
        and worst["rel_diff"] <= rtol
        and (base is None or drop["ratio"] >= min_drop_ratio)
    )
    return {
        "rtol": rtol,
        "min_drop_ratio": min_drop_ratio,
        "worst": worst,
        "worst_drop": drop,
        "missing": missing,
        "not_trained": untrained,
        "ok": ok,
    }


def report(
    info: dict[str, Any],
    systems: dict[str, dict],
    keys: list[str],
    base: float | None,
    *,
    rtol: float,
    min_drop_ratio: float,
    complete: bool,
) -> dict[str, Any]:
    """The JSON report: the run's ``info``, the systems' rows, plora's speedup over each other
    system (its wall seconds over plora's), the checks (:func:`compare`) and the Markdown."""
    plora_wall = systems.get("plora", {}).get("wall_s")
    rep = {
        **info,
        "complete": complete,
        "base_eval_loss": base,
        "systems": systems,
        "speedups": {
            s: row["wall_s"] / plora_wall
            for s, row in systems.items()
            if s != "plora" and plora_wall
        },
        "agreement": compare(systems, keys, base, rtol=rtol, min_drop_ratio=min_drop_ratio),
    }
    rep["markdown"] = markdown(rep)
    return rep


def versions() -> dict[str, str | None]:
    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "peft", "ray", "triton"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def jobs_text(jobs: list[dict[str, Any]]) -> str:
    """``3 × d=2 pp, 1 × d=1``: the jobs that ran by GPU count and strategy."""
    kinds: dict[str, int] = {}
    for j in jobs:
        label = f"d={j['gpus']}" + (f" {j['strategy']}" if j.get("strategy") else "")
        kinds[label] = kinds.get(label, 0) + 1
    return ", ".join(f"{n} × {label}" for label, n in kinds.items()) or "none"


def failed_trials(row: dict[str, Any]) -> list[str]:
    """The Tune trials that ended with an error (an OOM counts), as ``key: first line``."""
    return [f"{t['key']}: {t['error']}" for t in row.get("trials", []) if t.get("error")]


def space_text(t: dict[str, Any]) -> str:
    """The configs in words: the grid, or ``--draw``'s seeded draws and their domains."""
    draw = t.get("draw")
    if not draw:
        return f"grid lr {t['lrs']} × rank {t['ranks']} × batch {t['batch_sizes']}, alpha 2r"
    doms = "; ".join(
        f"{k} {next(iter(v))} {next(iter(v.values()))}" for k, v in draw["space"].items()
    )
    return f"{draw['configs']} configs drawn (seed {draw['seed']}) from Table 1's ranges: {doms}"


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(rep: dict[str, Any]) -> str:
    """The ``benchmarks/RESULTS.md`` section of this run."""
    sysr, t, sw = rep["systems"], rep["training"], rep["software"]
    lines = [
        f"### {rep['model']['name']} ({'random weights' if rep['model']['random_weights'] else 'built-in'}), "
        f"{len(rep['configs'])} configs × {t['steps']} steps — {rep['gpu']} × {rep['num_gpus']}",
        "",
        f"{rep['date']} · `{rep['command']}` · torch {sw['torch']}, transformers {sw['transformers']}, "
        f"peft {sw['peft']}, ray {sw['ray']} · batch {t['batch_sizes']}, ~{rep['data']['tokens_per_row']} "
        f"tokens/row (max_seq_len {rep['data']['max_seq_len']}), all 7 projections, {t['schedule']} "
        f"({t['warmup_steps']} warm-up), {space_text(t)}; gradient checkpointing in the Tune baselines: "
        f"{'on' if t['gradient_checkpointing_in_tune'] else 'off'}",
        "",
        "| system | wall (s) | plora speedup | GPU busy | configs finished | best eval loss | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    n = len(rep["configs"])
    for name, row in sysr.items():
        losses = [v for v in row["eval_loss"].values() if v is not None]
        if name == "plora":
            note = (
                f"first plan's makespan {fmt(row.get('predicted_makespan_s'))} s (coordinator clock: "
                f"after process + Ray start); measured on that clock "
                f"{fmt(row.get('measured_makespan_s'))} s ({fmt(row.get('measured_over_predicted'), '.2f')}× "
                f"the plan); {len(row.get('jobs', []))} jobs ({jobs_text(row.get('jobs', []))}), "
                f"{row.get('plans', 0)} plans; CUDA graphs "
                f"{rep.get('cuda_graphs', {}).get('setting', 'auto')}"
            )
        else:
            failed = failed_trials(row)
            note = (
                f"Ray start {fmt(row.get('ray_init_s'))} s; per trial: load {fmt(row.get('mean_trial_load_s'))} s, "
                f"train {fmt(row.get('mean_trial_train_s'))} s, eval {fmt(row.get('mean_trial_eval_s'))} s; "
                f"{len(failed)} failed trials" + (f" (first: {failed[0][:160]})" if failed else "")
            )
        speed = rep["speedups"].get(name)
        label = LABELS[name].format(f=row.get("gpu_per_trial", 0))
        lines.append(
            f"| {label} | {fmt(row['wall_s'])} | {'—' if name == 'plora' else fmt(speed, '.2f') + '×'} | "
            f"{fmt(row['gpu_busy'], '.2f')} | {len(losses)}/{n} | {fmt(min(losses) if losses else None, '.4f')} | {note} |"
        )
    agr = rep["agreement"]
    w = agr["worst"]
    lines += [
        "",
        f"Eval loss per config (base model {fmt(rep['base_eval_loss'], '.4f')}); worst disagreement "
        f"{100 * w['rel_diff']:.2f} % ({w['config']}, {' vs '.join(w['pair'] or [])}); rtol "
        f"{100 * agr['rtol']:g} %; smallest drop below the base model vs another system's "
        f"{agr['worst_drop']['ratio']:.2f} ({agr['worst_drop']['config']}; at least "
        f"{agr['min_drop_ratio']:g}): {'ok' if agr['ok'] else 'FAILED'}.",
        "",
        "| config | " + " | ".join(sysr) + " |",
        "|---|" + "---|" * len(sysr),
    ]
    for c in rep["configs"]:
        cells = [fmt(sysr[s]["eval_loss"].get(c["key"]), ".4f") for s in sysr]
        lines.append(f"| {c['key']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
