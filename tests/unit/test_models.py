"""Built-in tiny models and tokenizers: shapes, determinism, save/reload, PEFT round trip."""

from __future__ import annotations

import os
import random
import unicodedata
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from plora.config import ConfigError, DatasetSpec, ModelRef
from plora.engine.data import load_dataset
from plora.engine.evaluate import eval_loss
from plora.models import BUILTIN_MODELS, load_model, save_base_model, tiny_config
from plora.models import tiny as tiny_mod
from plora.models.tokenizer import VOCAB_SIZE, build_tokenizer

TEXTS = [
    "12+7=19",
    "review: good  bad\nsentiment: pos",
    "  leading and trailing  ",
    "tabs\tand\r\nCRLF",
    "héllo wörld — ünïcode ✓ 日本",
    "I've <s> not </s> special",
    "",
]


@pytest.fixture(scope="module", params=BUILTIN_MODELS)
def tiny(request):
    model, tok = load_model(request.param)
    return request.param, model, tok


def _expected_params(cfg) -> int:
    """Parameter count of a Llama/Qwen2 decoder from its config (independent formula)."""
    h, i, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    hd = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd
    attn = h * h + 2 * h * kv + h * h
    if cfg.model_type == "qwen2":
        attn += h + 2 * kv  # q, k, v biases
    per_layer = attn + 3 * h * i + 2 * h
    head = 0 if cfg.tie_word_embeddings else v * h
    return v * h + n * per_layer + h + head


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_tiny_config_shapes(name):
    cfg = tiny_config(name)
    assert cfg.model_type == name.removeprefix("tiny-")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert (cfg.num_key_value_heads, cfg.intermediate_size) == (2, 128)
    assert cfg.vocab_size == VOCAB_SIZE


def test_tiny_config_unknown_name():
    with pytest.raises(ConfigError, match=r"tiny-gpt.*choose one of tiny-qwen2, tiny-llama"):
        tiny_config("tiny-gpt")


def test_load_model_builtin(tiny):
    _, model, tok = tiny
    assert not model.training and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == _expected_params(model.config)
    assert len(tok) == model.config.vocab_size == VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok(["1+1=", "22+3="], padding=True, return_tensors="pt")
    logits = model(**ids).logits
    assert logits.shape == (2, ids["input_ids"].shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_load_model_accepts_model_ref_and_dtype():
    model, _ = load_model(ModelRef(name_or_path="tiny-llama", dtype="bf16"))
    assert model.dtype == torch.bfloat16
    model, _ = load_model("tiny-llama", dtype=torch.float16)
    assert model.dtype == torch.float16


@pytest.mark.parametrize("flavour", ["qwen2", "llama"])
def test_tokenizer_is_lossless_byte_level(flavour):
    tok = build_tokenizer(flavour)
    rng = random.Random(0)
    randoms = ["".join(chr(rng.randrange(32, 0x3000)) for _ in range(20)) for _ in range(20)]
    # NFC text: the qwen2 flavour NFC-normalizes like Qwen's tokenizer does.
    samples = TEXTS + [unicodedata.normalize("NFC", t) for t in randoms]
    for text in samples:
        if "<s>" in text:
            continue  # special-token strings in text map to the special id (HF default)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text.encode()), text  # one token per UTF-8 byte
        assert tok.decode(ids) == text
    assert tok("x<s>y</s>", add_special_tokens=False)["input_ids"] == [
        *tok("x")["input_ids"][-1:],
        1,
        *tok("y")["input_ids"][-1:],
        2,
    ]
    with_special = tok("ab")["input_ids"]
    assert (
        with_special
        == ([1] if flavour == "llama" else []) + tok("ab", add_special_tokens=False)["input_ids"]
    )


def test_save_base_model_reloads_bit_identically(tiny, tmp_path):
    name, model, tok = tiny
    out = save_base_model(name, tmp_path / "base")
    model2 = AutoModelForCausalLM.from_pretrained(out)
    tok2 = AutoTokenizer.from_pretrained(out)
    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert sd1.keys() == sd2.keys()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert type(tok2) is type(tok)
    for text in TEXTS:
        assert tok2(text)["input_ids"] == tok(text)["input_ids"], text
    # And load_model of the saved directory gives the same model.
    model3, _ = load_model(str(out))
    assert all(torch.equal(t, model3.state_dict()[k]) for k, t in sd1.items())


def test_save_base_model_of_a_local_dir(tmp_path):
    first = save_base_model("tiny-qwen2", tmp_path / "a")
    second = save_base_model(str(first), tmp_path / "b")
    m1 = AutoModelForCausalLM.from_pretrained(first)
    m2 = AutoModelForCausalLM.from_pretrained(second)
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in m1.state_dict().items())


