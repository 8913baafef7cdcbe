"""End-to-end throughput of the sliding engine vs plain PyTorch, in one invocation.

    python bench/e2e.py --model llama3.2-3b --batch-size 16 --seq-len 1024 --compare plain --json out.json

The same as `slide bench` (see slide_hf/bench.py for what is measured and how).
"""

from __future__ import annotations

import sys

from slide_hf.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
