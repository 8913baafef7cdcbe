"""How long a run's host master takes to fill before its first step: HF weights loaded from a model
directory, or a preset's random initialization, into an fp32 and a split master.

    python bench/master_setup.py --model DIR                      # load_weights, both formats, twice each
    python bench/master_setup.py --model llama3.1-8b --layers 4   # init_random (a preset), both formats
    python bench/master_setup.py --model DIR --formats split --repeats 3

Each fill runs into a fresh HostParameters (pageable memory, as `slide train` allocates it), in alternating
formats so that a busy machine slows both alike. Prints one line a fill: parameters, seconds, Mparam/s.
Why: a split master is filled one unit at a time through an fp32 copy that is encoded into its planes, and
how that copy is made (decoded from the planes or not) moved its cost 3x on the development machine
(docs/benchmarks.md, "Filling the host master").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory (load its weights) or a preset (init)")
    parser.add_argument("--layers", type=int, help="a preset's first N decoder layers only")
    parser.add_argument("--formats", default="fp32,split", help="master formats, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from slide_core import HostParameters
    from slide_hf import build_model, init_random, load_config, load_weights, resolve_model

    directory = Path(args.model) if Path(args.model).is_dir() else None
    if directory is not None:
        config = load_config(directory)
    else:
        config, _ = resolve_model(args.model)
        if args.layers is not None:
            config.num_hidden_layers = args.layers
    model = build_model(config)
    what = f"load_weights from {directory}" if directory is not None else f"init_random of {args.model}"
    for _ in range(args.repeats):
        for master_format in args.formats.split(","):
            host = HostParameters(model, master_format=master_format)
            began = time.perf_counter()
            if directory is not None:
                load_weights(model, host, directory)
            else:
                init_random(model, host, config, seed=0)
            seconds = time.perf_counter() - began
            print(
                f"{what}, {master_format} master: {host.numel / 1e9:.2f} B parameters in {seconds:.2f} s "
                f"({host.numel / seconds / 1e6:.0f} Mparam/s)",
                flush=True,
            )
            del host


if __name__ == "__main__":
    main()
