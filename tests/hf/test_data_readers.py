"""`slide_hf.data.readers` and `hf_datasets`: every format streams the same records, and every bad byte is
named by file and line in one line."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import pytest

from slide_hf.data import open_source
from slide_hf.data.readers import Record
from slide_hf.errors import UserError

ROWS = [
    {"text": "first"},
    {"messages": [{"role": "user", "content": "é 😀"}, {"role": "assistant", "content": "ok"}]},
    {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
]


def _records(source) -> list[Record]:
    return list(open_source(source).records())


def _one_line_error(source, match: str) -> str:
    with pytest.raises(UserError) as info:
        _records(source)
    text = str(info.value)
    assert "\n" not in text
    assert match in text, text
    return text


def test_jsonl_plain_and_gzip_give_the_same_records(tmp_path):
    body = "\n".join(json.dumps(row) for row in ROWS[:2]) + "\n\n" + json.dumps(ROWS[2]) + "\n"
    plain = tmp_path / "d.jsonl"
    plain.write_text(body, encoding="utf-8")
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(gzip.compress(body.encode("utf-8")))
    for path in (plain, packed):
        records = _records(path)
        assert [r.fields for r in records] == ROWS
        assert [r.where for r in records] == [f"{path}:1", f"{path}:2", f"{path}:4"]  # a blank line still counts


def test_json_array_streams_objects_and_names_their_lines(tmp_path, monkeypatch):
    import slide_hf.data.readers as readers

    monkeypatch.setattr(readers, "_CHUNK_BYTES", 7)  # objects straddle many chunks
    path = tmp_path / "d.json"
    path.write_text("[\n" + ",\n".join(json.dumps(row, indent=1) for row in ROWS) + "\n]\n", encoding="utf-8")
    records = _records(path)
    assert [r.fields for r in records] == ROWS
    lines = path.read_text(encoding="utf-8").splitlines()
    for record in records:
        line = int(record.where.rsplit(":", 1)[1])
        assert lines[line - 1].lstrip(",").strip() == "{", record.where
    # A .json file holding JSON Lines is read too.
    lines_path = tmp_path / "lines.json"
    lines_path.write_text("\n".join(json.dumps(row) for row in ROWS), encoding="utf-8")
    assert [r.fields for r in _records(lines_path)] == ROWS


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[{"text": "a"}, {"text": ', ":1: not valid JSON"),
        ('[{"text": "a"}\n{"text": "b"}]', ":2: expected ',' or ']'"),
        ('[{"text": "a"}, 5]', ":1: expected a JSON object, got a number"),
        ('[{"text": "a"}', ":1: the JSON array is not closed"),
        ('[{"text": "a"}] x', ":1: unexpected text after the JSON array"),
    ],
)
def test_bad_json_array(tmp_path, body, message):
    path = tmp_path / "bad.json"
    path.write_text(body, encoding="utf-8")
    _one_line_error(path, message)


def test_json_array_bad_text_is_named_by_line(tmp_path, monkeypatch):
    import slide_hf.data.readers as readers

    monkeypatch.setattr(readers, "_CHUNK_BYTES", 5)
    path = tmp_path / "bad.json"
    path.write_bytes(b'[\n{"text": "ok"},\n{"text": "caf\xe9"}\n]')
    _one_line_error(path, f"{path}:3: not UTF-8 text (byte 0xe9)")
    path.write_bytes(b'[\n{"text": "ok"},\n\n{"text": "\\udc80"}\n]')
    _one_line_error(path, f"{path}:4: text holds a lone surrogate escape")


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(2500)]), path)
    records = _records(path)
    assert len(records) == 2500
    assert records[2400] == Record(f"{path} row 2400", {"prompt": "p2400", "completion": "c2400"})
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    _one_line_error(tmp_path / "broken.parquet", "not a readable Parquet file")


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    _one_line_error(path, "needs pyarrow: pip install 'slide-hf[parquet]'")


def test_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS[:1] * 3).save_to_disk(str(single))
    records = _records(single)
    assert [r.fields for r in records] == ROWS[:1] * 3
    assert records[1].where == f"{single} row 1"
    both = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"text": "t"}]), "test": datasets.Dataset.from_list([{"text": "x"}])}
    ).save_to_disk(str(both))
    assert [r.fields for r in _records(both)] == [{"text": "t"}]


def test_datasets_sources_without_the_library_name_the_extra(tmp_path, monkeypatch):
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}", encoding="utf-8")
    monkeypatch.setitem(sys.modules, "datasets", None)
    _one_line_error(saved, "needs the datasets library: pip install 'slide-hf[datasets]'")
    _one_line_error("some-org/some-set", "loading the Hub dataset some-org/some-set needs the datasets library")


def test_hub_name_offline_without_cache_is_one_line(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    # The libraries read these variables when imported (already done by now), so set both sides.
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    text = _one_line_error("no-such-org/no-such-set", "no-such-org/no-such-set is not a local file")
    assert "HF_DATASETS_OFFLINE and HF_HUB_OFFLINE set" in text


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"text": "caf\xe9"}'.encode("latin-1"), ":2: not UTF-8 text (byte 0xe9)"),
        (b'{"text": "a \\ud800 b"}', ":2: text holds a lone surrogate escape"),
        (
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            ":2: messages[0].content holds a lone surrogate escape",
        ),
        (b'{"text": "unterminated', ":2: not valid JSON"),
        (b"[1, 2]", ":2: expected a JSON object, got an array"),
        (b'"just a string"', ":2: expected a JSON object, got a string"),
    ],
)
def test_bad_line_is_named(tmp_path, raw, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine \\ud83d\\ude00"}\n' + raw + b"\n")  # a valid surrogate pair is fine
    _one_line_error(path, f"{path}{message}")


def test_truncated_gzip_is_one_line(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "a"}\n' * 10000)[:200])
    _one_line_error(path, "cannot decompress")


def test_sources_that_do_not_exist_or_are_unknown(tmp_path):
    _one_line_error(tmp_path / "nope.jsonl", f"data file {tmp_path / 'nope.jsonl'} does not exist")
    _one_line_error(tmp_path, "was not written by datasets' save_to_disk")
    (tmp_path / "d.csv").write_text("a,b\n", encoding="utf-8")
    _one_line_error(tmp_path / "d.csv", "unknown format; use one of .jsonl, .jsonl.gz, .json, .parquet")
    _one_line_error("./relative/missing.jsonl", "does not exist")


def test_unreadable_file_is_one_line(tmp_path, monkeypatch):
    import errno

    from slide_hf.data import DataOptions, preview
    from slide_hf.data.readers import JsonLinesFile
    from slide_hf.tokenizer import byte_tokenizer

    path = tmp_path / "locked.jsonl"
    path.write_text('{"text": "a"}\n', encoding="utf-8")

    def denied(self):  # what open() raises on a file this user may not read (root may read anything)
        raise PermissionError(errno.EACCES, "Permission denied", str(self.path))

    monkeypatch.setattr(JsonLinesFile, "_open", denied)
    with pytest.raises(UserError, match=rf"^{path}: Permission denied$"):
        preview(path, byte_tokenizer(), DataOptions(seq_len=8), 1)


def test_bundled_text_is_the_default():
    source = open_source(None)
    records = list(source.records())
    assert source.name == "bundled English text"
    assert records and all(set(r.fields) == {"text"} and r.fields["text"].strip() for r in records)
    assert records[0].where == "bundled English text:1"


def test_fingerprint_changes_with_the_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n', encoding="utf-8")
    before = open_source(path).fingerprint()
    assert open_source(Path(path)).fingerprint() == before
    path.write_text('{"text": "ab"}\n', encoding="utf-8")
    assert open_source(path).fingerprint() != before


# ---- bounded hostile records ---------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_50_mb_json_line_is_refused_by_size_quickly_and_in_bounded_memory(tmp_path, capsys):
    """Tokenizing such a line took minutes and gigabytes; the size check refuses it before parsing."""
    import resource
    import time

    from slide_hf.cli.main import main

    path = tmp_path / "big.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "short"}) + "\n")
        handle.write('{"text": "' + "word " * 10_000_000 + '"}\n')  # 50 MB on line 2
    main(["data", "--data", str(tmp_path / "missing.jsonl"), "--show", "0"])  # imports done: time the reading
    capsys.readouterr()
    before = _rss_bytes()
    start = time.monotonic()
    assert main(["data", "--data", str(path), "--show", "0"]) == 2
    seconds = time.monotonic() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{path}:2: the record is larger than the 8 MiB record limit" in err[0]
    assert "--max-record-size" in err[0]
    assert seconds < 30 and peak < before + (2 << 30), (seconds, peak, before)


def test_the_record_limit_can_be_raised_and_lowered(tmp_path, capsys):
    from slide_hf.cli.main import main

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "x" * 3000}) + "\n" + json.dumps({"text": "y" * 100}) + "\n")
    assert main(["data", "--data", str(path), "--show", "0", "--max-record-size", "2KiB", "--seq-len", "16"]) == 2
    assert f"{path}:1: the record is larger than the 2048 bytes record limit" in capsys.readouterr().err
    assert main(["data", "--data", str(path), "--show", "0", "--max-record-size", "4KiB", "--seq-len", "16"]) == 0


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_deeply_nested_json_is_a_bad_record_not_a_crash(tmp_path, capsys, suffix):
    import time

    from slide_hf.cli.main import main

    path = tmp_path / f"deep{suffix}"
    deep = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
    body = f'{{"text": "fine"}}\n{deep}\n' if suffix == ".jsonl" else f'[{{"text": "fine"}},\n{deep}]\n'
    path.write_text(body, encoding="utf-8")
    start = time.monotonic()
    assert main(["data", "--data", str(path), "--show", "0"]) == 2
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}:2: JSON nested too deeply to read" in err[0], err
    assert "internal error" not in err[0]


def test_an_oversized_json_array_object_is_refused_before_it_is_decoded(tmp_path):
    path = tmp_path / "big.json"
    path.write_text('[{"text": "a"},\n{"text": "' + "b" * 5000 + '"}]', encoding="utf-8")
    source = open_source(path, max_record_bytes=1000)
    with pytest.raises(UserError, match=rf"{path}:2: the record is larger than the 1000 bytes record limit"):
        list(source.records())
    assert len(list(open_source(path, max_record_bytes=6000).records())) == 2


def test_an_oversized_parquet_row_is_refused_by_its_text(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a", "é" * 600]}), path)  # 1200 UTF-8 bytes in row 1
    with pytest.raises(UserError, match=rf"{path} row 1: the record is larger than the 1000 bytes"):
        list(open_source(path, max_record_bytes=1000).records())
