"""Writes a Llama-architecture checkpoint with random weights, and a tokenizer, offline.

    python3 make_checkpoint.py --out /tmp/hearth-llm/llama

For trying examples/llm_uvicorn (and for its tests) where no real checkpoint
can be downloaded. The directory is what `save_pretrained` writes for a real
model: config.json, generation_config.json, model.safetensors (or shards of
at most --max-shard-size with model.safetensors.index.json), and a byte-level
BPE tokenizer (tokenizer.json, tokenizer_config.json) trained on a few
sentences. Like Llama 3.2 1B: bf16, tied input and output embeddings (the
checkpoint holds model.embed_tokens.weight only; --untied adds an lm_head.weight
of its own, like Llama 3 8B), grouped-query attention (--kv-heads < --heads).
--device cuda makes the random weights on the GPU (minutes faster at billions
of parameters). The weights are random: the text it generates is
gibberish, but the same gibberish from every loader of the same checkpoint.

Needs torch >= 2 and transformers (which brings `tokenizers`).
"""

import argparse
import json
import os
import sys

CORPUS = [
    "one copy of the weights, many worker processes",
    "the store holds each model once and every worker maps it read-only",
    "uvicorn starts its workers with the spawn method: fresh interpreters",
    "a worker that crashes loses nothing: the weights live in the store",
    "hello hearth, hello world, hello again",
    "The quick brown fox jumps over the lazy dog.",
    "Large language models generate text one token at a time.",
    "Grouped-query attention shares each key and value head among several query heads.",
]


def make_tokenizer(vocab_size):
    """A byte-level BPE tokenizer with <unk>=0, <s>=1, </s>=2, as a transformers tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(CORPUS * 4, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")


def fill_vocab(path, vocab_size):
    """Adds BPE vocabulary entries "x<id>" (no merge makes them) for the ids
    from the tokenizer's last up to vocab_size - 1."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    vocab = data["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    for i in range(vocab_size):
        if i not in taken:
            name = f"x{i}"
            while name in vocab:
                name += "_"
            vocab[name] = i
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the checkpoint directory to write")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=344)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=2048)
    parser.add_argument("--initializer-range", type=float, default=0.1,
                        help="std of the random weights (Llama's own default, 0.02, makes a "
                             "random model's logits nearly flat)")
    parser.add_argument("--max-shard-size", default="10GB",
                        help="save_pretrained's max_shard_size: small values give several shards")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--untied", action="store_true",
                        help="an lm_head.weight of its own instead of the embedding table's")
    parser.add_argument("--fill-vocab", action="store_true",
                        help="give the tokenizer a token for every id of --vocab (\"x1234\", "
                             "never produced by encoding), so that every id the model draws has "
                             "text, as in a real checkpoint")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the random weights are made (the same seed gives other "
                             "weights on each)")
    args = parser.parse_args(argv)
    if args.vocab < 300:
        parser.error("--vocab must be at least 300: the tokenizer alone has 259 tokens")

    import torch
    import transformers

    tokenizer = make_tokenizer(min(args.vocab, 4096))
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.max_positions,
        initializer_range=args.initializer_range, tie_word_embeddings=not args.untied,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    tokenizer.save_pretrained(args.out)
    if args.fill_vocab:
        fill_vocab(os.path.join(args.out, "tokenizer.json"), args.vocab)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.out, local_files_only=True)

    files = sorted(f for f in os.listdir(args.out) if f.endswith(".safetensors"))
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"out": os.path.abspath(args.out), "safetensors": files,
                      "parameters": params, "bytes": 2 * params,
                      "tokenizer_vocab": len(tokenizer)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
