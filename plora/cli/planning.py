"""``plora plan`` and ``plora validate``: a sweep file checked and planned, nothing run."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from plora.api import BaselineOption, PlanReport, load_sweep, make_plan
from plora.cli.app import app, check_output_path, print_warnings, user_errors
from plora.utils import fmt_duration

if TYPE_CHECKING:
    from plora.planner import Plan


def print_plan(report: PlanReport) -> None:
    """The job table and the makespan comparison, with rich."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    plan, sweep = report.plan, report.sweep
    hw = sweep.hardware
    title = (f"{sweep.name}: {plan.num_configs} configs of {sweep.model.name_or_path} on "
             f"{hw.num_gpus}x {hw.gpu_type} ({hw.gpu_memory_gib:g} GiB, load {hw.load_factor:g}), seq {sweep.seq_len}")  # fmt: skip
    rows = [
        [
            job.job_id,
            str(len(job.config_ids)) + (f" ({job.micro_batches} mb)" if job.micro_batches > 1 else ""),
            str(job.gpus), str(job.strategy or "-"),
            fmt_duration(job.start_s), fmt_duration(job.end_s), f"{job.memory_gib_per_gpu:.1f}",
            ",".join(map(str, job.gpu_ids)), " ".join(job.config_ids),
        ]
        for job in plan.jobs
    ]  # fmt: skip
    heads = ("job", "#", "d", "strategy", "start", "end", "GiB/GPU", "GPUs", "configs")
    fixed = sum(max([len(h), *(len(r[i]) for r in rows)]) + 2 for i, h in enumerate(heads[:-1]))
    budget = max(12, console.width - fixed - 2 * len(heads) - 4)  # + padding and separators
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in heads:
        table.add_column(
            col,
            justify="left" if col in ("job", "strategy", "GPUs", "configs") else "right",
            no_wrap=True,
        )
    for row in rows:
        ids = row[-1]
        table.add_row(*row[:-1], ids if len(ids) <= budget else ids[: budget - 1] + "…")
    console.print(table)
    name = "PLoRA" if plan is report.plora else f"baseline {report.plan_name}"
    console.print(f"{name} makespan: [bold]{fmt_duration(plan.makespan_s)}[/bold] "
                  f"({len(plan.jobs)} jobs, solver {plan.solver}, planned in {report.seconds:.2f}s)")  # fmt: skip
    if report.overheads:
        o, t = report.overheads, report.overheads["totals"]
        console.print(f"  in it: start-up {fmt_duration(o['worker_start_s'] + o['model_load_s'])} x{t['startups']:.0f} "
                      f"(worker {fmt_duration(o['worker_start_s'])} + model load {fmt_duration(o['model_load_s'])}, {o['source']}), "
                      f"job start {fmt_duration(o['job_start_s'])} x{len(plan.jobs)}, eval {fmt_duration(t['eval_s'])}, "
                      f"export {fmt_duration(t['export_s'])}, checkpoints {fmt_duration(t['checkpoint_s'])}, "
                      f"steps {fmt_duration(t['train_s'])} (GPU-group time)", soft_wrap=True)  # fmt: skip
    for key in ("min_gpu", "max_gpu", "tune"):
        label = key.replace("_", "-")
        if key in report.skipped:
            console.print(f"  vs {label}: n/a ({report.skipped[key]})", soft_wrap=True)
            continue
        base = report.baselines[key]
        speedup = (
            base.makespan_s / report.plora.makespan_s
            if report.plora.makespan_s > 0
            else float("nan")
        )
        booked = f"; {report.booked[key]}" if report.booked.get(key) else ""
        console.print(f"  vs {label}: {fmt_duration(base.makespan_s)} ({len(base.jobs)} jobs) "
                      f"-> PLoRA is {speedup:.2f}x faster{booked}", soft_wrap=True)  # fmt: skip
    console.print(f"  lower bound: {fmt_duration(plan.lower_bound_s)} (plan <= {plan.makespan_s / plan.lower_bound_s:.3f}x optimal)"
                  if plan.lower_bound_s > 0 else "  lower bound: 0")  # fmt: skip
    console.print(f"  Thm 6.1 ratio bound: {plan.ratio_bound:.3f}")
    for note in plan.notes:
        console.print(f"  note: {note}", soft_wrap=True)
    if sweep.search in ("optuna", "hyperopt"):
        console.print(f"  note: {sweep.search} proposes configs at run time; this plan packs "
                      f"{plan.num_configs} random draws of the space as an estimate", soft_wrap=True)  # fmt: skip


