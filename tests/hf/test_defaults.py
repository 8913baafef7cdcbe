"""`slide_hf.defaults`: one row-length default for every command, capped by the model, and the demo's own.

The commands that use it are tested through the CLI (test_cli_train, test_cli_plan, test_data_cli)."""

from __future__ import annotations

from types import SimpleNamespace

from slide_hf.defaults import DEFAULT_SEQ_LEN, DEMO_SEQ_LEN, resolve_seq_len


def test_given_seq_len_wins():
    assert resolve_seq_len(4096, SimpleNamespace(max_position_embeddings=131072)) == 4096
    assert resolve_seq_len(4096, SimpleNamespace(max_position_embeddings=64)) == 4096  # refused later, by name


def test_default_is_2048_or_the_context_length_if_shorter():
    assert DEFAULT_SEQ_LEN == 2048
    assert resolve_seq_len(None, SimpleNamespace(max_position_embeddings=131072)) == 2048
    assert resolve_seq_len(None, SimpleNamespace(max_position_embeddings=1024)) == 1024
    assert resolve_seq_len(None, SimpleNamespace(n_positions=512)) == 512  # GPT-2's name for it
    assert resolve_seq_len(None, SimpleNamespace()) == 2048  # no context length known


def test_the_bundled_demo_text_has_its_own_short_rows():
    assert DEMO_SEQ_LEN == 128
    assert resolve_seq_len(None, SimpleNamespace(max_position_embeddings=2048), bundled_text=True) == 128
    assert resolve_seq_len(None, SimpleNamespace(max_position_embeddings=64), bundled_text=True) == 64
    assert resolve_seq_len(256, SimpleNamespace(max_position_embeddings=2048), bundled_text=True) == 256
