"""Dimensions, parameter counts and FLOPs of a decoder-only HF model, from its config alone.

No weights are loaded. The planner's cost model needs only shapes: which ``(in, out)`` each of
the seven LoRA-targetable projections has, how many parameters the frozen base holds, and how
many FLOPs a token costs.

FLOP conventions (a multiply-add is 2 FLOPs; ``P_mm`` = :attr:`ModelSpec.matmul_params`, the
weights every token multiplies through, the LM head included even when tied):

* forward, per token: ``2·P_mm + A_fwd(s)`` with the causal attention term
  ``A_fwd(s) = 2·2·(s/2)·(n_heads·head_dim)·L = 2·s·h_attn·L`` (QKᵀ and AV over an average
  context of s/2);
* training with a **frozen** base, per token: ``4·P_mm + 3·A_fwd(s)``. The backward pass needs
  only the gradient w.r.t. the activations (2·P_mm); no weight-gradient GEMM is done for frozen
  weights. Attention has no weights, so its backward is the usual 2x its forward;
* LoRA, per token and targeted projection of shape ``(in, out)``, rank r:
  forward ``2r(in+out)``, backward ``4r(in+out)`` (grad of A, B and of both inputs), total
  ``6r(in+out)``.

Sources accepted by :meth:`ModelSpec.from_hf_config`: a ``transformers.PretrainedConfig``, a
dict, a local ``config.json`` or model directory, a built-in tiny model name (``tiny-qwen2``,
``tiny-llama``), or a model name. Names resolve to a config shipped in
``plora/models/configs/`` first (``Qwen/Qwen2.5-7B`` -> ``Qwen--Qwen2.5-7B.json``; an
``-Instruct`` variant shares its base model's architecture), then a local path, then the HF hub
through ``transformers.AutoConfig`` (which honours ``HF_HUB_OFFLINE`` and the local cache).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plora.config import PROJECTIONS, ConfigError, Strategy

#: Directory of the architecture configs shipped with plora.
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "models" / "configs"

#: Built-in tiny models (built locally by ``plora.models.tiny_config``; their architecture
#: configs are shipped in ``SHIPPED_CONFIGS / "tiny"`` so planning needs no torch).
TINY_MODELS: tuple[str, ...] = ("tiny-qwen2", "tiny-llama")

#: Model types whose decoder layer is q/k/v/o + gate/up/down (SwiGLU) with RMSNorm.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")

_INSTRUCT_SUFFIXES = ("-Instruct", "-instruct", "-Chat", "-chat")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Shapes of a Llama/Qwen2-style decoder-only causal LM.

    Projection shapes are ``(in_features, out_features)`` of the ``nn.Linear`` (the weight is
    ``(out, in)``): q ``(h, n_heads·d_head)``, k and v ``(h, n_kv·d_head)``, o
    ``(n_heads·d_head, h)``, gate and up ``(h, i)``, down ``(i, h)``.
    """

    name: str
    """Where the spec came from (model id, path or ``<dict>``)."""
    model_type: str
    """HF ``model_type`` (llama, qwen2, ...)."""
    hidden_size: int
    """h: width of the residual stream."""
    intermediate_size: int
    """i: width of the SwiGLU MLP."""
    num_layers: int
    """L: decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA)."""
    head_dim: int
    """Width of one head."""
    vocab_size: int
    """V: rows of the embedding and of the LM head."""
    tie_word_embeddings: bool
    """Whether the LM head shares the embedding matrix."""
    attention_bias: bool = False
    """Whether q/k/v carry a bias (True for Qwen2)."""
    o_bias: bool = False
    """Whether o_proj carries a bias."""
    mlp_bias: bool = False
    """Whether gate/up/down carry a bias."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen3): 2·head_dim extra parameters per layer."""

    def __post_init__(self) -> None:
        for field in ("hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, field) < 1:
                raise ConfigError(f"model {self.name}: {field}={getattr(self, field)} must be >= 1")
        for field in ("num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, field) < 1:
                raise ConfigError(f"model {self.name}: {field}={getattr(self, field)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model {self.name}: num_attention_heads={self.num_heads} is not a multiple "
                f"of num_key_value_heads={self.num_kv_heads}"
            )

    # ----------------------------------------------------------------- shapes
    @property
    def q_dim(self) -> int:
        """Output width of q_proj: n_heads·head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Output width of k_proj and v_proj: n_kv·head_dim."""
        return self.num_kv_heads * self.head_dim

    def projection_shape(self, name: str) -> tuple[int, int]:
        """``(in, out)`` of projection ``name`` (one of :data:`plora.config.PROJECTIONS`)."""
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        try:
            return shapes[name]
        except KeyError:
            raise ConfigError(
                f"unknown projection {name!r}; choose from {', '.join(PROJECTIONS)}"
            ) from None

    @property
    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """All seven ``name -> (in, out)`` in layer order."""
        return {p: self.projection_shape(p) for p in PROJECTIONS}

    def has_bias(self, name: str) -> bool:
        """Whether projection ``name`` carries a bias."""
        if name in ("q_proj", "k_proj", "v_proj"):
            return self.attention_bias
        if name == "o_proj":
            return self.o_bias
        return self.mlp_bias

    def parallel_problem(self, strategy: Strategy | str, d: int) -> str | None:
        """Why :mod:`plora.parallel` cannot run this model with ``strategy`` on ``d`` GPUs, or
        None when it can. The one rule, asked by the cost model (a degree the model cannot take
        never fits, so the planner never picks it), by the sweep checks (one-line errors) and
        by ``apply_tp`` itself:

        * ``tp`` splits whole heads and MLP features ``d`` ways (``apply_tp``: q/k/v/gate/up
          on their outputs, o/down on their inputs; KV heads are split, never replicated), so
          ``d`` divides ``num_attention_heads``, ``num_key_value_heads`` and
          ``intermediate_size``;
        * ``pp`` gives every stage at least one decoder layer (``plora.parallel.pp``'s
          ``stage_layers``): ``d <= num_hidden_layers``;
        * ``fsdp`` shards any model.

        The text reads as ``apply_tp``'s error, e.g. ``num_key_value_heads=2 is not divisible
        by tp=4``.
        """
        if d <= 1:
            return None
        strategy = Strategy(strategy)
        if strategy is Strategy.TP:
            for attr, n in (
                ("num_attention_heads", self.num_heads),
                ("num_key_value_heads", self.num_kv_heads),
                ("intermediate_size", self.intermediate_size),
            ):
                if n % d:
                    return f"{attr}={n} is not divisible by tp={d}"
        elif strategy is Strategy.PP and d > self.num_layers:
            return f"num_hidden_layers={self.num_layers} is fewer than pp={d} stages"
        return None

    # ------------------------------------------------------------ parameters
    def projection_params(self, name: str) -> int:
        """Parameters of one projection in one layer: ``in·out`` (+ ``out`` with a bias)."""
        fan_in, fan_out = self.projection_shape(name)
        return fan_in * fan_out + (fan_out if self.has_bias(name) else 0)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: 7 projections, 2 RMSNorms (+ q/k norms)."""
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return sum(self.projection_params(p) for p in PROJECTIONS) + norms

    @property
    def embedding_params(self) -> int:
        """Input embedding: V·h."""
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Untied LM head: V·h (0 when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """All parameters as ``model.parameters()`` counts them (tied weights once)."""
        final_norm = self.hidden_size
        return (
            self.num_layers * self.layer_params
            + self.embedding_params
            + self.lm_head_params
            + final_norm
        )

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies through: L·Σ in·out + V·h (LM head, tied or not)."""
        per_layer = sum(a * b for a, b in self.projection_shapes.values())
        return self.num_layers * per_layer + self.vocab_size * self.hidden_size

    def lora_params(self, rank: int, targets: tuple[str, ...] | list[str]) -> int:
        """Trainable LoRA parameters: ``L · Σ_targets r·(in + out)``."""
        return self.num_layers * rank * sum(sum(self.projection_shape(t)) for t in targets)

    # ----------------------------------------------------------------- FLOPs
    def attention_flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Forward QKᵀ + AV FLOPs per token, all layers: ``4·s·h_attn·L`` (x1/2 if causal)."""
        flops = 4.0 * seq_len * self.q_dim * self.num_layers
        return flops / 2 if causal else flops

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token: ``2·P_mm + A_fwd(s)``."""
        return 2.0 * self.matmul_params + self.attention_flops_per_token(seq_len)

    def train_flops_per_token(self, seq_len: int) -> float:
        """Frozen-base fwd+bwd FLOPs per token: ``4·P_mm + 3·A_fwd(s)`` (no weight grads)."""
        return 4.0 * self.matmul_params + 3.0 * self.attention_flops_per_token(seq_len)

    def lora_flops_per_token(self, rank: int, targets: tuple[str, ...] | list[str]) -> float:
        """LoRA fwd+bwd FLOPs per token: ``6·r·Σ_targets (in+out)·L``."""
        return 6.0 * self.lora_params(rank, targets)

    def flop_ceiling_tokens_per_s(self, peak_flops: float, seq_len: int) -> float:
        """Tokens/s at ``peak_flops`` FLOP/s with a frozen base: peak / (4·P_mm + 6·s·h·L)."""
        return peak_flops / self.train_flops_per_token(seq_len)

    # ---------------------------------------------------------- construction
    @classmethod
    def from_hf_config(cls, source: Any, *, where: str = "model.name_or_path") -> ModelSpec:
        """Build from a ``PretrainedConfig``, a dict, a path or a model name (see module doc).

        Raises:
            ConfigError: the source cannot be resolved, or the architecture is unsupported.
        """
        name, cfg = _resolve(source, where=where)
        return cls.from_dict(cfg, name=name, where=where)

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], *, name: str = "<dict>", where: str = "model"
    ) -> ModelSpec:
        """Build from a plain HF config dict."""
        if isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg:
            cfg = cfg["text_config"]
        model_type = str(cfg.get("model_type", ""))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{where}: model {name!r} has model_type={model_type or None!r}; plora supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (q/k/v/o + gate/up/down decoders)"
            )
        missing = [
            k
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if cfg.get(k) is None
        ]
        if "vocab_size" not in cfg:
            missing.append("vocab_size")
        if missing:
            raise ConfigError(f"{where}: config of {name!r} lacks {', '.join(missing)}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        return cls(
            name=name,
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )


