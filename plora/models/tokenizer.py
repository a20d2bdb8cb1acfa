"""Byte-level tokenizers built locally (no hub access) for the tiny built-in models.

Vocabulary: three specials -- ``<pad>`` = 0, ``<s>`` (bos) = 1, ``</s>`` (eos) = 2 -- then the
256 byte symbols of GPT-2's byte-to-unicode map (ids 3..258), no merges. So one token is one
UTF-8 byte: any text encodes losslessly, nothing is out of vocabulary, and the synthetic tasks
(digits, short words) stay short.

Two flavours, each the tokenizer class that ``AutoTokenizer`` picks for the model type, so a
saved model directory reloads to *the same* tokenizer (transformers 5 rebuilds some classes from
the vocabulary, e.g. every ``qwen2`` directory loads as ``Qwen2Tokenizer``):

* ``"qwen2"`` -- a ``Qwen2Tokenizer`` (Qwen's split regex, NFC, byte level); adds no bos.
* ``"llama"`` -- a plain fast tokenizer (``tokenizers.Tokenizer``: byte level) that, like
  Llama's, prepends ``<s>`` when encoding with special tokens.

Neither appends ``</s>``: the data pipeline adds it after a completion.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS)
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256  # 259
FLAVOURS: tuple[str, ...] = ("qwen2", "llama")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (the ``ByteLevel`` alphabet):
    printable Latin-1 bytes map to themselves, the other 68 to code points 256 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def byte_vocab() -> dict[str, int]:
    """Specials then the 256 byte symbols in byte order."""
    symbols = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[symbols[byte]] = len(vocab)
    return vocab


def build_tokenizer(flavour: str, model_max_length: int = 512) -> PreTrainedTokenizerBase:
    """Build a byte-level tokenizer (deterministic; ``len(tok) == VOCAB_SIZE``).

    Args:
        flavour: ``"qwen2"`` or ``"llama"`` (see the module docstring).
        model_max_length: recorded on the tokenizer (the tiny models' context length).

    Returns:
        A fast tokenizer with ``pad/bos/eos`` set, right padding and no chat template.
    """
    common: dict[str, Any] = dict(
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="right",
        model_max_length=model_max_length,
    )
    if flavour == "qwen2":
        return Qwen2Tokenizer(vocab=byte_vocab(), merges=[], **{"unk_token": None, **common})
    if flavour != "llama":
        raise ValueError(f"unknown tokenizer flavour {flavour!r}; use one of {FLAVOURS}")
    vocab = byte_vocab()
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, **common)


__all__ = [
    "FLAVOURS",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_tokenizer",
    "byte_vocab",
    "bytes_to_unicode",
]
