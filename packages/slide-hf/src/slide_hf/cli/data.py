"""`slide data`: show exactly which tokens of a data file carry loss, and what the packed rows hold.

The data goes through the same pipeline as `slide train` (same tokenizer resolution, chat template, masks,
packing), so what it shows is what training sees. The first --show examples are printed before packing
with the text that carries loss marked: in colour on a terminal, between [[ and ]] otherwise. A
summary follows: examples, rows, tokens, loss tokens, padding, truncated examples (their end dropped), split
examples (texts in row-sized pieces, every token but the first still trained), skipped examples, how many
assistant turns' reasoning the chat template drops (never trained), and for several --data sources each one's
share of the rows and tokens (and, with --data-weights, of the rows an epoch of training draws). A --show
larger than the data shows every record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slide_hf.options import TrainConfig

__all__ = ["add_parser", "run"]

EPILOG = """examples:
  slide data --model ./Qwen3-8B --data chats.jsonl --show 2     # trained text in colour (or [[...]] when piped)
  slide data --model ./Qwen3-8B --data chats.jsonl --json | jq .trained_text
  slide data --model tiny-llama --data corpus.jsonl --seq-len 512 --show 0   # summary only
  slide data --data chats.jsonl --data code.jsonl --data-weights 3,1 --show 0  # each source's share
  slide data --model ./Qwen3-8B --data pairs.jsonl --objective dpo      # each pair's trained text and lengths

formats: .jsonl, .jsonl.gz, .json, .parquet, a datasets directory or a Hub dataset org/name; records of
text, messages, conversations (ShareGPT), input_ids (+labels), prompt/completion or Alpaca
instruction/input/output; with --objective dpo or simpo, prompt/chosen/rejected pairs. See docs/data.md
and docs/preference.md.
"""

_ON, _OFF = "\x1b[1;32m", "\x1b[0m"
_OPEN, _CLOSE = "[[", "]]"

_NO_EXAMPLE_LENGTHS = dict.fromkeys(
    ("example_tokens_min", "example_tokens_median", "example_tokens_max", "longer_than_seq_len")
)
"""Null in a pairs summary: pairs are not measured as texts are (each of a pair's sequences has its own limit,
and the over-long ones are ``truncated_examples``), so the text summary leaves these out, and a 0 would be
a false length."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    from slide_hf.options import add_options

    parser = commands.add_parser(
        "data",
        help="show which tokens of a data file carry loss, and the packed rows' statistics",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, "data")  # the options it shares with `slide train`, as slide_hf/options/config.py declares
    add = parser.add_argument
    add("--show", type=int, default=3, metavar="K", help="examples to show before the summary (default 3)")
    add("--json", action="store_true", help='one JSON object per shown example, then {"summary": {...}}')


def run(args: argparse.Namespace) -> int:
    from slide_hf.data import DataOptions, load_dataset, preview
    from slide_hf.defaults import model_positions, resolve_seq_len
    from slide_hf.errors import UserError
    from slide_hf.options import TrainConfig, given_options

    if args.show < 0:
        raise UserError(f"--show must be >= 0, got {args.show}")
    # The options shared with `slide train`, by its rules: the data reaches the pipeline as training reads it.
    given = TrainConfig.for_command("data", **given_options(args, "data"))
    tokenizer, config = _tokenizer_and_config(given)
    options = DataOptions(
        seq_len=resolve_seq_len(given.seq_len, config, bundled_text=given.data is None),
        packing=given.packing,
        train_on_inputs=given.train_on_inputs,
        chat_template=given.chat_template,
        max_positions=model_positions(config),
        vocab_size=config.vocab_size,
        max_record_bytes=given.max_record_bytes,
        keep_reasoning=given.keep_reasoning,
        system_message=given.system_message,
    )
    from slide_hf.data.notes import each_note_once

    if given.preference:
        return _run_pairs(given.data, tokenizer, options, args)
    with each_note_once():  # the preview and the preparation each meet the template: say its notes once
        shown = preview(given.data, tokenizer, options, args.show) if args.show else []
        dataset = load_dataset(given.data, tokenizer, options)
    summary = {"source": dataset.source, "seq_len": options.seq_len, "packing": options.packing}
    summary |= dataclasses.asdict(dataset.stats)
    if len(dataset.parts) > 1:
        summary["sources"] = _shares(dataset, given.data_weights)
    if args.json:
        for record in shown:
            print(json.dumps(_example_json(record, tokenizer), ensure_ascii=False))
        print(json.dumps({"summary": summary}))
        return 0
    colour = sys.stdout.isatty()
    for record in shown:
        print(_example_text(record, tokenizer, colour=colour))
    print(_summary_text(summary, colour=colour, shown=bool(shown)))
    return 0


