"""`slide_hf.data.preference`: pairs to rows that keep each pair together, loss on the completions alone,
over-long pairs truncated and counted, and every malformed pair refused in one line (through `slide data`
and `slide train` too: exit status 2, one line, no traceback)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_data_tokenizer import QWEN3, chat_tokenizer

from slide_hf.data import IGNORE, DataOptions
from slide_hf.data.preference import load_pairs, preview_pairs
from slide_hf.errors import UserError
from slide_hf.preference.tags import PAIR_TAG_SHIFT, decode_tags, pair_count, tag_labels

GOOD = {"prompt": "What is two and two?", "chosen": "Four.", "rejected": "Five, perhaps."}
LONG_PROMPT = "Tell me about the weather in the mountains today. " * 30

HOSTILE = {
    "missing rejected": ({"prompt": "Hi", "chosen": "Hello."}, "no 'rejected'"),
    "null chosen": ({"prompt": "Hi", "chosen": None, "rejected": "Go away."}, "no 'chosen'"),
    "missing prompt": ({"chosen": "Hello.", "rejected": "Go away."}, "no 'prompt'"),
    "empty completion": ({"prompt": "Hi", "chosen": "  ", "rejected": "Go away."}, "'chosen' is empty"),
    "empty assistant turn": (
        {
            "prompt": [{"role": "user", "content": "Hi"}],
            "chosen": [{"role": "assistant", "content": ""}],
            "rejected": [{"role": "assistant", "content": "Go away."}],
        },
        "'chosen' is empty",
    ),
    "no assistant turn": (
        {
            "prompt": [{"role": "user", "content": "Hi"}],
            "chosen": [{"role": "user", "content": "Hello."}],
            "rejected": [{"role": "assistant", "content": "Go away."}],
        },
        "'chosen' holds no assistant message",
    ),
    "identical completions": ({"prompt": "Hi", "chosen": "Hello.", "rejected": "Hello."}, "are the same"),
    "prompt over the limit": ({"prompt": LONG_PROMPT, "chosen": "Sunny.", "rejected": "Rain."}, "the prompt is"),
    "mixed formats": (
        {"prompt": "Hi", "chosen": [{"role": "assistant", "content": "Hello."}], "rejected": "Go away."},
        "all be strings or all be message lists",
    ),
    "completion not text": ({"prompt": "Hi", "chosen": 3, "rejected": "Go away."}, "'chosen' must be a string"),
}

SEQ = 256


def _write(path: Path, *records: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


@pytest.fixture
def tokenizer() -> Any:
    return chat_tokenizer(QWEN3)


@pytest.fixture
def model_dir(tmp_path: Path, tokenizer: Any) -> Path:
    """A tiny Llama with the chat tokenizer, saved as a user's model directory."""
    from transformers import AutoModelForCausalLM

    from slide_hf import PRESETS

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(PRESETS["test-llama"](vocab_size=len(tokenizer)))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(str(tmp_path / "model"))
    return tmp_path / "model"


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_malformed_pair_is_refused_in_one_line_naming_it(case: str, tmp_path: Path, tokenizer: Any) -> None:
    record, expected = HOSTILE[case]
    data = _write(tmp_path / "pairs.jsonl", GOOD, record)
    with pytest.raises(UserError) as error:
        load_pairs(data, tokenizer, DataOptions(seq_len=SEQ))
    message = str(error.value)
    assert expected in message and "pairs.jsonl:2" in message and "\n" not in message


@pytest.mark.parametrize("case", ["missing rejected", "identical completions", "prompt over the limit"])
def test_slide_data_and_train_refuse_a_malformed_pair_without_a_traceback(
    case: str, tmp_path: Path, model_dir: Path, slide: Any
) -> None:
    data = _write(tmp_path / "pairs.jsonl", GOOD, HOSTILE[case][0])
    common = ["--model", model_dir, "--data", data, "--seq-len", SEQ]
    for argv in (
        ["data", *common, "--objective", "dpo"],
        ["train", *common, "--objective", "dpo", "--device", "cpu", "--output", tmp_path / "run", "--steps", 1],
    ):
        status, _out, err = slide(*argv)
        lines = [line for line in err.splitlines() if line.strip() and "error" in line.lower()]
        assert status == 2, err
        assert len(lines) == 1 and HOSTILE[case][1] in lines[0] and "Traceback" not in err, err