@app.command()
def plan(
    sweep_file: Annotated[Path, typer.Argument(metavar="SWEEP.yaml", help="Sweep definition.")],
    gpus: Annotated[int | None, typer.Option("--gpus", help="Override hardware.num_gpus.")] = None,
    gpu_type: Annotated[
        str | None,
        typer.Option(
            "--gpu-type", help="Override hardware.gpu_type (its memory and peak too), e.g. H100."
        ),
    ] = None,
    gpu_memory_gib: Annotated[
        float | None, typer.Option("--gpu-memory-gib", help="Override hardware.gpu_memory_gib.")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the plan as JSON.")] = None,
    gantt: Annotated[
        Path | None, typer.Option("--gantt", help="Draw the plan's jobs on GPUs (.png/.pdf/.svg).")
    ] = None,
    baseline: Annotated[
        BaselineOption | None,
        typer.Option("--baseline", help="Output this baseline schedule instead of PLoRA's plan."),
    ] = None,
) -> None:
    """Plan a sweep: pack its configs into jobs on the GPUs and predict the makespan."""
    with user_errors(str(sweep_file)):
        check_output_path(out, "--out", (".json",))
        check_output_path(gantt, "--gantt", (".png", ".pdf", ".svg"))
        sweep = load_sweep(sweep_file, gpus=gpus, gpu_type=gpu_type, gpu_memory_gib=gpu_memory_gib)
        key = "--gpu-memory-gib" if gpu_memory_gib is not None else "hardware.gpu_memory_gib"
        report = make_plan(sweep, baseline=baseline, memory_key=key)
        image = _render_gantt(report.plan, gantt) if gantt else None
    print_plan(report)
    from plora.utils import atomic_write_bytes, atomic_write_json

    if out is not None:
        atomic_write_json(out, report.to_json_dict())
        typer.echo(f"wrote {out}")
    if gantt is not None and image is not None:
        atomic_write_bytes(gantt, image)
        typer.echo(f"wrote {gantt}")


def _render_gantt(plan: Plan, path: Path) -> bytes:
    from plora.analysis.plots import plot_plan_gantt

    fig = plot_plan_gantt(plan)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".").lower(), dpi=150, bbox_inches="tight")
    return buf.getvalue()


@app.command()
def validate(
    sweep_file: Annotated[Path, typer.Argument(metavar="SWEEP.yaml", help="Sweep definition.")],
) -> None:
    """Check a sweep file for training: values, search space, the dataset's files and rows, and
    that the base model and its tokenizer load (hub ids: a short timeout, HF_HUB_OFFLINE honoured)."""
    from plora import api

    with user_errors(str(sweep_file)):
        report = api.check(load_sweep(sweep_file))
    sweep = report.sweep
    print_warnings(sweep)
    kind = "configs" if sweep.search in ("grid", "random") else "trials (proposed by the searcher)"
    typer.echo(
        f"{sweep_file}: ok ({report.num_configs} {kind}, {sweep.search} search, model "
        f"{sweep.model.name_or_path}; data {report.train_rows} train / {report.eval_rows} eval "
        f"rows{f' (a sample of {report.sampled} checked)' if report.sampled else ''}, "
        f"metric {report.metric})"
    )


__all__ = ["plan", "print_plan", "validate"]
