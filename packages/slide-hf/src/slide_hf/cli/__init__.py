"""The `slide` command line: one module per command."""