def test_pairs_share_a_row_and_train_only_their_completions(tmp_path: Path, tokenizer: Any) -> None:
    """Each row holds a chosen then a rejected sequence (positions restarting), labels only on completion
    tokens, tagged with their completion; packing fills rows in file order."""
    records = [
        {"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": f"No answer {i}, sorry."} for i in range(5)
    ]
    data = _write(tmp_path / "pairs.jsonl", *records)
    unpacked = load_pairs(data, tokenizer, DataOptions(seq_len=SEQ, packing=False))
    packed = load_pairs(data, tokenizer, DataOptions(seq_len=SEQ, packing=True))
    assert unpacked.stats.examples == packed.stats.examples == 5
    assert unpacked.stats.rows == 5 and packed.stats.rows < 5
    for row in range(5):
        positions = unpacked.position_ids[row]
        starts = [0, *[i for i in range(1, SEQ) if positions[i] != positions[i - 1] + 1]]
        assert len(starts) == 2  # chosen, then rejected (the padding continues the rejected one)
        tokens, completions = decode_tags(unpacked.labels[row])
        trained = completions >= 0
        assert set(completions[trained].tolist()) == {2 * row, 2 * row + 1}
        assert (completions[: starts[1]][trained[: starts[1]]] == 2 * row).all()
        chosen_text = tokenizer.decode(tokens[: starts[1]][trained[: starts[1]]].tolist())
        assert chosen_text.endswith(f"Answer {row}.<|im_end|>\n") and "Question" not in chosen_text
        assert int(unpacked.labels[row, 0]) == IGNORE and int(unpacked.labels[row, starts[1]]) == IGNORE
    assert pair_count(packed.labels) == pair_count(unpacked.labels) == 5


def test_an_over_long_pair_is_truncated_at_its_end_and_counted(tmp_path: Path, tokenizer: Any) -> None:
    long = "A very long answer that goes on and on. " * 20
    data = _write(tmp_path / "pairs.jsonl", GOOD, {"prompt": "Talk.", "chosen": long, "rejected": "No."})
    dataset = load_pairs(data, tokenizer, DataOptions(seq_len=SEQ, packing=False))
    assert dataset.stats.truncated_examples == 1
    (shown, cut) = preview_pairs(data, tokenizer, DataOptions(seq_len=SEQ), 2)
    assert not shown.truncated and cut.truncated and len(cut.chosen[0]) == SEQ // 2
    render = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Talk."}, {"role": "assistant", "content": long}], tokenize=False
    )
    assert cut.chosen[0].tolist() == tokenizer(render, add_special_tokens=False)["input_ids"][: SEQ // 2]


def test_the_earlier_turns_of_a_conversational_prompt_are_not_trained(tmp_path: Path, tokenizer: Any) -> None:
    record = {
        "prompt": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello there."},
            {"role": "user", "content": "Name a colour."},
        ],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Seven."}],
    }
    data = _write(tmp_path / "pairs.jsonl", record)
    (pair,) = preview_pairs(data, tokenizer, DataOptions(seq_len=SEQ), 1)
    for (ids, labels), reply in zip(pair.sequences(), ("Blue.", "Seven."), strict=True):
        trained = tokenizer.decode(ids[labels != IGNORE].tolist())
        assert reply in trained and "Hello there" not in trained


def test_slide_data_shows_each_pair(tmp_path: Path, model_dir: Path, slide: Any) -> None:
    data = _write(tmp_path / "pairs.jsonl", GOOD)
    argv = ["data", "--model", model_dir, "--data", data, "--objective", "dpo"]
    status, out, _ = slide(*argv, "--seq-len", SEQ)
    assert status == 0
    assert "chosen (" in out and "rejected (" in out
    assert re.search(r"\[\[[^\]]*Four\.", out) and re.search(r"\[\[[^\]]*Five, perhaps\.", out)
    status, out, _ = slide(*argv, "--seq-len", SEQ, "--json")
    first, summary = (json.loads(line) for line in out.splitlines())
    assert first["chosen"]["trained_text"].endswith("Four.<|im_end|>\n") and summary["summary"]["pairs"] == 1


def test_tags_round_trip() -> None:
    labels = np.array([IGNORE, 5, 7, IGNORE, 419], dtype=np.int32)
    tagged = torch.from_numpy(tag_labels(labels, 9))
    tokens, completions = decode_tags(tagged)
    assert tokens.tolist() == labels.tolist()
    assert completions.tolist() == [-1, 9, 9, -1, 9]
    assert int(tagged[1]) >> PAIR_TAG_SHIFT == 10
    assert pair_count(tagged) == 1  # completion 9 is pair 4's rejected


