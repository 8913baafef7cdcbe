"""Records out of local files: JSON Lines (plain or gzip), a JSON array, Parquet, and the bundled text.

Every reader streams: JSON Lines line by line, a JSON array object by object through an incremental decoder,
Parquet in record batches, so the raw file is never held in memory. Each record carries ``where``, the
place a user can open in an editor (``train.jsonl:12``, ``train.parquet row 7``), and every error a
reader raises names it in one line: bytes that are not UTF-8, a JSON escape of a lone surrogate (valid
JSON, but not text any tokenizer accepts), a line that is not a JSON object.

Every reader also bounds one record: a JSON line or object longer than ``max_record_bytes`` (8 MiB by
default, :data:`DEFAULT_MAX_RECORD_BYTES`) is refused by its size *before* it is parsed or tokenized, so a
runaway record (a 50 MB line, a whole dump on one line) costs a bounded read instead of gigabytes of
tokenizer state, and JSON nested deeper than Python's decoder can follow is a bad record, not a crash.

A source also has a ``fingerprint``: what the prepared-data cache key needs to notice that the data
changed (path, size and modification time for a file).
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from slide_hf.errors import UserError
from slide_hf.spelling import option

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "Record",
    "Source",
    "bundled_text_path",
    "check_record_size",
    "file_fingerprint",
    "open_file_source",
]

DEFAULT_MAX_RECORD_BYTES = 8 << 20
"""The largest record read by default (8 MiB of raw JSON, or of a table row's text): far past any example
a model trains on at a few thousand tokens, small enough that refusing it is quick and cheap."""

_CHUNK_BYTES = 1 << 20
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")


@dataclass(frozen=True)
class Record:
    """One example as read: ``where`` names it in messages, ``fields`` is the JSON object or table row."""

    where: str
    fields: dict[str, Any]


class Source(Protocol):
    """A place records come from."""

    name: str

    def fingerprint(self) -> str: ...

    def records(self) -> Iterator[Record]: ...


def bundled_text_path() -> Path:
    return Path(str(resources.files("slide_hf") / "resources" / "tiny_corpus.txt"))


def file_fingerprint(path: Path) -> str:
    """Path, size and modification time: cheap, and changes whenever the file is rewritten."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def open_file_source(path: Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Source:
    """The reader for ``path`` by its suffix; one line naming the supported ones otherwise."""
    name = path.name.lower()
    if name.endswith(".jsonl.gz"):
        return JsonLinesFile(path, compressed=True, max_record_bytes=max_record_bytes)
    if name.endswith(".jsonl"):
        return JsonLinesFile(path, compressed=False, max_record_bytes=max_record_bytes)
    if name.endswith(".json"):
        return JsonArrayFile(path, max_record_bytes=max_record_bytes)
    if name.endswith(".parquet"):
        return ParquetFile(path, max_record_bytes=max_record_bytes)
    raise UserError(f"data file {path}: unknown format; use one of {', '.join(SUFFIXES)} or a datasets directory")


class BundledText:
    """The bundled English text: one ``text`` record per non-empty line."""

    name = "bundled English text"

    def __init__(self) -> None:
        self.path = bundled_text_path()

    def fingerprint(self) -> str:
        return file_fingerprint(self.path)

    def records(self) -> Iterator[Record]:
        with self.path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield Record(f"{self.name}:{number}", {"text": line.rstrip("\n")})


class JsonLinesFile:
    """One JSON object per line; blank lines are skipped but still counted, so numbers match an editor's."""

    def __init__(self, path: Path, *, compressed: bool, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.path = path
        self.name = str(path)
        self.compressed = compressed
        self.max_record_bytes = max_record_bytes

    def fingerprint(self) -> str:
        return file_fingerprint(self.path)

    def records(self) -> Iterator[Record]:
        with self._open() as handle:
            number = 0
            while True:
                try:  # at most one byte past the limit is read: a runaway line costs no memory
                    raw = handle.readline(self.max_record_bytes + 2)
                except (OSError, EOFError, zlib.error) as error:
                    raise UserError(f"{self.path}:{number + 1}: cannot decompress ({error})") from None
                if not raw:
                    return
                number += 1
                if len(raw.rstrip(b"\r\n")) > self.max_record_bytes:
                    raise UserError(_too_large(f"{self.path}:{number}", self.max_record_bytes))
                if number == 1:
                    raw = raw.removeprefix(codecs.BOM_UTF8)
                if not raw.strip():
                    continue
                where = f"{self.path}:{number}"
                yield Record(where, _parse_object(raw, where))

    def _open(self) -> BinaryIO:
        if not self.path.is_file():
            raise UserError(f"data file {self.path} does not exist")
        if self.compressed:
            return gzip.open(self.path, "rb")  # type: ignore[return-value]
        return self.path.open("rb")


class JsonArrayFile:
    """A JSON array of objects, decoded object by object from chunks; a file of JSON Lines is accepted too.

    ``where`` is the line on which each object starts.
    """

    def __init__(self, path: Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.path = path
        self.name = str(path)
        self.max_record_bytes = max_record_bytes

    def fingerprint(self) -> str:
        return file_fingerprint(self.path)

    def records(self) -> Iterator[Record]:
        if not self.path.is_file():
            raise UserError(f"data file {self.path} does not exist")
        with self.path.open("rb") as handle:
            yield from _ArrayScanner(self.path, handle, self.max_record_bytes).records()


class _ArrayScanner:
    """Walks ``[ {...}, {...} ]`` (or ``{...}\\n{...}``) with ``raw_decode`` over a growing text window."""

    def __init__(self, path: Path, handle: BinaryIO, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.path = path
        self.handle = handle
        self.max_record_bytes = max_record_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.text = ""
        self.pos = 0
        self.line = 1  # the line of self.pos
        self.lines_read = 1  # lines in the bytes decoded so far, for locating bad bytes
        self.eof = False

    def records(self) -> Iterator[Record]:
        json_decoder = json.JSONDecoder()
        self._skip_space()
        if self._peek() == "\ufeff":
            self._advance(1)
            self._skip_space()
        array = self._peek() == "["
        if array:
            self._advance(1)
        first = True
        while True:
            self._skip_space()
            char = self._peek()
            if char == "":
                if array:
                    raise UserError(f"{self.path}:{self.line}: the JSON array is not closed (truncated file?)")
                return
            if array and char == "]":
                self._advance(1)
                self._skip_space()
                if self._peek() != "":
                    raise UserError(f"{self.path}:{self.line}: unexpected text after the JSON array")
                return
            if array and not first:
                if char != ",":
                    raise UserError(f"{self.path}:{self.line}: expected ',' or ']' between the array's objects")
                self._advance(1)
                self._skip_space()
            where = f"{self.path}:{self.line}"
            value, end = self._decode_value(json_decoder, where)
            raw = self.text[self.pos : end].encode("utf-8", "surrogatepass")
            if len(raw) > self.max_record_bytes:
                raise UserError(_too_large(where, self.max_record_bytes))
            _check_surrogates(raw, value, where)
            if not isinstance(value, dict):
                raise UserError(f"{where}: expected a JSON object, got {_json_type(value)}")
            self._advance(end - self.pos)
            first = False
            yield Record(where, value)

    def _decode_value(self, decoder: json.JSONDecoder, where: str) -> tuple[Any, int]:
        while True:
            try:
                value, end = decoder.raw_decode(self.text, self.pos)
            except json.JSONDecodeError as error:
                if self.eof:
                    raise UserError(f"{where}: not valid JSON ({error.msg})") from None
                if len(self.text) - self.pos > self.max_record_bytes:  # characters: never more than bytes
                    raise UserError(_too_large(where, self.max_record_bytes)) from None
                self._read(grow=True)
                continue
            except RecursionError:
                raise UserError(_too_deep(where)) from None
            if end == len(self.text) and not self.eof and not isinstance(value, (dict, list, str)):
                self._read(grow=True)  # a bare number may continue in the next chunk
                continue
            return value, end

    def _peek(self) -> str:
        while self.pos >= len(self.text) and not self.eof:
            self._read()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _skip_space(self) -> None:
        while True:
            char = self._peek()
            if char == "" or not char.isspace():
                return
            self._advance(1)

    def _advance(self, count: int) -> None:
        self.line += self.text.count("\n", self.pos, self.pos + count)
        self.pos += count
        if self.pos > _CHUNK_BYTES:  # drop what was consumed, keep the window small
            self.text = self.text[self.pos :]
            self.pos = 0

    def _read(self, *, grow: bool = False) -> None:
        size = max(_CHUNK_BYTES, len(self.text) - self.pos) if grow else _CHUNK_BYTES
        chunk = self.handle.read(size)
        self.eof = not chunk
        try:
            decoded = self.decoder.decode(chunk, final=self.eof)
        except UnicodeDecodeError as error:
            line = self.lines_read + chunk[: max(error.start, 0)].count(b"\n")
            raise UserError(f"{self.path}:{line}: {_not_utf8(chunk, error)}") from None
        self.lines_read += chunk.count(b"\n")
        self.text += decoded


class ParquetFile:
    """A Parquet table read in record batches; ``where`` is ``file row N`` (0-based, as pandas shows it)."""

    def __init__(self, path: Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self.path = path
        self.name = str(path)
        self.max_record_bytes = max_record_bytes

    def fingerprint(self) -> str:
        return file_fingerprint(self.path)

    def records(self) -> Iterator[Record]:
        if not self.path.is_file():
            raise UserError(f"data file {self.path} does not exist")
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"reading {self.path} needs pyarrow: pip install 'slide-hf[parquet]'") from None
        try:
            table = pq.ParquetFile(self.path)
        except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
            raise UserError(f"{self.path}: not a readable Parquet file ({first_line(error)})") from None
        row = 0
        with table:
            for batch in table.iter_batches(batch_size=1024):
                try:
                    rows = batch.to_pylist()
                except UnicodeDecodeError as error:
                    raise UserError(f"{self.path} rows {row}-{row + batch.num_rows - 1}: {error.reason}") from None
                for fields in rows:
                    where = f"{self.path} row {row}"
                    check_record_size(fields, where, self.max_record_bytes)
                    yield Record(where, fields)
                    row += 1


def _parse_object(raw: bytes, where: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{where}: {_not_utf8(raw, error)}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{where}: not valid JSON ({error.msg})") from None
    except RecursionError:
        raise UserError(_too_deep(where)) from None
    _check_surrogates(raw, value, where)
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a JSON object, got {_json_type(value)}")
    return value


def check_record_size(fields: Any, where: str, limit: int) -> None:
    """Refuse a table row whose text (strings, UTF-8 bytes, and ids at 4 bytes each) passes ``limit``,
    before any tokenizer sees it. Walks the row iteratively (a deep row cannot overflow the stack) and
    stops as soon as the limit is passed."""
    total = 0
    pending = [fields]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            total += len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, dict):
            pending.extend(value.values())
            total += len(value)
        elif isinstance(value, list | tuple):
            pending.extend(value)
        else:
            total += 4
        if total > limit:
            raise UserError(_too_large(where, limit))


def _too_large(where: str, limit: int) -> str:
    return (
        f"{where}: the record is larger than the {_mib(limit)} record limit; split it, or raise the limit "
        f"with {option('max_record_size')}"
    )


def _too_deep(where: str) -> str:
    return f"{where}: JSON nested too deeply to read (thousands of levels); not a training record"


def _mib(size: int) -> str:
    return f"{size / (1 << 20):g} MiB" if size >= 1 << 20 else f"{size} bytes"


def _check_surrogates(raw: bytes, value: Any, where: str) -> None:
    """``"\\ud800"`` is valid JSON but no text: find the field before a tokenizer fails on it."""
    if not _SURROGATE_ESCAPE.search(raw):
        return  # the common case costs one regex scan
    try:
        field = _lone_surrogate_field(value, "")
    except RecursionError:
        raise UserError(_too_deep(where)) from None
    if field is not None:
        raise UserError(f"{where}: {field or 'the value'} holds a lone surrogate escape (\\ud800-\\udfff), not text")


def _lone_surrogate_field(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    for child, item in items:
        found = _lone_surrogate_field(item, child)
        if found is not None:
            return found
    return None


def _not_utf8(raw: bytes, error: UnicodeDecodeError) -> str:
    bad = raw[error.start] if 0 <= error.start < len(raw) else 0
    return f"not UTF-8 text (byte 0x{bad:02x}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
    return names.get(type(value), "null" if value is None else type(value).__name__)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
