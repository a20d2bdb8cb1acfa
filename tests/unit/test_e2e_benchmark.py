"""``benchmarks/e2e.py``: its eval-loss checks, and ``--smoke``: both of issue 27's cases on
the CPU with every system.

The smoke run trains the built-in tiny-qwen2 for 3 steps on 4 logical GPUs: case L (2 configs)
with ``plora sweep``, Ray Tune trials that are 2-worker Ray Train FSDP2 trainers, and
``device_map="auto"`` trials of 2 GPUs; case M (1 config) with ``plora sweep``, one trial per GPU
and 0.25-GPU trials; each system in its own process with its own cold ``ray.init`` (about 4 to 5
minutes on 2 busy cores).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from e2e_report import compare  # noqa: E402

KEYS = ["lr=0.001,r=8", "lr=0.003,r=8"]
KEYS_L = ["lr=0.001,r=8,bs=2", "lr=0.001,r=8,bs=4"]  # --smoke: case L's batch sizes
KEYS_M = ["lr=0.001,r=8,bs=4"]
BASE = 8.0


def _systems(**losses: list[float | None]) -> dict[str, dict]:
    return {s: {"eval_loss": dict(zip(KEYS, v, strict=True))} for s, v in losses.items()}


@pytest.mark.parametrize(
    ("losses", "ok", "failure"),
    [
        ({"plora": [7.90, 7.50], "tune": [7.92, 7.55]}, True, None),
        # an adapter that did not train (or whose eval saw the base model) stays at the base loss
        ({"plora": [7.90, 7.50], "tune": [BASE, 7.55]}, False, "not_trained"),
        # a system that lost a config
        ({"plora": [7.90, None], "tune": [7.92, 7.55]}, False, "missing"),
        # trains at a fifth of the other's pace (a wrong scale or lr): within rtol, small drop
        ({"plora": [7.90, 7.70], "tune": [7.92, 7.94]}, False, "drop"),
        # trains far more than the other (e.g. alpha applied twice): within rtol, small drop
        ({"plora": [7.90, 7.45], "tune": [7.92, 7.80]}, False, "drop"),
        # both train well, but the losses disagree beyond rtol
        ({"plora": [7.90, 6.50], "tune": [7.92, 6.00]}, False, "rtol"),
    ],
    ids=["agree", "untrained", "missing", "slow-pace", "fast-pace", "disagree"],
)
def test_compare_fails_when_one_system_is_broken(losses, ok, failure):
    got = compare(_systems(**losses), KEYS, BASE, rtol=0.05, min_drop_ratio=0.5)
    assert got["ok"] is ok, got
    if failure == "not_trained":
        assert got["not_trained"] == ["tune:lr=0.001,r=8"]
    elif failure == "missing":
        assert got["missing"] == ["plora:lr=0.003,r=8"]
    elif failure == "drop":
        assert got["worst"]["rel_diff"] <= 0.05, got  # only the drop check catches these
        assert got["worst_drop"]["ratio"] < 0.5 and got["worst_drop"]["config"] == KEYS[1]
    elif failure == "rtol":
        assert got["worst_drop"]["ratio"] >= 0.5, got  # only the agreement check catches this
        assert got["worst"]["rel_diff"] > 0.05 and got["worst"]["pair"] == ["tune", "plora"]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_smoke_runs_both_cases_with_every_system(tmp_path):
    """``e2e.py --smoke``: case L (plora, Ray Train FSDP2 trials of 2 workers, device_map
    trials) and case M (plora, one trial per GPU, 0.25-GPU trials) on 4 logical GPUs."""
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(BENCH / "e2e.py"), "--smoke", "--out", str(out)]
    cmd += ["--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    top = json.loads(out.read_text())
    assert top["smoke"] is True and top["ok"] is True and list(top["cases"]) == ["L", "M"]
    expected = {
        "L": (["plora", "tune-fsdp", "tune-devmap"], KEYS_L),
        "M": (["plora", "tune", "tune-frac"], KEYS_M),
    }
    for case, rep in top["cases"].items():
        names, keys = expected[case]
        for field in ("benchmark", "date", "command", "case", "gpu", "gpu_type", "num_gpus",
                      "software", "model", "data", "training", "configs", "base_eval_loss",
                      "systems", "speedups", "agreement", "markdown"):  # fmt: skip
            assert field in rep, (case, field)
        assert rep["complete"] is True and rep["gpu"] == "cpu" and rep["num_gpus"] == 4
        assert rep["case"] == case and (tmp_path / f"e2e-{case}.json").is_file()
        assert [c["key"] for c in rep["configs"]] == keys
        systems = rep["systems"]
        assert list(systems) == names
        for name, row in systems.items():
            assert row["returncode"] == 0, (case, name)
            assert row["wall_s"] > 0 and row["gpu_busy"] is None  # no nvidia-smi
        plora = systems["plora"]
        assert plora["predicted_makespan_s"] > 0 and plora["measured_makespan_s"] > 0
        assert sum(j["configs"] for j in plora["jobs"]) == len(keys)
        assert all("strategy" in j and j["gpus"] >= 1 for j in plora["jobs"])
        for name in names[1:]:
            assert systems[name]["failed_trials"] == [], (case, name)
            sizes = sorted(t["batch_size"] for t in systems[name]["trials"])
            assert sizes == sorted(int(k.rsplit("bs=", 1)[1]) for k in keys), (case, name)
        assert set(rep["speedups"]) == set(names[1:])
        first = names[1]
        assert rep["speedups"][first] == pytest.approx(systems[first]["wall_s"] / plora["wall_s"])

        # every system finished every config, and trained it: independent of the verdict
        base = rep["base_eval_loss"]
        assert math.isfinite(base)
        losses = {s: [row["eval_loss"][k] for k in keys] for s, row in systems.items()}
        for s, values in losses.items():
            assert all(v is not None and v < base for v in values), (case, s, values, base)
        for s in names[1:]:
            for p, t in zip(losses["plora"], losses[s], strict=True):
                assert abs(p - t) / t < 0.05  # different LoRA A init: loose agreement
                assert 0.5 < (base - p) / (base - t) < 2.0
        assert rep["agreement"]["ok"] and f"| {keys[-1]} |" in rep["markdown"]
    # the same code from the same seed: one whole GPU, a fraction, or the layers over two GPUs
    m = top["cases"]["M"]["systems"]
    assert [m["tune-frac"]["eval_loss"][k] for k in KEYS_M] == pytest.approx(
        [m["tune"]["eval_loss"][k] for k in KEYS_M], rel=1e-4
    )
    # FSDP splits each batch over 2 ranks (a mean of the ranks' means): close, not equal
    lo = top["cases"]["L"]["systems"]
    for k in KEYS_L:
        assert lo["tune-fsdp"]["eval_loss"][k] == pytest.approx(
            lo["tune-devmap"]["eval_loss"][k], rel=1e-2
        )


def test_case_t_draws_one_list_for_both_systems(tmp_path):
    """``--case T`` (issue 31): 48 configs of the 7B shape drawn from Table 1's ranges, 1,024
    tokens, 20 steps, 8 GPUs; plora's sweep file (``search: random``, seeded) expands to the
    configs Tune's grid gets, each with its own alpha and a unique name."""
    import yaml
    from e2e_args import parse_args
    from e2e_setup import sweep_dict, tune_spec

    from plora.config import SweepConfig
    from plora.tune.space import expand

    args = parse_args(["--case", "T", "--out", str(tmp_path / "e2e.json")])
    assert (args.model, args.draw, args.gpus, args.steps, args.tokens + 40) == (
        "Qwen/Qwen2.5-7B",
        48,
        8,
        20,
        1024,
    )
    assert args.systems == ["plora", "tune"] and args.gradient_checkpointing
    data = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    for path in data.values():
        path.write_text('{"prompt": "a", "completion": " b"}\n')
    sweep = sweep_dict(args, Path(args.model), data, [], [], "H100")  # the shipped shape
    assert (sweep["search"], sweep["num_samples"], sweep["seed"]) == ("random", 48, 0)
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    configs = expand(SweepConfig.from_yaml(tmp_path / "sweep.yaml"))
    again = expand(SweepConfig.from_yaml(tmp_path / "sweep.yaml"))
    assert [c.config_id for c in configs] == [c.config_id for c in again]  # seeded
    assert len(configs) == 48
    for c in configs:
        assert 2e-5 <= c.lr <= 4e-4 and 1 <= c.batch_size <= 32 and 8 <= c.rank <= 128
        assert c.rank / 4 <= c.alpha <= 4 * c.rank
    assert len({c.alpha / c.rank for c in configs}) > 1 and len({c.batch_size for c in configs}) > 1
    rows = [{"key": str(i), "lr": c.lr, "rank": c.rank, "batch_size": c.batch_size,
             "alpha": c.alpha} for i, c in enumerate(configs)]  # fmt: skip
    assert tune_spec(sweep, rows)["configs"] == rows


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--draw", "0"], "--draw 0: draw at least 1 config"),
        (["--draw", "4", "--configs", "2"], "--configs keeps a sub-grid"),
        (["--case", "T", "--systems", "plora,tune-fsdp"], "--draw: tune-fsdp splits a batch"),
    ],
)
def test_bad_draw_flags_fail_in_one_line(extra, needle, tmp_path, capsys):
    from e2e_args import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args([*extra, "--out", str(tmp_path / "e2e.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1], err


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_smoke_case_t_drawn_configs_on_eight_logical_gpus(tmp_path):
    """``e2e.py --smoke --case T``: 4 configs drawn from Table 1's ranges (alpha per config),
    plora sweep and one Tune trial per GPU on 8 logical GPUs; both systems train every config
    under the same names, and the losses agree."""
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(BENCH / "e2e.py"), "--smoke", "--case", "T", "--out", str(out)]
    cmd += ["--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    top = json.loads(out.read_text())
    assert top["ok"] is True and list(top["cases"]) == ["T"]
    rep = top["cases"]["T"]
    assert rep["num_gpus"] == 8 and rep["complete"] is True
    assert rep["training"]["draw"]["configs"] == 4 and rep["training"]["alpha_ratio"] is None
    keys = [c["key"] for c in rep["configs"]]
    assert len(keys) == len(set(keys)) == 4
    for c in rep["configs"]:
        assert c["key"].endswith(f",a={c['alpha']:g}")
        assert c["rank"] / 4 <= c["alpha"] <= 4 * c["rank"] and 1 <= c["batch_size"] <= 32
    systems = rep["systems"]
    assert list(systems) == ["plora", "tune"]
    tune = systems["tune"]
    assert tune["failed_trials"] == [] and tune["gpu_per_trial"] == 1.0
    by_key = {t["key"]: t for t in tune["trials"]}
    for c in rep["configs"]:  # Tune trained the very configs plora did, alpha included
        t = by_key[c["key"]]
        assert (t["lr"], t["rank"], t["batch_size"], t["alpha"]) == (
            c["lr"],
            c["rank"],
            c["batch_size"],
            c["alpha"],
        )
    base = rep["base_eval_loss"]
    for s, row in systems.items():
        assert all(row["eval_loss"][k] is not None and row["eval_loss"][k] < base for k in keys), s
    assert sum(j["configs"] for j in systems["plora"]["jobs"]) == 4
    assert rep["agreement"]["ok"] and "drawn (seed 0)" in rep["markdown"]


@pytest.mark.parametrize(("flag", "want"), [([], "auto"), (["--plora-graphs", "off"], "off")])
def test_plora_graphs_goes_into_the_sweep_file_and_the_report(flag, want, tmp_path, monkeypatch):
    """``--plora-graphs`` is plora's ``training.cuda_graphs`` (default auto), and the report
    records it with the environment's ``PLORA_CUDA_GRAPHS``."""
    import yaml
    from e2e_args import parse_args
    from e2e_setup import plora_engine, sweep_dict

    from plora.config import CudaGraphs, SweepConfig

    monkeypatch.delenv("PLORA_CUDA_GRAPHS", raising=False)
    args = parse_args([*flag, "--out", str(tmp_path / "e2e.json")])
    data = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    sweep = sweep_dict(args, Path("tiny-qwen2"), data, [1e-3], [8], "H100")
    assert sweep["training"]["cuda_graphs"] == want
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    parsed = SweepConfig.from_yaml(tmp_path / "sweep.yaml")
    assert parsed.training.cuda_graphs is CudaGraphs(want)
    assert plora_engine(args, parsed)["cuda_graphs"] == {"setting": want, "PLORA_CUDA_GRAPHS": None}


def test_case_s_is_a_16_config_slice_of_table1(tmp_path):
    """``--case S`` (issue 42): 16 configs of the 7B shape, every one a point of
    ``sweeps/paper-table1.yaml``'s grid at batch 1 or 4, named with their alpha; the plora
    systems are plora as planned and one config per job; GSM8K-like rows whose lengths are
    lognormal around 250 tokens and never past 1,024."""
    import statistics

    import yaml
    from e2e_args import PLORA_CAPS, parse_args
    from e2e_setup import gsm8k_rows, sweep_dict, varies_alpha

    from plora.config import SweepConfig
    from plora.tune.space import expand

    args = parse_args(["--case", "S", "--out", str(tmp_path / "e2e.json")])
    assert (args.model, args.gpus, args.steps, args.max_seq_len, args.data) == (
        "Qwen/Qwen2.5-7B", 1, 100, 1024, "gsm8k",
    )  # fmt: skip
    assert args.systems == ["plora", "plora-single", "tune", "tune-frac"]
    assert PLORA_CAPS["plora-single"] == 1 and PLORA_CAPS["plora"] is None
    data = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    sweep = sweep_dict(args, Path(args.model), data, args.lrs, args.ranks, "H200")
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    configs = expand(SweepConfig.from_yaml(tmp_path / "sweep.yaml"))
    table1 = yaml.safe_load((ROOT / "sweeps" / "paper-table1.yaml").read_text())["space"]
    assert len(configs) == 16 and varies_alpha(args)
    assert {(c.lr, c.rank, c.batch_size, c.alpha / c.rank) for c in configs} == {
        (lr, r, b, a) for lr in (1e-4, 2e-4) for r in (8, 32) for b in (1, 4) for a in (0.25, 4.0)
    }
    for c in configs:
        assert c.lr in table1["lr"] and c.rank in table1["rank"]
        assert c.batch_size in table1["batch_size"] and c.alpha / c.rank in table1["alpha_ratio"]
        assert c.dropout == table1["dropout"] and c.schedule == table1["schedule"]
    rows = gsm8k_rows(2000, 250, 1024, seed=1)
    lengths = [len(r["prompt"]) + len(r["completion"]) for r in rows]
    assert 225 <= statistics.median(lengths) <= 275 and max(lengths) <= 1024
    assert sum(n > 500 for n in lengths) > 40  # a tail, as GSM8K has
    assert all(r["completion"].split("#### ")[-1].isdigit() for r in rows)


@pytest.mark.parametrize(
    ("single_s", "planned_single_s", "tune_s", "ok_single", "ok_tune"),
    [
        (400.0, 400.0, 500.0, True, True),  # measured 4x = planned 4x; tune 5x
        (300.0, 400.0, 350.0, False, False),  # measured 3x vs planned 4x; tune 3.5x
        (430.0, 400.0, 400.0, True, True),  # 4.3x vs 4x: within 10 %
    ],
)
def test_targets_compare_measured_and_planned_speedups(
    single_s, planned_single_s, tune_s, ok_single, ok_tune
):
    from e2e_report import targets

    systems = {
        "plora": {"wall_s": 100.0, "measured_makespan_s": 100.0},
        "plora-single": {"wall_s": single_s + 10.0, "measured_makespan_s": single_s},
        "tune": {"wall_s": tune_s},
    }
    plans = {"predicted_makespan_s": {"plora": 100.0, "plora-single": planned_single_s}}
    got = targets(systems, plans)
    single = got["vs_single"]
    assert single["measured"] == pytest.approx(single_s / 100.0)
    assert single["planned"] == pytest.approx(planned_single_s / 100.0)
    assert single["ok"] is ok_single and got["vs_tune"]["ok"] is ok_tune
    assert "vs_tune-frac" not in got and targets({}, plans) == {}
    assert "before the runs" in single["planned_from"]
    # the runs' own first plans, when there are both, are what the measurement is held to
    systems["plora"]["predicted_makespan_s"] = 90.0
    systems["plora-single"]["predicted_makespan_s"] = 270.0
    again = targets(systems, plans)["vs_single"]
    assert again["planned"] == pytest.approx(3.0) and "first plans" in again["planned_from"]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_smoke_case_s_four_ways_on_one_logical_gpu(tmp_path):
    """``e2e.py --smoke --case S``: 2 configs (batch 1 and 4) on GSM8K-like rows, run by plora,
    by plora one config per job, by one Tune trial at a time and by 0.25-GPU trials on one
    logical GPU; the report has each system's planned makespan and the speedup targets."""
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(BENCH / "e2e.py"), "--smoke", "--case", "S", "--out", str(out)]
    cmd += ["--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    top = json.loads(out.read_text())
    assert top["ok"] is True and list(top["cases"]) == ["S"]
    rep = top["cases"]["S"]
    assert rep["num_gpus"] == 1 and rep["complete"] is True and rep["data"]["kind"] == "gsm8k"
    keys = [c["key"] for c in rep["configs"]]
    assert keys == ["lr=0.001,r=8,bs=1", "lr=0.001,r=8,bs=4"]
    systems = rep["systems"]
    assert list(systems) == ["plora", "plora-single", "tune", "tune-frac"]
    assert all(row["returncode"] == 0 for row in systems.values())
    assert [j["configs"] for j in systems["plora-single"]["jobs"]] == [1, 1]
    assert max(j["configs"] for j in systems["plora-single"]["planned_jobs"]) == 1
    planned = rep["plans"]["predicted_makespan_s"]
    assert set(planned) == {"plora", "plora-single", "tune"}
    assert all(v is not None and v > 0 for v in planned.values())
    assert rep["plans"]["files"]["plora-single"]["largest_pack"] == 1
    single = rep["targets"]["vs_single"]
    assert single["measured"] > 0 and single["planned"] > 0
    assert single["planned_from"] == "the first plans of the two runs"
    for name in ("plora", "plora-single"):  # each planned from a profile store of its own
        assert (Path(rep["work_dir"]) / "profiles" / name).is_dir(), name
    assert set(rep["targets"]) == {"vs_single", "vs_tune", "vs_tune-frac"}
    assert "plora vs one config per job" in rep["markdown"]
    base = rep["base_eval_loss"]
    for s, row in systems.items():
        assert all(row["eval_loss"][k] is not None and row["eval_loss"][k] < base for k in keys), s