def test_peft_adapter_round_trip_on_saved_base(tmp_path):
    base_dir = save_base_model("tiny-qwen2", tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(0)
    peft = get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            init_lora_weights=False,
        ),
    )
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    expected = peft(input_ids=ids).logits
    peft.save_pretrained(tmp_path / "adapter")
    fresh = AutoModelForCausalLM.from_pretrained(base_dir)
    base_logits = fresh(input_ids=ids).logits
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    got = reloaded(input_ids=ids).logits
    assert torch.equal(got, expected)
    assert not torch.allclose(base_logits, expected)  # the adapter does change the output


def test_build_is_deterministic_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_mod, "PRETRAIN_STEPS", 3)
    monkeypatch.setenv("PLORA_CACHE_DIR", str(tmp_path / "c1"))
    d1 = tiny_mod.tiny_model_dir("tiny-llama")
    monkeypatch.setenv("PLORA_CACHE_DIR", str(tmp_path / "c2"))
    d2 = tiny_mod.tiny_model_dir("tiny-llama")
    m1 = AutoModelForCausalLM.from_pretrained(d1)
    m2 = AutoModelForCausalLM.from_pretrained(d2)
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in m1.state_dict().items())
    # A second request is a cache hit: no rebuild.
    monkeypatch.setattr(tiny_mod, "_pretrained_model", lambda *a: pytest.fail("rebuilt"))
    assert tiny_mod.tiny_model_dir("tiny-llama") == d2
    # The recipe is part of the key: other steps, other directory.
    monkeypatch.setattr(tiny_mod, "PRETRAIN_STEPS", 4)
    with pytest.raises(pytest.fail.Exception, match="rebuilt"):
        tiny_mod.tiny_model_dir("tiny-llama")