def _run_pairs(source: Any, tokenizer: Any, options: Any, args: argparse.Namespace) -> int:
    """`slide data --objective dpo|simpo`: each shown pair's chosen and rejected sequence with the trained
    text marked and their lengths, then the summary of the rows the pairs make (slide_hf/data/preference.py)."""
    from slide_hf.data.preference import load_pairs, preview_pairs

    shown = preview_pairs(source, tokenizer, options, args.show) if args.show else []
    dataset = load_pairs(source, tokenizer, options)
    summary = {"source": dataset.source, "seq_len": options.seq_len, "packing": options.packing}
    summary |= dataclasses.asdict(dataset.stats) | {"pairs": dataset.stats.examples} | _NO_EXAMPLE_LENGTHS
    if args.json:
        for pair in shown:
            print(json.dumps(_pair_json(pair, tokenizer), ensure_ascii=False))
        print(json.dumps({"summary": summary}))
        return 0
    colour = sys.stdout.isatty()
    for pair in shown:
        print(_pair_text(pair, tokenizer, colour=colour))
    print(_summary_text(summary, colour=colour, shown=bool(shown)).replace("examples ", "pairs    ", 1))
    return 0


def _pair_json(pair: Any, tokenizer: Any) -> dict[str, Any]:
    sides = {}
    for name, (ids, labels) in zip(("chosen", "rejected"), pair.sequences(), strict=True):
        trained = [token for token, label in zip(ids.tolist(), labels.tolist(), strict=True) if label != -100]
        sides[name] = {
            "text": tokenizer.decode(ids.tolist()),
            "trained_text": tokenizer.decode(trained),
            "tokens": len(ids),
            "loss_tokens": len(trained),
        }
    return {"where": pair.where, "prompt_tokens": pair.prompt_tokens, "truncated": pair.truncated, **sides}


def _pair_text(pair: Any, tokenizer: Any, *, colour: bool) -> str:
    lines = [f"--- {pair.where} (prompt {pair.prompt_tokens} tokens{', truncated' if pair.truncated else ''})"]
    for name, (ids, labels) in zip(("chosen", "rejected"), pair.sequences(), strict=True):
        runs: list[tuple[list[int], bool]] = []
        for token, label in zip(ids.tolist(), labels.tolist(), strict=True):
            if runs and runs[-1][1] == (label != -100):
                runs[-1][0].append(token)
            else:
                runs.append(([token], label != -100))
        trained = sum(len(run) for run, carries in runs if carries)
        text = "".join(
            (f"{_ON}{tokenizer.decode(run)}{_OFF}" if colour else f"{_OPEN}{tokenizer.decode(run)}{_CLOSE}")
            if carries
            else tokenizer.decode(run)
            for run, carries in runs
        )
        lines.append(f"{name} ({len(ids)} tokens, {trained} trained):\n{text}")
    return "\n".join(lines) + "\n"


def _shares(dataset: Any, weights: tuple[float, ...] | None) -> list[dict[str, Any]]:
    """Each source's rows and tokens and their fractions of the whole; with weights, the fraction of the
    rows an epoch of training draws from it (slide_hf/data/mixture.py)."""
    from slide_hf.data.mixture import weight_shares

    rows = max(dataset.stats.rows, 1)
    tokens = max(dataset.stats.tokens, 1)
    sampled = weight_shares(weights) if weights is not None else []
    shares = []
    for i, part in enumerate(dataset.parts):
        share = {
            "name": part.name,
            "examples": part.examples,
            "rows": part.rows,
            "tokens": part.tokens,
            "loss_tokens": part.loss_tokens,
            "row_share": part.rows / rows,
            "token_share": part.tokens / tokens,
        }
        if weights is not None:
            share["sampled_share"] = sampled[i]
        shares.append(share)
    return shares


def _tokenizer_and_config(cfg: TrainConfig) -> tuple[Any, Any]:
    """The tokenizer and model config exactly as `slide train` resolves them for ``--model``/``--tokenizer``."""
    from slide_hf import resolve_model
    from slide_hf.errors import UserError
    from slide_hf.hub import is_hub_id, resolve_hub_model
    from slide_hf.presets import PRESETS
    from slide_hf.tokenizer import BYTE_VOCAB_SIZE, load_tokenizer

    source: str | Path = cfg.model
    if cfg.model not in PRESETS and is_hub_id(cfg.model):
        source = resolve_hub_model(cfg.model)
    overrides = {"vocab_size": BYTE_VOCAB_SIZE} if cfg.model == "tiny-llama" else {}
    try:
        config, model_dir = resolve_model(source, **overrides)
    except ValueError as error:
        raise UserError(str(error)) from error
    tokenizer = load_tokenizer(model_dir, cfg.tokenizer)
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the model only {config.vocab_size}")
    return tokenizer, config


