"""`slide data`: the trained text of each shown example, exactly, and the summary of the packed rows."""

from __future__ import annotations

import copy
import json

from test_data_templates import CALL, CONVERSATIONS
from test_data_tokenizer import QWEN3, QWEN3_CURRENT, assistant_turns, chat_tokenizer

from slide_hf.cli.main import main


def _tokenizer_dir(tmp_path, template=QWEN3):
    directory = tmp_path / "tok"
    chat_tokenizer(template).save_pretrained(directory)
    return directory


def _data(tmp_path, *rows):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_json_trained_text_is_exactly_the_assistant_turns(tmp_path, capsys):
    names = ["reasoning on every turn", "system and two turns", "one turn"]
    path = _data(tmp_path, *({"messages": CONVERSATIONS[name]} for name in names))
    args = ["data", "--model", "qwen3-8b", "--data", str(path), "--tokenizer", str(_tokenizer_dir(tmp_path))]
    args += ["--json", "--show", "3"]
    assert main([*args, "--seq-len", "512"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 4 and set(lines[-1]) == {"summary"}
    tok = chat_tokenizer(QWEN3)
    for name, shown in zip(names, lines, strict=False):
        rendered = tok.apply_chat_template(copy.deepcopy(CONVERSATIONS[name]), tokenize=False)
        assert shown["text"] == rendered
        assert shown["trained_text"] == assistant_turns(rendered)
        assert shown["loss_tokens"] == len(tok(assistant_turns(rendered), add_special_tokens=False)["input_ids"])
    summary = lines[-1]["summary"]
    assert summary["examples"] == 3 and summary["rows"] == 1 and summary["skipped_examples"] == 0
    assert summary["loss_tokens"] == sum(line["loss_tokens"] for line in lines[:3])
    assert summary["tokens"] == sum(line["tokens"] for line in lines[:3])


AGENT_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "<think>\nNeed the tool.\n</think>\n\nLet me check.", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "21 degrees.", "reasoning_content": "The tool said 21."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Be polite."},
]


def test_qwen3_current_template_trains_the_replies_of_the_final_render(tmp_path, capsys):
    """Qwen3's current template drops earlier replies' reasoning and has no bundled twin: each reply is
    found in the whole render and trained exactly there, with no --chat-template."""
    path = _data(tmp_path, {"messages": AGENT_CHAT})
    args = [
        "data",
        "--model",
        "qwen3-8b",
        "--data",
        str(path),
        "--tokenizer",
        str(_tokenizer_dir(tmp_path, QWEN3_CURRENT)),
    ]
    assert main([*args, "--seq-len", "512", "--json", "--show", "1"]) == 0
    shown, summary = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    rendered = chat_tokenizer(QWEN3_CURRENT).apply_chat_template(copy.deepcopy(AGENT_CHAT), tokenize=False)
    assert shown["text"] == rendered
    assert shown["trained_spans"] == [
        "4<|im_end|>\n",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "21 degrees.<|im_end|>\n",
        "<think>\nBe polite.\n</think>\n\nYou are welcome.<|im_end|>\n",
    ]
    assert shown["trained_text"] == "".join(shown["trained_spans"])
    for earlier in ("Two and two.", "Need the tool.", "The tool said 21."):  # dropped by the template
        assert earlier not in shown["text"] and earlier not in shown["trained_text"]
    assert "2+2?" not in shown["trained_text"] and "temp" not in shown["trained_text"]
    assert summary["summary"]["dropped_reasoning_turns"] == 3
    assert main([*args, "--seq-len", "512", "--show", "0"]) == 0
    assert "  3 assistant turns' reasoning is dropped by the chat template and not trained" in capsys.readouterr().out


def test_text_view_marks_trained_text_when_piped(tmp_path, capsys):
    path = _data(tmp_path, {"messages": CONVERSATIONS["one turn"]}, {"text": "plain words"})
    tokenizer = str(_tokenizer_dir(tmp_path))
    assert main(["data", "--model", "qwen3-8b", "--data", str(path), "--tokenizer", tokenizer, "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n[[<think>\n\n</think>\n\nHello!<|im_end|>\n]]" in out
    assert "plain words" not in out  # only one example shown
    assert "examples            2" in out and "trained text above is between [[ and ]]" in out


def test_bad_data_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "caf\xe9"}\n')
    assert main(["data", "--data", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == f"slide data: error: {path}:1: not UTF-8 text (byte 0xe9); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    )
    assert main(["data", "--show", "-1"]) == 2


def test_unknown_role_is_named_with_the_accepted_ones(tmp_path, capsys):
    chat = [{"role": "user", "content": "Hi"}, {"role": "gpt", "content": "Hello!"}]
    path = _data(tmp_path, {"messages": CONVERSATIONS["one turn"]}, {"messages": chat})
    tokenizer = str(_tokenizer_dir(tmp_path))
    assert main(["data", "--model", "qwen3-8b", "--data", str(path), "--tokenizer", tokenizer, "--show", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"slide data: error: {path}:2: messages[1].role is 'gpt'; accepted roles: system, user, assistant, tool "
        '(ShareGPT turns, from "human"/"gpt", go in "conversations")'
    )
    # The same turns as ShareGPT are the supported schema for those names.
    sharegpt = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]
    path = _data(tmp_path, {"conversations": sharegpt})
    assert main(["data", "--model", "qwen3-8b", "--data", str(path), "--tokenizer", tokenizer, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out.splitlines()[0])
    assert shown["trained_text"] == "<think>\n\n</think>\n\nHello!<|im_end|>\n"


def test_seq_len_defaults_to_2048_and_to_the_demos_own_on_the_bundled_text(tmp_path, capsys):
    path = _data(tmp_path, {"messages": CONVERSATIONS["one turn"]})
    args = ["data", "--model", "qwen3-8b", "--data", str(path), "--tokenizer", str(_tokenizer_dir(tmp_path))]
    assert main([*args, "--show", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["seq_len"] == 2048  # Qwen3-8B has 40960 positions
    assert main(["data", "--model", "tiny-llama", "--show", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["seq_len"] == 128  # slide train's demo rows


def test_preset_with_bundled_text_and_no_packing(capsys):
    assert main(["data", "--model", "tiny-llama", "--seq-len", "64", "--show", "0", "--no-packing", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["source"] == "bundled English text" and summary["packing"] is False
    assert summary["rows"] > summary["examples"] > 0  # bundled paragraphs are longer than a row: split