def _numbered_pairs(first: int, count: int) -> list[dict[str, Any]]:
    return [
        {"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": f"No answer {i}, sorry."}
        for i in range(first, first + count)
    ]


@pytest.mark.parametrize("packing", [False, True])
def test_several_sources_are_prepared_in_order_each_a_part_numbered_across_all(
    tmp_path: Path, tokenizer: Any, packing: bool
) -> None:
    """`--data a --data b` with an objective: each source's pairs in rows of their own (no row holds two
    sources' pairs), one part each for --data-weights, and the completions numbered across both, so the
    rows equal one file's wherever no packed row would have crossed the boundary."""
    whole = _write(tmp_path / "all.jsonl", *_numbered_pairs(0, 7))
    first = _write(tmp_path / "a.jsonl", *_numbered_pairs(0, 3))
    second = _write(tmp_path / "b.jsonl", *_numbered_pairs(3, 4))
    options = DataOptions(seq_len=SEQ, packing=packing)
    one, two = load_pairs(whole, tokenizer, options), load_pairs((first, second), tokenizer, options)
    assert [(p.name, p.examples) for p in two.parts] == [(str(first), 3), (str(second), 4)]
    assert two.parts[0].first_row == 0 and two.parts[1].first_row == two.parts[0].rows
    assert sum(p.rows for p in two.parts) == two.stats.rows and two.stats.examples == 7
    assert two.source == f"{first} + {second}"
    _, completions = decode_tags(two.labels)
    assert set(completions[completions >= 0].tolist()) == set(range(14))  # one number per completion
    for row in range(two.parts[0].rows, two.stats.rows):  # the second source's rows hold its pairs alone
        _, tags = decode_tags(two.labels[row])
        assert tags[tags >= 0].min() >= 2 * 3
    if not packing:  # one pair a row: the same rows as the one file's, bit for bit
        assert torch.equal(one.input_ids, two.input_ids) and torch.equal(one.labels, two.labels)
        assert one.digest == two.digest
    shown = preview_pairs((first, second), tokenizer, options, 4)  # the first pairs of each in turn
    assert len(shown) == 4


def test_a_source_without_pairs_is_refused_by_name(tmp_path: Path, tokenizer: Any) -> None:
    good = _write(tmp_path / "a.jsonl", GOOD)
    empty = _write(tmp_path / "empty.jsonl")
    with pytest.raises(UserError, match=r"empty\.jsonl holds no preference pair"):
        load_pairs((good, empty), tokenizer, DataOptions(seq_len=SEQ))


@pytest.mark.slow
def test_dpo_on_several_sources_trains_as_on_their_concatenation(tmp_path: Path, model_dir: Path) -> None:
    """One pair a row, in order: two --data files give the one file's run, weights bit for bit; with
    --data-weights the run samples the parts and trains with finite losses."""
    from safetensors.torch import load_file

    import slide_hf

    whole = _write(tmp_path / "all.jsonl", *_numbered_pairs(0, 8))
    first = _write(tmp_path / "a.jsonl", *_numbered_pairs(0, 3))
    second = _write(tmp_path / "b.jsonl", *_numbered_pairs(3, 5))
    common = dict(
        objective="dpo", device="cpu", dtype="float32", seq_len=SEQ, batch_size=2, steps=3, no_shuffle=True,
        packing=False, lr=1e-3, save_dtype="float32", keep_checkpoints=0,
    )  # fmt: skip

    def run(name: str, data: Any, **more: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
        records: list[dict[str, Any]] = []
        slide_hf.train(model_dir, data=data, output=tmp_path / name, on_step=records.append, **common, **more)
        files = sorted((tmp_path / name / "model").glob("*.safetensors"))
        return [r["loss"] for r in records], {k: v for f in files for k, v in load_file(f).items()}

    losses_one, weights_one = run("one", whole)
    losses_two, weights_two = run("two", [first, second])
    assert losses_two == losses_one
    assert weights_two.keys() == weights_one.keys()
    assert all(torch.equal(weights_two[k], weights_one[k]) for k in weights_one)
    losses, _ = run("weighted", [first, second], data_weights=[1, 3])
    assert len(losses) == 3 and all(np.isfinite(losses))
