"""`slide data`: the trained text of each shown example, exactly, and the summary of the packed rows."""

from __future__ import annotations

import copy
import json

from test_data_templates import CONVERSATIONS
from test_data_tokenizer import QWEN3, assistant_turns, chat_tokenizer

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


def test_preset_with_bundled_text_and_no_packing(capsys):
    assert main(["data", "--model", "tiny-llama", "--seq-len", "64", "--show", "0", "--no-packing", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["source"] == "bundled English text" and summary["packing"] is False
    assert summary["rows"] > summary["examples"] > 0  # bundled paragraphs are longer than a row: split
