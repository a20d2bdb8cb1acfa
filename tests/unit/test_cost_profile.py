"""Profile store round trip and the mLoRA memory fit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from plora.config import ConfigError
from plora.cost import Strategy
from plora.cost.priors import DEFAULT_COEFFICIENTS
from plora.cost.profile import MAX_SAMPLES, Profile, ProfileStore, default_profile_dir, fit_memory
from plora.cost.throughput import AdapterLoad, StepSample


def sample(n: int, d: int = 1, strategy: Strategy | None = None, t: float = 0.1) -> StepSample:
    loads = tuple(
        AdapterLoad(rank=8 * (i + 1), targets=("q_proj", "v_proj"), sequences=1) for i in range(n)
    )
    return StepSample(
        adapters=loads,
        seq_len=256,
        d=d,
        strategy=strategy,
        step_time_s=t,
        peak_memory_bytes=1e9 + n * 1e8,
    )


def test_save_load_round_trip(tmp_path) -> None:
    store = ProfileStore(tmp_path)
    assert store.load("Qwen/Qwen2.5-7B", "H200") == Profile(
        model="Qwen/Qwen2.5-7B", gpu_type="H200"
    )
    prof = Profile(
        model="Qwen/Qwen2.5-7B",
        gpu_type="H200",
        coefficients=DEFAULT_COEFFICIENTS,
        samples=(sample(1), sample(3, d=2, strategy=Strategy.TP)),
        memory_fit=fit_memory([(1, 256, 1e9), (4, 256, 2e9), (2, 512, 2.1e9)]),
    )
    path = store.save(prof)
    assert path.parent == tmp_path and path.suffix == ".json" and "/" not in path.name
    assert store.load("Qwen/Qwen2.5-7B", "H200") == prof
    assert store.load("Qwen/Qwen2.5-7B", "H100").samples == ()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # nothing half-written left over


def test_record_appends_and_select_filters(tmp_path) -> None:
    store = ProfileStore(tmp_path)
    store.record("m", "A10G", [sample(1)])
    prof = store.record(
        "m", "A10G", [sample(2, d=2, strategy=Strategy.FSDP), sample(2, d=2, strategy=Strategy.TP)]
    )
    assert len(prof.samples) == 3 and store.load("m", "A10G") == prof
    assert len(prof.select(1)) == 1 and len(prof.select(2, Strategy.TP)) == 1
    assert len(prof.select()) == 3
    big = prof.add([sample(1)] * (MAX_SAMPLES + 5))
    assert len(big.samples) == MAX_SAMPLES


def test_malformed_profile_is_a_config_error(tmp_path) -> None:
    store = ProfileStore(tmp_path)
    path = store.path("m", "H200")
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="delete it"):
        store.load("m", "H200")
    path.write_text(json.dumps({"format": 99}))
    with pytest.raises(ConfigError, match="malformed"):
        store.load("m", "H200")


def test_default_dir_honours_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PLORA_PROFILE_DIR", str(tmp_path / "p"))
    assert default_profile_dir() == tmp_path / "p"
    assert ProfileStore().root == tmp_path / "p"
    monkeypatch.delenv("PLORA_PROFILE_DIR")
    assert default_profile_dir().parts[-3:] == (".cache", "plora", "profiles")


def test_memory_fit_recovers_the_coefficients() -> None:
    b0, b1, b2 = 15e9, 2.5e5, 40.0
    pts = [(b, s, b0 + b1 * b * s + b2 * b * s * s) for b in (1, 2, 4, 8) for s in (256, 512, 1024)]
    fitted = fit_memory(pts)
    assert (fitted.b0, fitted.b1, fitted.b2) == pytest.approx((b0, b1, b2), rel=1e-6)
    assert fitted.predict(3, 768) == pytest.approx(b0 + b1 * 3 * 768 + b2 * 3 * 768**2, rel=1e-9)
    assert fitted.per_sequence(1024) == pytest.approx(b1 * 1024 + b2 * 1024**2)


def test_memory_fit_with_one_length_and_noise() -> None:
    rng = np.random.default_rng(0)
    pts = [(b, 512, 1e9 + 3e5 * b * 512 + rng.normal(0, 1e6)) for b in range(1, 30)]
    fitted = fit_memory(pts)
    assert fitted.b2 == 0.0 and fitted.b1 == pytest.approx(3e5, rel=0.01)
    with pytest.raises(ConfigError, match="distinct"):
        fit_memory([(2, 512, 1e9), (2, 512, 1.1e9)])
