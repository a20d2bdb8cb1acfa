"""``plora plan`` / ``plora validate``: bad input, the paper's sweep, start-up cost."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plora.cli import app
from plora.config import SweepConfig
from plora.tune.space import expand

REPO = Path(__file__).resolve().parents[2]
BAD = sorted((Path(__file__).parent / "bad_sweeps").glob("*.yaml"))
PAPER = REPO / "sweeps" / "paper-table1.yaml"
PLORA = [sys.executable, "-c", "from plora.cli import app; app()"]


def expectations(path: Path) -> tuple[str, list[str]]:
    """The ``# expect-cmd:`` command and ``# expect:`` substrings at the top of a bad sweep."""
    cmd, needles = "plan", []
    for line in path.read_text().splitlines():
        if line.startswith("# expect-cmd:"):
            cmd = line.split(":", 1)[1].strip()
        elif line.startswith("# expect:"):
            needles += [n.strip() for n in line.split(":", 1)[1].split(" | ")]
    return cmd, needles


def run(args: list[str]):
    return CliRunner().invoke(app, args)


def assert_one_error_line(result, *needles: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert result.stdout == ""
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_at_least_15_distinct_bad_sweeps() -> None:
    assert len(BAD) >= 15
    assert len({p.read_text() for p in BAD}) == len(BAD)
    assert all(expectations(p)[1] for p in BAD)


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_sweep_gives_one_error_line_and_writes_nothing(path: Path, tmp_path: Path) -> None:
    cmd, needles = expectations(path)
    out, gantt = tmp_path / "plan.json", tmp_path / "plan.png"
    args = [cmd, str(path)] + (["--out", str(out), "--gantt", str(gantt)] if cmd == "plan" else [])
    assert_one_error_line(run(args), str(path), *needles)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--gpus", "0"], ("--gpus=0", "must be >= 1")),
        (["--gpu-memory-gib", "-5"], ("--gpu-memory-gib=-5", "must be > 0")),
        (["--gpu-type", "TPU9"], ("--gpu-type='TPU9'", "unknown gpu_type", "H100")),
        (["--out", "{tmp}/plan.txt"], ("--out=", "plan.txt", ".json")),
        (["--gantt", "{tmp}/plan.gif"], ("--gantt=", "plan.gif", ".png")),
        (["--out", "{tmp}"], ("--out=", "is a directory")),
    ],
)
def test_bad_options(extra: list[str], needles: tuple[str, ...], tmp_path: Path) -> None:
    args = ["plan", str(PAPER), *(a.format(tmp=tmp_path) for a in extra)]
    assert_one_error_line(run(args), *needles)
    assert list(tmp_path.iterdir()) == []


def test_missing_sweep_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert_one_error_line(run(["plan", str(missing)]), str(missing), "file not found")


def check_plan(plan: dict, sweep: SweepConfig, num_gpus: int, gpu_gib: float) -> None:
    """Independent checks of a plan.json: coverage, GPU and memory limits, bounds."""
    for key in ("num_configs", "num_gpus", "makespan_s", "lower_bound_s", "ratio_bound", "jobs"):
        assert key in plan
    ids = [c for job in plan["jobs"] for c in job["config_ids"]]
    expected = {c.config_id for c in expand(sweep)}
    assert sorted(ids) == sorted(expected) and len(ids) == plan["num_configs"]
    assert {c["config_id"] for c in plan["configs"]} == expected
    jobs = plan["jobs"]
    for job in jobs:
        for key in ("job_id", "gpus", "strategy", "start_s", "end_s", "memory_gib_per_gpu"):
            assert key in job
        assert job["end_s"] > job["start_s"] >= 0
        assert job["memory_gib_per_gpu"] <= 0.9 * gpu_gib + 1e-6
        assert len(job["gpu_ids"]) == job["gpus"] and set(job["gpu_ids"]) <= set(range(num_gpus))
        # at every job start, the jobs running then use at most G GPUs, on disjoint GPU ids
        t = job["start_s"]
        live = [j for j in jobs if j["start_s"] <= t < j["end_s"]]
        assert sum(j["gpus"] for j in live) <= num_gpus
        used = [g for j in live for g in j["gpu_ids"]]
        assert len(used) == len(set(used))
    assert plan["makespan_s"] == pytest.approx(max(j["end_s"] for j in jobs))
    assert plan["lower_bound_s"] <= plan["makespan_s"] * (1 + 1e-9)
    assert plan["makespan_s"] <= plan["baselines"]["min_gpu"]["makespan_s"] * (1 + 1e-9)
    assert plan["makespan_s"] <= plan["baselines"]["max_gpu"]["makespan_s"] * (1 + 1e-9)


