"""A Llama-shaped HF model directory with random bf16 weights and a small byte-level BPE tokenizer, for
benchmarks that need a real model directory larger than the tiny presets on a machine without a GPU (and
without the Hub):

    python bench/cpu_model.py OUT_DIR [--hidden 1024] [--layers 8] [--vocab 32000]

The default shape has 123 M parameters, so one checkpoint (fp32 master and moments) is about 1.5 GB: large
enough that writing it takes seconds on a development machine's disk. The tokenizer is trained on the
corpus slide-hf bundles (its 420 tokens sit inside the model's vocabulary).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from slide_hf.data.readers import bundled_text_path

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(bundled_text_path().read_text(encoding="utf-8").splitlines(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {params / 1e6:.1f} M parameters, tokenizer of {len(tokenizer)} tokens")


if __name__ == "__main__":
    main()
