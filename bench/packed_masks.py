"""What packing costs on the device: building one micro-batch's side inputs (masks, rotary) with position
ids that restart per document, against plain rows, for a model's shape.

    python bench/packed_masks.py --model llama3.2-3b --batch-size 16 --seq-len 1024 --documents 8

Times ``prepare_inputs`` (median of repeats, CUDA-synchronized) and the extra device memory of its masks.
Inputs are random token ids; documents split each row into equal parts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from slide_hf import build_model, resolve_model


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3.2-3b")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--documents", type=int, default=8, help="documents per row when packed")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()

    config, _ = resolve_model(args.model)
    model = build_model(config)
    device = torch.device("cuda")
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=device)
    labels = ids.clone()
    per_doc = args.seq_len // args.documents
    positions = (torch.arange(args.seq_len, device=device) % per_doc).expand(args.batch_size, -1).contiguous()
    result = {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "documents": args.documents}
    for name, position_ids in (("plain", None), ("packed", positions)):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        ms = _time(
            lambda p=position_ids: model.prepare_inputs(ids, labels, torch.bfloat16, position_ids=p), args.repeats
        )
        result[f"{name}_ms"] = round(ms, 3)
        result[f"{name}_extra_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
