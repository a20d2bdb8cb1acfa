"""The two parts of a HF causal LM that the engine runs apart: the decoder body and the LM head.

The training step (:class:`~plora.engine.trainer.PackedTrainer`) and the packed evaluation's
scored rows (:mod:`plora.engine.evaluate_packed`) run the decoder alone -- ``model.<prefix>``,
whose ``last_hidden_state`` is ``(R, S, H)`` after the final norm -- and apply the LM head only
at the target positions (:mod:`plora.engine.loss`), so the ``R × S × V`` logits never exist.

That gives the model's own numbers only where its logits are ``head(h)`` and nothing more.
:func:`plain_head_parts` says where: the model families plora supports
(:data:`plora.model_spec.SUPPORTED_MODEL_TYPES`: Llama, Qwen2, Qwen3, Mistral) compute
``logits = lm_head(hidden_states)``; other families may post-process them (Gemma2's final
logit soft-capping ``c·tanh(z / c)``, Cohere's ``logit_scale``, Granite's ``logits_scaling``),
and a wrapper (a PEFT model, a pipeline stage standing in for the model) has no such parts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plora.model_spec import SUPPORTED_MODEL_TYPES

#: Config fields of HF families that scale or cap the head's logits (checked as well as the
#: model type, in case a supported family grows one).
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(model.<base_model_prefix>, model.get_output_embeddings())`` of a HF causal LM."""
    hf: Any = model  # a transformers PreTrainedModel: its methods are not nn.Module's
    return getattr(hf, hf.base_model_prefix), hf.get_output_embeddings()


def plain_head_parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """:func:`decoder_and_head` where the model's logits are exactly ``head(decoder(...)[0])``
    with ``head`` an ``nn.Linear``; None otherwise (run the whole model for its logits)."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    if not isinstance(model, PreTrainedModel) or not type(model).__name__.endswith("ForCausalLM"):
        return None
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in _LOGIT_POSTPROCESSING):
        return None
    decoder, head = decoder_and_head(model)
    if not isinstance(decoder, nn.Module) or not isinstance(head, nn.Linear):
        return None
    return decoder, head


__all__ = ["decoder_and_head", "plain_head_parts"]