def shipped_config_path(name: str) -> Path | None:
    """The shipped architecture config for a model id, or None.

    ``Qwen/Qwen2.5-7B`` -> ``configs/Qwen--Qwen2.5-7B.json``; ``...-Instruct`` falls back to
    the base model's file (same architecture).
    """
    stem = name.strip().replace("/", "--")
    candidates = [stem]
    for suffix in _INSTRUCT_SUFFIXES:
        if stem.endswith(suffix):
            candidates.append(stem[: -len(suffix)])
    for cand in candidates:
        path = SHIPPED_CONFIGS / f"{cand}.json"
        if path.is_file():
            return path
    return None


def shipped_models() -> list[str]:
    """Model ids with a shipped architecture config."""
    return sorted(p.stem.replace("--", "/") for p in SHIPPED_CONFIGS.glob("*.json"))


def _read_json(path: Path, *, where: str) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{where}: cannot read model config {path}: {err}") from None


def _resolve(source: Any, *, where: str) -> tuple[str, dict[str, Any]]:
    """Return ``(name, config dict)`` for any accepted source (see module doc)."""
    if isinstance(source, dict):
        return str(source.get("_name_or_path") or "<dict>"), source
    if hasattr(source, "to_dict") and not isinstance(source, (str, os.PathLike)):
        cfg = source.to_dict()
        return str(
            cfg.get("_name_or_path") or getattr(source, "name_or_path", "") or "<config>"
        ), cfg
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"{where}: {source!r} is not a model name, path, dict or PretrainedConfig"
        )
    name = os.fspath(source)
    if name in TINY_MODELS:  # ``plora.models.tiny_config(name).to_dict()``, kept in sync by a test
        return name, _read_json(SHIPPED_CONFIGS / "tiny" / f"{name}.json", where=where)
    shipped = shipped_config_path(name)
    if shipped is not None:
        return name, _read_json(shipped, where=where)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{where}: directory {name!r} has no config.json; point at a HF model dir"
            )
        return name, _read_json(path / "config.json", where=where)
    if path.is_file():
        return name, _read_json(path, where=where)
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(name)
    except Exception as err:  # network, auth, unknown id: all the same to the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"{where}: cannot resolve model {name!r}: not shipped ({', '.join(shipped_models())}), "
            f"not a local path, and the HF hub gave: {first[:200]}"
        ) from None
    return name, cfg.to_dict()


__all__ = [
    "SHIPPED_CONFIGS",
    "SUPPORTED_MODEL_TYPES",
    "TINY_MODELS",
    "ModelSpec",
    "shipped_config_path",
    "shipped_models",
]
