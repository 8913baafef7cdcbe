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
from slide_hf.spelling import option

__all__ = ["BYTE_VOCAB_SIZE", "byte_tokenizer", "has_tokenizer", "load_tokenizer"]

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


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
"""Any of these makes a directory a tokenizer directory (fast, sentencepiece or BPE vocab+merges)."""


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _TOKENIZER_FILES) or any(directory.glob("*.tiktoken"))


def load_tokenizer(model_dir: Path | None, tokenizer_dir: Path | None = None) -> Any:
    """The tokenizer for a run: ``tokenizer_dir`` when given, else ``model_dir``'s own, else (a preset,
    ``model_dir is None``) the bundled byte tokenizer.

    A model directory without tokenizer files is refused rather than trained with a stand-in: the rows
    would be all EOS, and the model silently learns nothing useful."""
    source = tokenizer_dir if tokenizer_dir is not None else model_dir
    if source is None:
        return byte_tokenizer()
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise UserError(f"{option('tokenizer', tokenizer_dir)} is not a directory")
    if not has_tokenizer(source):
        if tokenizer_dir is not None:
            raise UserError(
                f"{option('tokenizer', tokenizer_dir)} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)})"
            )
        raise UserError(
            f"model directory {model_dir} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
            "pass --tokenizer DIR with the tokenizer it was trained with"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot load a tokenizer from {source}: {first}") from None