def _runs(record: Any) -> list[tuple[list[int], bool]]:
    """The record's tokens as runs of (token ids, carries loss), each token once (a split text's pieces
    overlap by a token in the rows; ``EncodedRecord.stream`` shows it once, with the label it trains)."""
    runs: list[tuple[list[int], bool]] = []
    ids, labels = record.stream()
    for token, label in zip(ids.tolist(), labels.tolist(), strict=True):
        trained = label != -100
        if runs and runs[-1][1] == trained:
            runs[-1][0].append(token)
        else:
            runs.append(([token], trained))
    return runs


def _example_json(record: Any, tokenizer: Any) -> dict[str, Any]:
    stream_ids, stream_labels = record.stream()
    ids = stream_ids.tolist()
    spans = [tokenizer.decode(run) for run, carries_loss in _runs(record) if carries_loss]
    trained = [token for token, label in zip(ids, stream_labels.tolist(), strict=True) if label != -100]
    return {
        "where": record.where,
        "text": tokenizer.decode(ids),
        "trained_text": tokenizer.decode(trained),
        "trained_spans": spans,
        "tokens": len(ids),
        "loss_tokens": len(trained),
        "cut": record.cut,
        "skipped": record.skipped,
    }


def _example_text(record: Any, tokenizer: Any, *, colour: bool) -> str:
    ids, labels = record.stream()
    notes = [f"{len(ids)} tokens", f"{int((labels != -100).sum())} trained"]
    if record.cut == "split":
        notes.append(f"split into {len(record.documents)} pieces")
    elif record.cut:
        notes.append(record.cut)
    if record.skipped:
        notes.append("skipped: no token to train")
    parts = []
    for ids, trained in _runs(record):
        text = tokenizer.decode(ids)
        parts.append((f"{_ON}{text}{_OFF}" if colour else f"{_OPEN}{text}{_CLOSE}") if trained else text)
    return f"--- {record.where} ({', '.join(notes)})\n{''.join(parts)}\n"


def _length_lines(summary: dict[str, Any]) -> list[str]:
    """The examples' lengths in tokens before any cut, and how many exceed a row (each text split into
    row-sized pieces, any other example truncated): what decides a --seq-len for long documents."""
    if not summary.get("example_tokens_max"):
        return []  # a summary without them (preference pairs: null)
    lines = [
        f"  example tokens      min {summary['example_tokens_min']}, median {summary['example_tokens_median']}, "
        f"max {summary['example_tokens_max']}"
    ]
    longer = summary.get("longer_than_seq_len", 0)
    if longer:
        lines.append(
            f"  longer than seq-len {longer} (split into row-sized pieces or truncated; the longest "
            f"{summary['example_tokens_max']} tokens)"
        )
    return lines


def _split_line(split: int) -> str:
    """The split texts, and why the summary's tokens exceed their lengths: each cut repeats one token."""
    if not split:
        return "0"
    return f"{split} (texts in row-sized pieces, each after the first repeating the last token before it)"


def _summary_text(summary: dict[str, Any], *, colour: bool, shown: bool) -> str:
    """The summary's lines; how the trained text is marked only when some was ``shown`` above it."""
    from slide_hf.data.dataset import dropped_reasoning_line

    marked = "in colour" if colour else f"between {_OPEN} and {_CLOSE}"
    legend = f"; trained text above is {marked}" if shown else ""
    dropped = summary["dropped_reasoning_turns"]
    sources = []
    for share in summary.get("sources", []):
        sampled = f", sampled {share['sampled_share']:.1%} of an epoch" if "sampled_share" in share else ""
        sources.append(
            f"  source {share['name']}: {share['rows']} rows ({share['row_share']:.1%}), {share['tokens']} tokens "
            f"({share['token_share']:.1%}), {share['examples']} examples{sampled}"
        )
    return "\n".join(
        [
            f"summary of {summary['source']} (seq-len {summary['seq_len']}, packing {'on' if summary['packing'] else 'off'}"
            f"{legend})",
            f"  examples            {summary['examples']}",
            f"  rows                {summary['rows']}",
            f"  tokens              {summary['tokens']}",
            f"  loss tokens         {summary['loss_tokens']}",
            f"  padding             {summary['padding_fraction']:.1%}",
            *_length_lines(summary),
            f"  truncated examples  {summary['truncated_examples']}",
            f"  split examples      {_split_line(summary['split_examples'])}",
            f"  skipped examples    {summary['skipped_examples']}",
            *([f"  {dropped_reasoning_line(dropped)}"] if dropped else []),
            *sources,
        ]
    )
