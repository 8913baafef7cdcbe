"""Tokenizers: the model directory's own, or a bundled byte-level one for presets.

Presets carry no tokenizer, and this project cannot download one. A byte-level tokenizer (256 byte tokens
plus BOS, EOS and PAD) encodes any text losslessly, needs no training, and is small enough that the
``tiny-llama`` demo learns visibly in a minute. It is saved next to exported models, so an exported
preset run loads back with ``AutoTokenizer`` like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slide_hf.errors import UserError

__all__ = ["BYTE_VOCAB_SIZE", "byte_tokenizer", "load_tokenizer"]

_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
BYTE_VOCAB_SIZE = 256 + len(_SPECIALS)

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def byte_tokenizer() -> Any:
    """A fast HF tokenizer over raw UTF-8 bytes, with a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    for offset, special in enumerate(_SPECIALS):
        vocab[special] = 256 + offset
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=_SPECIALS[0], eos_token=_SPECIALS[1], pad_token=_SPECIALS[2]
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(model_dir: Path | None) -> Any:
    """The tokenizer of ``model_dir``, or the bundled byte tokenizer for presets (``None``)."""
    if model_dir is None:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load a tokenizer from {model_dir}: {str(error).splitlines()[0]}") from error
