"""Preference pairs at their edges: a side that keeps no trained token after the cut, two sides that are the
same only once rendered (or cut), a null field, and what `slide data` says about pairs it did not show.

Each was accepted and silently mis-trained (or misreported) before: a pair whose rejected sequence trained
nothing counted with ``logps/rejected`` 0, a pair the chat template made identical trained a zero gradient
while counting in the step's mean."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_data_tokenizer import QWEN3, chat_tokenizer

from slide_hf.data import IGNORE, DataOptions
from slide_hf.data.preference import PairEncoder, load_pairs, parse_pair, preview_pairs
from slide_hf.data.readers import Record
from slide_hf.errors import UserError
from slide_hf.preference import head as head_module
from slide_hf.preference.head import PreferenceHead
from slide_hf.preference.losses import PairLoss
from slide_hf.preference.tags import PAIR_TAG_SHIFT

SEQ = 256
USER = [{"role": "user", "content": "What is 2+2?"}]
SYSTEM = {"role": "system", "content": "x"}


def _write(path: Path, *records: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def _reply(content: str, *, system_first: bool = False) -> list[dict[str, str]]:
    return [*([SYSTEM] if system_first else []), {"role": "assistant", "content": content}]


def _one_line_refusal(status: int, err: str, expected: str) -> None:
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert status == 2, err
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in err, err


@pytest.fixture
def tokenizer() -> Any:
    return chat_tokenizer(QWEN3)


# -- a side that keeps no trained token ------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["chosen", "rejected"])
def test_a_side_whose_reply_starts_past_the_limit_is_refused(side: str, tmp_path: Path, tokenizer: Any) -> None:
    """A system turn inside one completion pushes that side's reply past ``seq_len / 2`` while the other's
    fits: the pair is refused naming the side, never emitted with one side training nothing."""
    record = {"prompt": USER, "chosen": _reply("4"), "rejected": _reply("5")}
    record[side] = _reply(record[side][0]["content"], system_first=True)
    data = _write(tmp_path / "pairs.jsonl", record)
    (wide,) = preview_pairs(data, tokenizer, DataOptions(seq_len=SEQ), 1)
    sides = zip(("chosen", "rejected"), wide.sequences(), strict=True)
    starts = {name: int(np.argmax(labels != IGNORE)) for name, (_, labels) in sides}
    other = "rejected" if side == "chosen" else "chosen"
    assert starts[other] < starts[side]
    seq_len = 2 * starts[side]  # the other side's reply fits, this side's starts at the limit
    with pytest.raises(UserError) as error:
        load_pairs(data, tokenizer, DataOptions(seq_len=seq_len))
    message = str(error.value)
    assert f"'{side}' keeps no token to train" in message and "pairs.jsonl:1" in message and "\n" not in message


def test_the_cli_refuses_a_rejected_side_that_keeps_nothing(tmp_path: Path, slide: Any) -> None:
    """The tester's reproduction: `slide data` showed "rejected (45 tokens, 0 trained)" and `slide train`
    ran with ``logps/rejected`` 0.0; both now refuse in one line."""
    record = {"prompt": USER, "chosen": _reply("4"), "rejected": _reply("5", system_first=True)}
    data = _write(tmp_path / "rej_zero.jsonl", record)
    common = ["--model", "tiny-llama", "--data", data, "--seq-len", 90, "--objective", "dpo"]
    for argv in (
        ["data", *common],
        ["train", *common, "--device", "cpu", "--batch-size", 1, "--steps", 1, "--output", tmp_path / "run"],
    ):
        status, _out, err = slide(*argv)
        _one_line_refusal(status, err, "rej_zero.jsonl:1: 'rejected' keeps no token to train")


class _WordTokenizer:
    """A template-free tokenizer of lower-cased words, no BOS and no EOS: the plain path at its limits
    (a prompt of no token, two strings that tokenize alike)."""

    chat_template = None
    eos_token_id = None
    pad_token_id = 0

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [self.vocab.setdefault(word, len(self.vocab) + 1) for word in text.lower().split()]}


def test_a_side_trained_only_at_its_first_token_is_refused() -> None:
    """The first token of a sequence is predicted by nothing in its row, so its label is dropped: a one-word
    completion after an empty prompt (no BOS, no EOS) would keep nothing to train."""
    encoder = PairEncoder(_WordTokenizer(), DataOptions(seq_len=SEQ))
    pair = parse_pair(Record("pairs.jsonl:1", {"prompt": "", "chosen": "four", "rejected": "five, perhaps"}))
    with pytest.raises(UserError, match=r"pairs\.jsonl:1: 'chosen' keeps no token to train"):
        encoder.encode(pair)


# -- the head counts a pair only with both sides -----------------------------------------------------------------


def _labels(sides: list[tuple[int, int]], tokens: torch.Tensor) -> torch.Tensor:
    """Tagged shift-labels of 24 tokens: completion ``number`` on positions ``[start, start + 3)``."""
    completion = torch.full((tokens.numel(),), -1)
    for number, start in sides:
        completion[start : start + 3] = number
    return torch.where(completion >= 0, tokens | ((completion + 1) << PAIR_TAG_SHIFT), -100).unsqueeze(0)


@pytest.mark.parametrize("alone", [2, 3], ids=["chosen alone", "rejected alone"])
@pytest.mark.parametrize("name", ["dpo", "simpo"])
def test_the_head_counts_a_pair_only_with_both_completions(name: str, alone: int, torch_kernels: None) -> None:
    """Pair 1 with one completion in the micro-batch adds no loss, no gradient and no metric: the values are
    those of the micro-batch without it."""
    loss = PairLoss("dpo", 0.3) if name == "dpo" else PairLoss("simpo", 2.0, gamma=0.4)
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(1, 24, 16, generator=g), torch.randn(37, 16, generator=g) / 2
    tokens = torch.randint(0, 37, (24,), generator=g)
    results = []
    for sides in ([(0, 1), (1, 6), (alone, 12)], [(0, 1), (1, 6)]):
        head = PreferenceHead(loss, 2)
        head.use_reference(torch.randn(4, generator=torch.Generator().manual_seed(1)) - 20, torch.device("cpu"))
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        value = head.loss_sum(h, w, _labels(sides, tokens), softcap=None)
        value.backward()
        results.append((value.detach(), h.grad, w.grad, head.take_metric_sums()))
    (value, grad_h, grad_w, sums), (value_1, grad_h_1, grad_w_1, sums_1) = results
    assert float(sums[0]) == 1.0  # one pair present
    torch.testing.assert_close(value, value_1)
    torch.testing.assert_close(grad_h, grad_h_1)
    torch.testing.assert_close(grad_w, grad_w_1)
    torch.testing.assert_close(sums, sums_1)


def test_the_head_still_counts_pairs_with_both_completions(torch_kernels: None) -> None:
    head = PreferenceHead(PairLoss("simpo", 2.0, gamma=0.4), 2)
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(1, 24, 16, generator=g), torch.randn(37, 16, generator=g)
    labels = _labels([(0, 1), (1, 6), (2, 12), (3, 18)], torch.randint(0, 37, (24,), generator=g))
    with torch.no_grad():
        head.loss_sum(hidden, weight, labels, softcap=None)
    assert float(head.take_metric_sums()[0]) == 2.0
    assert head_module.metric_means(head.take_metric_sums()) == {}


# -- the same once rendered, or once cut -------------------------------------------------------------------------


THINK = {"prompt": "What is 2+2?", "chosen": "<think>\n\n</think>\n\n4.", "rejected": "4."}


def test_a_pair_the_chat_template_makes_identical_is_refused(tmp_path: Path, tokenizer: Any) -> None:
    """Qwen3's template renders an empty think block for a reply without one: the two sides are one text."""
    data = _write(tmp_path / "pairs.jsonl", THINK)
    with pytest.raises(UserError) as error:
        load_pairs(data, tokenizer, DataOptions(seq_len=SEQ, chat_template="qwen3"))
    message = str(error.value)
    assert "pairs.jsonl:1: 'chosen' and 'rejected' are the same once rendered by the chat template" in message
    assert "\n" not in message