def test_concurrent_builders_build_once(tmp_path, monkeypatch):
    """Two processes (here threads) asking for an unbuilt model: one pretrains, the other waits
    for its directory instead of pretraining beside it; both say how long that took them (a
    worker's one-time build is kept out of its start-up), and a cached model takes no time."""
    import threading
    import time

    monkeypatch.setattr(tiny_mod, "PRETRAIN_STEPS", 3)
    monkeypatch.setenv("PLORA_CACHE_DIR", str(tmp_path))
    build, builds = tiny_mod._pretrained_model, []
    complete, missing = tiny_mod._complete, set()
    both_arrived = threading.Event()

    def seen_complete(path):
        done = complete(path)
        if not done:  # a caller that found no model: it builds, or waits for the builder
            missing.add(threading.get_ident())
            if len(missing) == 2:
                both_arrived.set()
        return done

    def slow_build(*args):
        builds.append(threading.get_ident())
        # the other caller has found no model either (it waits on the lock), however late
        # its thread started on a busy machine; then it waits the 0.5 s this build takes
        assert both_arrived.wait(timeout=120)
        time.sleep(0.5)
        return build(*args)

    monkeypatch.setattr(tiny_mod, "_complete", seen_complete)
    monkeypatch.setattr(tiny_mod, "_pretrained_model", slow_build)
    spent: list[float] = []
    before = tiny_mod.build_seconds()
    threads = [
        threading.Thread(target=lambda: spent.append(tiny_mod.ensure_tiny_model("tiny-llama")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(spent) == 2 and min(spent) > 0.3
    assert tiny_mod.build_seconds() - before == pytest.approx(sum(spent))  # what a worker reads
    path = tiny_mod.tiny_model_dir("tiny-llama")
    assert (path / "config.json").is_file() and tiny_mod.ensure_tiny_model("tiny-llama") == 0.0
    built = [p.name for p in (tmp_path / "tiny").iterdir() if not p.name.endswith(".lock")]
    assert built == [path.name]


def test_an_incomplete_cache_entry_is_built_again(tmp_path, monkeypatch, caplog):
    """A directory at the entry's path that was not published whole (here: tokenizer files
    only, as a two-GPU machine was left with) is set aside and built again: never loaded, never
    a dead end for every later load on that machine."""
    monkeypatch.setattr(tiny_mod, "PRETRAIN_STEPS", 3)
    monkeypatch.setenv("PLORA_CACHE_DIR", str(tmp_path))
    path = tiny_mod._model_dir("tiny-qwen2")
    path.mkdir(parents=True)
    build_tokenizer("qwen2", 16).save_pretrained(path)
    with caplog.at_level("WARNING", logger=tiny_mod.__name__):
        model, _ = load_model("tiny-qwen2")
    assert "is incomplete" in caplog.text and "tokenizer" in caplog.text
    assert (path / "config.json").is_file() and (path / tiny_mod.COMPLETE_MARKER).is_file()
    assert sum(p.numel() for p in model.parameters()) > 0
    left = [p.name for p in (tmp_path / "tiny").iterdir() if not p.name.endswith(".lock")]
    assert left == [path.name]  # nothing set aside stays behind


def test_a_builder_killed_mid_build_leaves_no_entry(tmp_path):
    """A builder killed while it pretrains (SIGKILL: no ``finally``) publishes nothing and
    releases the lock with its process; the next caller builds a whole entry."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PLORA_CACHE_DIR": str(tmp_path)}
    hang = (
        "import time, plora.models.tiny as t\n"
        "t.PRETRAIN_STEPS = 2\n"
        "t._pretrain = lambda model, tok, name: (print('building', flush=True), time.sleep(600))\n"
        "t.ensure_tiny_model('tiny-llama')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", hang], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "building"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    fast = (
        "import plora.models.tiny as t; t.PRETRAIN_STEPS = 2; print(t.tiny_model_dir('tiny-llama'))"
    )
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", fast],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    path = Path(out.stdout.strip().splitlines()[-1])
    assert (path / "config.json").is_file() and (path / tiny_mod.COMPLETE_MARKER).is_file()
    assert time.perf_counter() - t0 < 240  # the lock died with its holder


def test_pretrained_base_beats_random_init():
    model, tok = load_model("tiny-qwen2")
    ds = load_dataset(DatasetSpec(builtin="arithmetic", num_examples=100), tok)
    torch.manual_seed(0)
    random_model = AutoModelForCausalLM.from_config(tiny_config("tiny-qwen2"))
    pretrained = eval_loss(model, ds.eval, pad_id=tok.pad_token_id)
    scratch = eval_loss(random_model.eval(), ds.eval, pad_id=tok.pad_token_id)
    assert scratch > 5.0  # ~ln(259): uniform over the vocabulary
    assert pretrained < 1.5


def test_load_model_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_model(str(tmp_path / "empty"))
    with pytest.raises(
        ConfigError, match=r"model.name_or_path='no-such-org/no-such-model': cannot load"
    ):
        load_model("no-such-org/no-such-model")
    with pytest.raises(ConfigError, match="unknown dtype"):
        load_model(_Ref("tiny-qwen2", "int3"))


class _Ref:
    def __init__(self, name_or_path, dtype):
        self.name_or_path, self.dtype = name_or_path, dtype


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_shipped_tiny_configs_match_the_built_models(name: str) -> None:
    """``plora.model_spec`` plans tiny models from shipped JSON (no torch): it must be theirs."""
    import json

    from plora.model_spec import SHIPPED_CONFIGS

    shipped = json.loads((SHIPPED_CONFIGS / "tiny" / f"{name}.json").read_text())
    built = json.loads(json.dumps(tiny_config(name).to_dict(), default=str))
    built.pop("transformers_version", None)
    assert shipped == built