def test_paper_table1_plans_within_5_seconds(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    args = ["plan", str(PAPER), "--gpus", "8", "--gpu-memory-gib", "40", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run([*PLORA, *args], capture_output=True, text=True, cwd=tmp_path)
    wall = time.perf_counter() - t0
    print(f"plora plan paper-table1 (120 configs, 8 GPUs): {wall:.2f} s wall")
    assert proc.returncode == 0, proc.stderr
    assert wall <= 5.0
    plan = json.loads(out.read_text())
    assert (plan["num_configs"], plan["num_gpus"], plan["schedule"]) == (120, 8, "plora")
    check_plan(plan, SweepConfig.from_yaml(PAPER), 8, 40.0)
    assert "makespan" in proc.stdout and "min-gpu" in proc.stdout and "max-gpu" in proc.stdout


def test_gpu_type_option_plans_for_that_gpu(tmp_path: Path) -> None:
    """``--gpu-type H100`` replaces the file's A100-40GB with the H100's 80 GB and peak: the
    plan's jobs may fill 0.9 x 80 GiB, and the file's GPU would not hold them."""
    out = tmp_path / "p.json"
    result = run(["plan", str(PAPER), "--gpus", "8", "--gpu-type", "h100", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    sweep = SweepConfig.from_yaml(PAPER)
    check_plan(plan, sweep, 8, 80.0)
    assert max(j["memory_gib_per_gpu"] for j in plan["jobs"]) > 0.9 * 40.0


def test_plan_shows_startup_and_overheads_in_the_makespan(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = run(["plan", str(PAPER), "--gpus", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    over, totals = plan["overheads"], plan["overheads"]["totals"]
    startup = over["worker_start_s"] + over["model_load_s"]
    assert over["source"] == "default" and startup > 0 and totals["startups"] >= 2
    assert totals["startup_s"] == pytest.approx(sum(j["startup_s"] for j in plan["jobs"]))
    # the makespan includes them: every job's span is its start-up plus its terms
    spans = sum(j["end_s"] - j["start_s"] for j in plan["jobs"])
    parts = ("startup_s", "job_start_s", "train_s", "eval_s", "export_s", "checkpoint_s")
    assert spans == pytest.approx(sum(totals[k] for k in parts), rel=1e-9)
    assert min(j["start_s"] + j["startup_s"] for j in plan["jobs"]) >= startup - 1e-9
    line = next(x for x in result.stdout.splitlines() if "start-up" in x)
    assert all(w in line for w in ("model load", "job start", "eval", "export", "checkpoints"))
    assert plan["baselines"]["tune"]["makespan_s"] >= plan["baselines"]["min_gpu"]["makespan_s"]


def test_tune_row_books_tune_and_peft(tmp_path: Path) -> None:
    """The 'vs tune' row says what it books (Tune + PEFT trials at PEFT's measured step, a
    start-up each) and ``--baseline tune`` accounts its jobs by that cost model: every job's
    span is its start-up plus PEFT's terms."""
    out = tmp_path / "tune.json"
    result = run(["plan", str(PAPER), "--gpus", "2", "--baseline", "tune", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    line = next(x for x in result.stdout.splitlines() if "vs tune:" in x)
    startup = plan["overheads"]["worker_start_s"] + plan["overheads"]["model_load_s"]
    booked = plan["baselines"]["tune"]["booked"]
    assert booked in line and "Tune + PEFT: one trial per config" in booked
    assert "PEFT's measured step (H200 step table)" in booked
    assert f"per-trial start-up {startup:.1f}s" in booked
    assert "plora's engine" in plan["baselines"]["min_gpu"]["booked"]
    assert plan["schedule"] == "tune" and all(j["startup_s"] == startup for j in plan["jobs"])
    totals = plan["overheads"]["totals"]
    spans = sum(j["end_s"] - j["start_s"] for j in plan["jobs"])
    parts = ("startup_s", "job_start_s", "train_s", "eval_s", "export_s", "checkpoint_s")
    assert spans == pytest.approx(sum(totals[k] for k in parts), rel=1e-9)


def test_baseline_output_and_gantt(tmp_path: Path) -> None:
    out, gantt = tmp_path / "min.json", tmp_path / "min.png"
    result = run(
        ["plan", str(PAPER), "--baseline", "min-gpu", "--out", str(out), "--gantt", str(gantt)]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["schedule"] == "min-gpu"
    assert all(len(j["config_ids"]) == 1 for j in plan["jobs"])  # no packing in the baseline
    assert plan["makespan_s"] == pytest.approx(plan["baselines"]["min_gpu"]["makespan_s"])
    assert plan["plora_makespan_s"] <= plan["makespan_s"]
    check_plan(plan, SweepConfig.from_yaml(PAPER), 8, 40.0)
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validate_ok() -> None:
    result = run(["validate", str(REPO / "sweeps" / "quickstart.yaml")])
    assert result.exit_code == 0, result.output
    assert "8 configs" in result.stdout


def test_help_and_plan_import_no_heavy_modules() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from plora.api import load_sweep, make_plan\n"
        "from plora.cli import app\n"
        "assert CliRunner().invoke(app, ['--help']).exit_code == 0\n"
        "heavy = ('torch', 'ray', 'cvxpy', 'matplotlib', 'pandas', 'transformers')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        f"make_plan(load_sweep(__import__('pathlib').Path({str(PAPER)!r})))\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "[]"]


def test_plan_gantt_draws_each_job_on_its_gpus(tmp_path: Path) -> None:
    from matplotlib.patches import Rectangle

    from plora.analysis.plots import plot_plan_gantt
    from plora.cost import Strategy
    from plora.planner import Job, Plan

    def job(i: int, gpus: tuple[int, ...], start: float, end: float) -> Job:
        return Job(job_id=f"j{i}", config_ids=(f"c{i}a", f"c{i}b"), gpus=len(gpus) or 1,
                   strategy=Strategy.TP if len(gpus) > 1 else None, start_s=start, end_s=end,
                   memory_gib_per_gpu=10.0, gpu_ids=gpus)  # fmt: skip

    jobs = (
        job(0, (0, 1), 0, 3600),
        job(1, (2,), 0, 1800),
        job(2, (1, 3), 3600, 7200),
        job(3, (), 1800, 5400),
    )
    plan = Plan(
        jobs=jobs,
        num_configs=8,
        num_gpus=4,
        makespan_s=7200.0,
        lower_bound_s=6000.0,
        ratio_bound=1.2,
    )
    fig = plot_plan_gantt(plan, str(tmp_path / "g.svg"))
    bars = sorted(
        (round(p.get_x(), 6), round(p.get_width(), 6), round(p.get_y() + p.get_height() / 2, 6))
        for p in fig.axes[0].patches if isinstance(p, Rectangle)
    )  # fmt: skip
    # hours (makespan 2 h): one bar per contiguous GPU run, centred on its rows;
    # j3 has no gpu_ids and lands on GPU 2, free from 0.5 h
    assert bars == sorted([(0, 1, 0.5), (0, 0.5, 2), (1, 1, 1), (1, 1, 3), (0.5, 1, 2)])
    assert (tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")


def test_a_baseline_that_cannot_be_built_is_reported_not_fatal(tmp_path: Path) -> None:
    sweep = REPO / "sweeps" / "qwen2.5-0.5b-gpu.yaml"  # no multi-GPU strategy: no max-gpu on 8 GPUs
    out = tmp_path / "p.json"
    result = run(["plan", str(sweep), "--gpus", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert (
        plan["baselines"]["max_gpu"]["makespan_s"] is None
        and plan["baselines"]["max_gpu"]["skipped"]
    )
    assert plan["makespan_s"] <= plan["baselines"]["min_gpu"]["makespan_s"]
    assert "max-gpu: n/a" in result.stdout
    bad = run(
        [
            "plan",
            str(sweep),
            "--gpus",
            "8",
            "--baseline",
            "max-gpu",
            "--out",
            str(tmp_path / "b.json"),
        ]
    )
    assert_one_error_line(bad, "--baseline='max-gpu'", "cannot build this baseline")
    assert not (tmp_path / "b.json").exists()


def test_override_named_in_the_no_fit_error(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = run(["plan", str(PAPER), "--gpus", "1", "--gpu-memory-gib", "16", "--out", str(out)])
    assert_one_error_line(result, str(PAPER), "--gpu-memory-gib=16", "needs", "GiB")
    assert not out.exists()