def test_slide_data_refuses_a_pair_the_chat_template_makes_identical(tmp_path: Path, slide: Any) -> None:
    data = _write(tmp_path / "f.jsonl", THINK)
    argv = ["data", "--model", "tiny-llama", "--data", data, "--objective", "dpo", "--seq-len", SEQ]
    status, _out, err = slide(*argv, "--chat-template", "qwen3", "--json")
    _one_line_refusal(status, err, "'chosen' and 'rejected' are the same once rendered by the chat template")


def test_a_pair_identical_within_the_limit_is_refused(tmp_path: Path, tokenizer: Any) -> None:
    """Two completions that differ only past the cut train the same tokens: nothing to prefer."""
    long = "A very long answer that goes on and on. " * 20
    data = _write(tmp_path / "pairs.jsonl", {"prompt": "Talk.", "chosen": long + "Yes.", "rejected": long + "No."})
    with pytest.raises(UserError, match=r"pairs\.jsonl:1: 'chosen' and 'rejected' are the same within the 128"):
        load_pairs(data, tokenizer, DataOptions(seq_len=SEQ))
    assert load_pairs(data, tokenizer, DataOptions(seq_len=4 * SEQ)).stats.examples == 1


def test_two_strings_that_tokenize_alike_are_refused_without_a_template() -> None:
    encoder = PairEncoder(_WordTokenizer(), DataOptions(seq_len=SEQ))
    pair = parse_pair(Record("pairs.jsonl:1", {"prompt": "Hi there", "chosen": "Hello.", "rejected": "hello."}))
    with pytest.raises(UserError, match=r"'chosen' and 'rejected' are the same once tokenized"):
        encoder.encode(pair)


