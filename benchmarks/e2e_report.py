"""Checks and the Markdown report of ``benchmarks/e2e.py`` (see its docstring)."""

from __future__ import annotations

import math
import sys
from importlib import metadata
from typing import Any

LABELS = {
    "plora": "plora sweep",
    "plora-single": "plora sweep, one config per job (planner.max_pack_size 1: Min GPU run)",
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


#: Issue 42's targets on the Table-1 slice (case S).
SINGLE_RTOL = 0.10
"""plora's measured speedup over ``plora-single`` within this of what the two plans said."""
TUNE_SPEEDUP = 4.0
"""plora at least this many times faster than Tune + PEFT."""


def targets(systems: dict[str, dict], plans: dict[str, Any] | None) -> dict[str, Any]:
    """plora's speedup over ``plora-single`` measured -- on the coordinator's clock (first plan
    to last job end: what a plan's makespan predicts) and in wall seconds -- against the ratio
    of the two runs' first plans' makespans (``planned_from``; without them, ``plora plan`` of
    both sweep files before either ran), and its speedup over each Tune system in wall
    seconds. Empty without plora; ``ok`` per target."""
    out: dict[str, Any] = {}
    p = systems.get("plora")
    if not p or not p.get("wall_s"):
        return out
    pred = (plans or {}).get("predicted_makespan_s", {})
    single = systems.get("plora-single")
    if single is not None:
        pp, ps = p.get("predicted_makespan_s"), single.get("predicted_makespan_s")
        source = "the first plans of the two runs"
        if not (finite(pp) and finite(ps)):
            pp, ps = pred.get("plora"), pred.get("plora-single")
            source = "plora plan of both sweep files before the runs"
        mp, ms = p.get("measured_makespan_s"), single.get("measured_makespan_s")
        planned = ps / pp if finite(pp) and finite(ps) and pp > 0 else None
        measured = ms / mp if finite(mp) and finite(ms) and mp > 0 else None
        ratio = measured / planned if measured is not None and planned else None
        out["vs_single"] = {
            "planned": planned,
            "planned_from": source,
            "measured": measured,
            "measured_wall": single["wall_s"] / p["wall_s"],
            "measured_over_planned": ratio,
            "rtol": SINGLE_RTOL,
            "ok": ratio is not None and abs(ratio - 1.0) <= SINGLE_RTOL,
        }
    for name in ("tune", "tune-frac"):
        if name in systems:
            speedup = systems[name]["wall_s"] / p["wall_s"]
            out[f"vs_{name}"] = {"speedup": speedup, "target": TUNE_SPEEDUP,
                                 "ok": speedup >= TUNE_SPEEDUP}  # fmt: skip
    return out


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
        "targets": targets(systems, info.get("plans")),
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
        ratio = t.get("alpha_ratio", 2.0)
        alphas = ", ".join(f"{r:g}r" for r in (ratio if isinstance(ratio, list) else [ratio]))
        return (f"grid lr {t['lrs']} × rank {t['ranks']} × batch {t['batch_sizes']} × alpha "
                f"{{{alphas}}}, dropout {t.get('dropout', 0.0):g}")  # fmt: skip
    doms = "; ".join(
        f"{k} {next(iter(v))} {next(iter(v.values()))}" for k, v in draw["space"].items()
    )
    return f"{draw['configs']} configs drawn (seed {draw['seed']}) from Table 1's ranges: {doms}"


def rows_text(data: dict[str, Any]) -> str:
    """The rows in words: about ``tokens`` each, or GSM8K-like lognormal lengths."""
    if data.get("kind") == "gsm8k":
        return (f"GSM8K-like rows, lognormal lengths around {data['tokens_per_row']} tokens cut "
                f"at {data['max_seq_len']}")  # fmt: skip
    return f"~{data['tokens_per_row']} tokens/row (max_seq_len {data['max_seq_len']})"


def targets_text(tg: dict[str, Any]) -> list[str]:
    """Issue 42's targets as Markdown lines (none when the run has no such systems)."""
    lines = []
    single = tg.get("vs_single")
    if single is not None:
        lines.append(
            f"plora vs one config per job: measured {fmt(single['measured'], '.2f')}× on the "
            f"coordinator's clock ({fmt(single['measured_wall'], '.2f')}× in wall seconds), planned "
            f"{fmt(single['planned'], '.2f')}× ({single['planned_from']}): measured / planned "
            f"{fmt(single['measured_over_planned'], '.3f')} (target within "
            f"{100 * single['rtol']:g} %): {'ok' if single['ok'] else 'MISSED'}."
        )
    for name in ("tune", "tune-frac"):
        t = tg.get(f"vs_{name}")
        if t is not None:
            lines.append(
                f"plora vs {LABELS[name].split(',')[0]} ({name}): {t['speedup']:.2f}× (target "
                f"≥ {t['target']:g}×): {'ok' if t['ok'] else 'MISSED'}."
            )
    return [*lines, ""] if lines else []


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
        f"peft {sw['peft']}, ray {sw['ray']} · batch {t['batch_sizes']}, {rows_text(rep['data'])}, "
        f"all 7 projections, {t['schedule']} "
        f"({t['warmup_steps']} warm-up), {space_text(t)}; gradient checkpointing in the Tune baselines: "
        f"{'on' if t['gradient_checkpointing_in_tune'] else 'off'}",
        "",
        "| system | wall (s) | planned (s) | plora speedup | GPU busy | configs finished | best eval loss | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    planned = (rep.get("plans") or {}).get("predicted_makespan_s", {})
    n = len(rep["configs"])
    for name, row in sysr.items():
        losses = [v for v in row["eval_loss"].values() if v is not None]
        if name in ("plora", "plora-single"):
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
            f"| {label} | {fmt(row['wall_s'])} | "
            f"{fmt(row.get('predicted_makespan_s', planned.get(name)))} | "
            f"{'—' if name == 'plora' else fmt(speed, '.2f') + '×'} | "
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
        *targets_text(rep.get("targets") or {}),
        "| config | " + " | ".join(sysr) + " |",
        "|---|" + "---|" * len(sysr),
    ]
    for c in rep["configs"]:
        cells = [fmt(sysr[s]["eval_loss"].get(c["key"]), ".4f") for s in sysr]
        lines.append(f"| {c['key']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
