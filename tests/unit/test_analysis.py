"""plora.analysis: load a sweep directory, rank, plot, report.

The sweep directory is synthetic but follows the store schema; expected numbers are computed
here by hand or by plain Python, not by the code under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from plora import analysis
from plora.analysis import plots
from plora.config import ConfigError, LoRAConfig

GPUS = 4
#: (job_id, config indices, gpu ids, start, end, status)
JOBS = [
    ("j0", [0, 1, 2, 3], [0, 1], 0.0, 100.0, "finished"),
    ("j1", [4, 5, 6], [2], 0.0, 60.0, "finished"),
    ("j2", [7, 8], [3], 0.0, 80.0, "failed"),
    ("j3", [9, 10, 11], [2, 3], 80.0, 150.0, "finished"),
]


def _objective(lr: float, rank: int) -> float:
    """Known eval loss: best at lr=1e-3, mildly better with rank."""
    return 1.0 + (math.log10(lr) + 3.0) ** 2 - 0.01 * rank


def write_synthetic_sweep(path: Path, *, datetimes: bool = False) -> list[LoRAConfig]:
    """Write a 12-config, 4-job sweep dir with the store schema; return its configs."""
    path.mkdir(parents=True, exist_ok=True)
    lrs, ranks = (1e-4, 3e-4, 1e-3, 3e-3), (8, 16, 32)
    configs = [
        LoRAConfig(rank=r, alpha=2 * r, lr=lr, batch_size=4, max_steps=20, seed=0)
        for lr in lrs
        for r in ranks
    ]
    job_of = {i: job[0] for job in JOBS for i in job[1]}
    failed = {i for job in JOBS if job[5] == "failed" for i in job[1]}
    rows = []
    for i, c in enumerate(configs):
        loss = _objective(c.lr, c.rank)
        rows.append(
            {
                "config_id": c.config_id,
                "hyperparameters": json.dumps(c.hparams()),
                "status": "failed" if i in failed else "finished",
                "final_train_loss": None if i in failed else loss - 0.1,
                "eval_loss": None if i in failed else loss,
                "eval_metric": None if i in failed else 1.0 / loss,
                "steps": 5 if i in failed else 20,
                "tokens": 20 * 4 * 64,
                "gpu_seconds": 10.0 + i,
                "job_id": job_of[i],
                "adapter_path": None if i in failed else f"adapters/{c.config_id}",
            }
        )
    pd.DataFrame(rows).to_parquet(path / "results.parquet")
    metrics = [
        {
            "config_id": c.config_id,
            "step": s,
            "loss": _objective(c.lr, c.rank) + 2.0 / s,
            "lr": c.lr,
            "tokens": s * 256,
            "time": 0.5 * s,
        }
        for c in configs
        for s in range(20, 0, -1)  # written out of order on purpose
    ]
    pd.DataFrame(metrics).to_parquet(path / "metrics.parquet")
    t0 = pd.Timestamp("2026-01-01T00:00:00")
    jobs = pd.DataFrame(
        {
            "job_id": [j[0] for j in JOBS],
            "config_ids": [[configs[i].config_id for i in j[1]] for j in JOBS],
            "gpus": [j[2] for j in JOBS],
            "node": ["node-a"] * len(JOBS),
            "start": [
                t0 + pd.Timedelta(seconds=j[3]) if datetimes else 1000.0 + j[3] for j in JOBS
            ],
            "end": [t0 + pd.Timedelta(seconds=j[4]) if datetimes else 1000.0 + j[4] for j in JOBS],
            "status": [j[5] for j in JOBS],
        }
    )
    jobs.to_parquet(path / "jobs.parquet")
    plan = {
        "num_configs": len(configs),
        "num_gpus": GPUS,
        "makespan_s": 140.0,
        "lower_bound_s": 120.0,
        "ratio_bound": 1.5,
        "jobs": [
            {
                "job_id": j[0],
                "config_ids": [configs[i].config_id for i in j[1]],
                "gpus": len(j[2]),
                "strategy": None,
                "start_s": j[3],
                "end_s": j[4],
                "memory_gib_per_gpu": 10.0,
            }
            for j in JOBS
        ],
    }
    (path / "plan.json").write_text(json.dumps(plan))
    (path / "sweep.yaml").write_text("name: synthetic\nmetric: eval_loss\nmode: min\n")
    return configs


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    write_synthetic_sweep(tmp_path / "sweep")
    return tmp_path / "sweep"


def test_load_flattens_hparams_and_normalizes(sweep_dir: Path) -> None:
    res = analysis.load(sweep_dir)
    assert len(res.results) == 12 and len(res.jobs) == 4 and res.plan["num_gpus"] == GPUS
    assert {"rank", "alpha", "lr", "batch_size", "target_modules"} <= set(res.results.columns)
    assert "hyperparameters" not in res.results.columns
    assert res.results["target_modules"].iloc[0] == "q_proj,v_proj"
    # metrics sorted by (config, step) with every step once
    for _, m in res.metrics.groupby("config_id"):
        assert list(m["step"]) == list(range(1, 21))
    # job times relative to the first start
    assert list(res.jobs["start"]) == [0.0, 0.0, 0.0, 80.0]
    assert list(res.jobs["num_gpus"]) == [2, 1, 1, 2]
    assert res.metric == "eval_loss" and res.mode == "min"
    assert res.decisions.empty


def test_load_datetime_jobs(tmp_path: Path) -> None:
    write_synthetic_sweep(tmp_path, datetimes=True)
    jobs = analysis.load(tmp_path).jobs.set_index("job_id")
    assert jobs.loc["j3", "start"] == pytest.approx(80.0)
    assert jobs.loc["j3", "end"] == pytest.approx(150.0)
    assert jobs.loc["j0", "end"] == pytest.approx(100.0)


def test_best_matches_brute_force(sweep_dir: Path) -> None:
    configs = write_synthetic_sweep(sweep_dir)
    res = analysis.load(sweep_dir)
    failed = {i for j in JOBS if j[5] == "failed" for i in j[1]}
    ok = [(i, c) for i, c in enumerate(configs) if i not in failed]
    expected = sorted(ok, key=lambda ic: _objective(ic[1].lr, ic[1].rank))
    top = res.best(k=3)
    assert list(top["config_id"]) == [c.config_id for _, c in expected[:3]]
    # by hand: lr=1e-3 r=16/32 failed; 3e-3 r32 (1.2276 - 0.32 = 0.9076) beats 1e-3 r8 (0.92)
    assert (top["lr"].iloc[0], top["rank"].iloc[0]) == (3e-3, 32)
    assert (top["lr"].iloc[1], top["rank"].iloc[1]) == (1e-3, 8)
    maxed = analysis.best(res.results, "eval_metric", "max", k=1)
    assert maxed["config_id"].iloc[0] == expected[0][1].config_id
    # failed configs never rank, even with k larger than the finished set
    assert len(res.best(k=100)) == len(ok)


@pytest.mark.parametrize(
    ("metric", "mode", "match"),
    [("accuracy", "max", "not a results column"), ("eval_loss", "low", "mode='low'")],
)
def test_best_bad_input(sweep_dir: Path, metric: str, mode: str, match: str) -> None:
    res = analysis.load(sweep_dir)
    with pytest.raises(ConfigError, match=match):
        analysis.best(res.results, metric, mode)


def test_load_bad_dirs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        analysis.load(tmp_path / "nope")
    with pytest.raises(ConfigError, match="none of"):
        analysis.load(tmp_path)
    (tmp_path / "plan.json").write_text("{oops")
    res = analysis.load(tmp_path)  # a damaged file is reported as missing, not a crash
    assert res.plan == {} and res.missing["plan.json"].startswith("unreadable (JSONDecodeError")
    assert "results.parquet (the per-config results)" in res.missing_note


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] - 1e-9 and b[0] < a[1] - 1e-9


def test_assign_gpu_lanes_given_and_inferred(sweep_dir: Path) -> None:
    jobs = analysis.load(sweep_dir).jobs
    assert plots.assign_gpu_lanes(jobs) == [j[2] for j in JOBS]
    # without GPU ids: lanes are inferred and no GPU runs two overlapping jobs
    counts = jobs.assign(gpus=jobs["num_gpus"], gpu_ids=None)
    lanes = plots.assign_gpu_lanes(counts, num_gpus=GPUS)
    assert [len(x) for x in lanes] == list(jobs["num_gpus"])
    spans = list(zip(jobs["start"], jobs["end"], strict=True))
    for a in range(len(lanes)):
        assert all(0 <= g < GPUS for g in lanes[a])
        for b in range(a):
            if _overlap(spans[a], spans[b]):
                assert not set(lanes[a]) & set(lanes[b]), (a, b, lanes)


def test_gantt_draws_one_bar_per_job_gpu(sweep_dir: Path) -> None:
    jobs = analysis.load(sweep_dir).jobs
    fig = plots.plot_jobs_gantt(jobs)
    bars = [p for p in fig.axes[0].patches if p.get_width() > 0]
    assert len(bars) == sum(len(j[2]) for j in JOBS)
    got = sorted(
        (round(b.get_x(), 6), round(b.get_width(), 6), round(b.get_y() + 0.4)) for b in bars
    )
    want = sorted((j[3], j[4] - j[3], g) for j in JOBS for g in j[2])  # lane row == GPU id here
    assert got == want


def test_loss_curves_and_hp_effects(sweep_dir: Path) -> None:
    res = analysis.load(sweep_dir)
    ids = list(res.results["config_id"][:3])
    fig = plots.plot_loss_curves(res.metrics, config_ids=ids)
    lines = fig.axes[0].get_lines()
    assert len(lines) == 3
    m0 = res.metrics[res.metrics["config_id"] == ids[0]]
    assert list(lines[0].get_xdata()) == list(m0["step"])
    assert list(lines[0].get_ydata()) == pytest.approx(list(m0["loss"]))
    fig = plots.plot_hp_effects(res.results, "eval_loss", mode="min")
    shown = [ax for ax in fig.axes if ax.get_visible()]
    labels = [ax.get_xlabel() for ax in shown]
    # batch_size is constant -> skipped; alpha = 2 * rank -> one panel for both
    assert labels == ["rank & alpha", "lr"]
    assert shown[1].get_xscale() == "log"
    table = plots.best_config_table(res.results, "eval_loss", "min", k=4)
    assert list(table.columns[:4]) == ["config_id", "rank", "alpha", "lr"]
    assert len(table) == 4 and table["eval_loss"].is_monotonic_increasing


def test_summary_by_hand(sweep_dir: Path) -> None:
    facts = analysis.summary(analysis.load(sweep_dir))
    busy = 2 * 100 + 1 * 60 + 1 * 80 + 2 * 70  # GPU-seconds of the four jobs
    assert facts["gpu_seconds"] == pytest.approx(busy)
    assert facts["makespan_s"] == pytest.approx(150.0)
    assert facts["gpu_utilization"] == pytest.approx(busy / (GPUS * 150.0))
    assert (facts["configs"], facts["finished"], facts["failed"], facts["jobs"]) == (12, 10, 2, 4)
    assert facts["planned_lower_bound_s"] == 120.0


def test_report_html_and_markdown(sweep_dir: Path, tmp_path: Path) -> None:
    res = analysis.load(sweep_dir)
    best_id = res.best()["config_id"].iloc[0]
    out = analysis.write_report(sweep_dir)
    text = out.read_text()
    assert out == sweep_dir / "report.html"
    assert best_id in text and text.count("data:image/png;base64,") == 3
    md = analysis.write_report(sweep_dir, tmp_path / "r.md")
    body = md.read_text()
    assert best_id in body and "| config_id |" in body
    for name in ("jobs_gantt", "loss_curves", "hp_effects"):
        png = tmp_path / "r_files" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(r_files/{name}.png)" in body
    with pytest.raises(ConfigError, match=r"use a \.html or \.md"):
        analysis.write_report(sweep_dir, tmp_path / "r.pdf")


def test_markdown_table_escapes() -> None:
    df = pd.DataFrame({"a": ["x|y"], "b": [0.123456789]})
    assert analysis.markdown_table(df) == "| a | b |\n|---|---|\n| x\\|y | 0.1235 |\n"