# -- a null field ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["prompt", "chosen", "rejected"])
def test_a_null_field_is_called_null_not_missing(key: str) -> None:
    fields: dict[str, Any] = {"prompt": "What is 2+2?", "chosen": "4.", "rejected": "5."} | {key: None}
    with pytest.raises(UserError) as error:
        parse_pair(Record("pairs.jsonl:3", fields))
    message = str(error.value)
    assert f"'{key}' is null" in message and "found:" not in message and message.startswith("pairs.jsonl:3: ")


def test_a_missing_field_still_lists_the_fields_found() -> None:
    with pytest.raises(UserError, match=r"no 'rejected' \(found: chosen, prompt\)"):
        parse_pair(Record("pairs.jsonl:1", {"prompt": "What is 2+2?", "chosen": "4."}))


# -- what `slide data` says --------------------------------------------------------------------------------------


GOOD = {"prompt": "What is two and two?", "chosen": "Four.", "rejected": "Five, perhaps."}


def test_slide_data_json_leaves_the_example_lengths_of_pairs_null(tmp_path: Path, slide: Any) -> None:
    """The text summary leaves the texts' lengths out for pairs; the JSON says null, not a false 0."""
    data = _write(tmp_path / "pairs.jsonl", GOOD)
    argv = ["data", "--model", "tiny-llama", "--data", data, "--objective", "dpo", "--seq-len", SEQ, "--json"]
    status, out, _ = slide(*argv)
    assert status == 0
    summary = json.loads(out.splitlines()[-1])["summary"]
    for key in ("example_tokens_min", "example_tokens_median", "example_tokens_max", "longer_than_seq_len"):
        assert key in summary and summary[key] is None, (key, summary)
    assert summary["pairs"] == 1 and summary["truncated_examples"] == 0


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_slide_data_explains_the_marks_only_when_it_showed_text(objective: str, tmp_path: Path, slide: Any) -> None:
    record = GOOD if objective == "dpo" else {"text": "The sky is blue and the grass is green."}
    data = _write(tmp_path / "data.jsonl", record)
    argv = ["data", "--model", "tiny-llama", "--data", data, "--objective", objective, "--seq-len", SEQ]
    status, out, _ = slide(*argv, "--show", 0)
    assert status == 0 and out.startswith("summary of ") and "trained text above" not in out, out
    status, out, _ = slide(*argv, "--show", 1)
    assert status == 0 and "trained text above is between [[ and ]]" in out, out
