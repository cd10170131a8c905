#!/usr/bin/env python3
"""Reference fixtures for the C++ tokenizer of backend: llm.

Trains three small BPE tokenizers with Hugging Face `tokenizers` (no
network: the training corpus is generated here), each shaped like a real
family's tokenizer.json:

  llama3_style   byte-level BPE, Llama 3's pre-tokenizer regex, ignore_merges,
                 Llama 3's special tokens after the vocab, <|begin_of_text|>
                 added by a TemplateProcessing post-processor.
  llama2_style   SentencePiece-style BPE (Llama 2 / Mistral v0.1): normalizer
                 Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer,
                 byte_fallback with <0x00>..<0xFF> in the vocab, <unk> <s> </s>,
                 decoder Replace, ByteFallback, Fuse, Strip.
  mistral_style  the same model with Mistral v0.3's Metaspace pre-tokenizer
                 (prepend_scheme "first") instead of the normalizer.
  qwen2_style    byte-level BPE with Qwen2's regex and an NFC normalizer,
                 <|endoftext|> <|im_start|> <|im_end|>, no BOS.

For each it writes tests/data/llm/tokenizers/<name>/tokenizer.json and, next
to it, expected.json: for every text of a test corpus (ASCII, accents, CJK,
emoji, whitespace runs, special tokens, long repetitive strings, 600 random
mixes) the ids of
encode(text, add_special_tokens=False/True), the ids with special tokens
treated as text (encode_special_tokens), and decode() of the ids with and
without skip_special_tokens; and decode() of random id lists. When
`transformers` is importable, its PreTrainedTokenizerFast over the same file
is checked to give the same ids and text.

Run from the repository root (it prints this line with the versions used):

    python3 tests/data/llm/make_tokenizer_fixtures.py

It needs the `tokenizers` package (and uses `transformers` if present); it
exits with a message naming what is missing otherwise. The output is
deterministic for a given `tokenizers` version.
"""

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
META = "\u2581"

# Llama 3's first special tokens (ids vocab+0 ...); the rest are reserved.
LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
] + ["<|reserved_special_token_%d|>" % i for i in range(3, 8)]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

WORDS = (
    "the of and to in is was that for it with as his on be at by had are but from or "
    "have an they which one you were all her she there would their we him been has when "
    "who will no more if out so said what up its about than into them can only other new "
    "some could time these two may first then do any like my now over such our man me even "
    "most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right "
    "used take three tokenizer model server worker request token stream decode encode "
    "weights memory device kernel batch prompt generate sample llama mistral qwen"
).split()
ACCENTED = ("café naïve résumé Ångström déjà vu façade coöperate señor über straße "
            "Zürich São Paulo crème brûlée garçon piñata Ærø Łódź").split()
CJK = ["日本語", "東京", "こんにちは", "ありがとう", "你好", "世界", "中文", "分词器",
       "한국어", "안녕하세요"]
EMOJI = ["😀", "👍", "👍🏽", "🇫🇷", "👩‍💻", "🚀", "❤️", "✨"]
CODE = ["def f(x):\n    return x + 1\n", "if (a != b) { return c->d[0]; }",
        "for i in range(10):\n\tprint(i)\n", "<div class=\"x\">text</div>",
        "SELECT * FROM t WHERE id = 42;", "x = [1, 2, 3]  # list"]


def training_corpus(seed):
    rng = random.Random(seed)
    lines = []
    for _ in range(6000):
        n = rng.randint(3, 18)
        words = []
        for _ in range(n):
            r = rng.random()
            if r < 0.80:
                w = rng.choice(WORDS)
            elif r < 0.88:
                w = rng.choice(ACCENTED)
            elif r < 0.93:
                w = str(rng.randint(0, 99999))
            elif r < 0.96:
                w = rng.choice(CJK)
            else:
                w = rng.choice(EMOJI)
            if rng.random() < 0.1:
                w = w.capitalize()
            words.append(w)
        line = " ".join(words)
        line += rng.choice([".", ",", "!", "?", "", ";", "'s", "'ll"])
        if rng.random() < 0.05:
            line = rng.choice(CODE) + line
        if rng.random() < 0.05:
            line = "  " + line + "\n\n"
        lines.append(line)
    return lines


def test_corpus(specials):
    s0 = specials[0]
    s_last = specials[-1]
    texts = [
        "",
        " ",
        "hello world",
        "Hello World! HELLO world?",
        "The model's weights aren't loaded; we'll see.",
        "I'M HERE, YOU'RE THERE, IT'S 'QUOTED' 'S",
        "  two leading spaces",
        "trailing spaces   ",
        "multiple     spaces    between",
        "tabs\tand\ttabs\t\tend",
        "line one\nline two\n\nline four\r\nwindows\r\n",
        "\n\n\n",
        "   \n   \n",
        "café naïve résumé Ångström",
        "e\u0301 combining acute, n\u0303 and A\u030a",  # NFC composes these
        "日本語のテキストです。東京は大きい。",
        "你好，世界！这是分词器的测试。",
        "안녕하세요 세계",
        "emoji 😀👍🏽 🇫🇷 👩‍💻 🚀🚀🚀 ❤️",
        "numbers 1234567890 3.14159 -42 1,000,000",
        "mixed\u3000ideographic\u00a0nbsp\u2003em\u180emongolian",
        "control \x01\x02\x7f bytes",
        "rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ℌ𝔢𝔩𝔩𝔬 and ﬁ ligature",
        "<div class=\"x\">text</div> && a->b[0] != c;",
        "def f(x):\n    return x + 1\n",
        "a" * 1000,
        "ab" * 500,
        "hello " * 200,
        " " * 100,
        "\n" * 50,
        "😀" * 60,
        "日本" * 100,
        s0 + "hello" + s_last,
        "text " + s0 + " with " + s_last + "specials " + s0 + s0,
        "almost " + s0[:-1] + " special",
        s0,
        "\u2581 the meta symbol itself",
        "\u017f '\u017f 'K '\u212a",  # long s and the Kelvin sign fold to s and k
    ]
    # Random texts from pieces that stress the regexes, NFC and the merges.
    atoms = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u180e", "\u2028", "\u0085",
             "\u3000", "\u200b", "\u2003", "'s", "'S", "'ll", "'LL", "'re", "'Ve", "'d", "'", '"',
             ".", ",", "!?", "...", "--", "(", ")", "{}", "<", ">", "/", "\\", "_", "#", "a", "b",
             "Z", "hello", "world", "The", "tokenizer", "x", "q", "0", "7", "12", "345", "6789",
             "3.14", "\u0663", "\u00bc", "\u216b", "\u00e9", "e\u0301", "A\u030a", "\u00f1",
             "\u00df", "\u017f", "\ufb01", "\u03a9", "\u2126", "\u03ac", "\u1100\u1161", "\ud55c",
             "\u65e5", "\u672c", "\u8a9e", "\u4f60\u597d", "\u3053\u3093\u306b\u3061\u306f",
             "\u30ab\u30bf\u30ab\u30ca", "\ud55c\uad6d\uc5b4", "\U0001f600",
             "\U0001f44d\U0001f3fd", "\U0001f1eb\U0001f1f7", "\U0001f469\u200d\U0001f4bb",
             "\U0001d518", "\U0010ffff", "\ue000", "\ufffd", "\u2581", "\u0120", "\x00", "\x01",
             "\x1f", "\x7f"] + list(specials)
    rng = random.Random(11)
    for _ in range(600):
        texts.append("".join(rng.choice(atoms) for _ in range(rng.randint(1, 20))))
    return texts


def fail(message):
    print("make_tokenizer_fixtures: " + message, file=sys.stderr)
    sys.exit(1)


def bpe_model(**flags):
    model = {"type": "BPE", "dropout": None, "unk_token": None,
             "continuing_subword_prefix": None, "end_of_word_suffix": None,
             "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": {}, "merges": []}
    model.update(flags)
    return model


def empty_tokenizer(model, normalizer, pre_tokenizer, decoder, post_processor=None):
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor, "decoder": decoder, "model": model}


def added(i, content):
    return {"id": i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True}


def template(token, token_id):
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": token, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": token, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": token, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {token: {"id": token, "ids": [token_id], "tokens": [token]}}}


def train(tokenizers, spec, vocab_size, corpus, **trainer_args):
    tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                             **trainer_args)
    tok.train_from_iterator(corpus, trainer=trainer)
    return json.loads(tok.to_str())


def byte_level_pre_tokenizer(pattern):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}


BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                      "use_regex": True}
BYTE_LEVEL_PROCESSOR = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                        "use_regex": True}


def make_llama3(tokenizers, corpus):
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    spec = empty_tokenizer(bpe_model(ignore_merges=True), None,
                           byte_level_pre_tokenizer(LLAMA3_PATTERN), BYTE_LEVEL_DECODER)
    d = train(tokenizers, spec, 3000, corpus, initial_alphabet=alphabet, min_frequency=2)
    d["model"]["ignore_merges"] = True
    n = len(d["model"]["vocab"])
    d["added_tokens"] = [added(n + i, s) for i, s in enumerate(LLAMA3_SPECIALS)]
    d["post_processor"] = {"type": "Sequence", "processors": [
        BYTE_LEVEL_PROCESSOR, template("<|begin_of_text|>", n)]}
    return d, LLAMA3_SPECIALS


def make_llama2(tokenizers, corpus):
    # Trained with a Metaspace pre-tokenizer, so that no merge crosses a word
    # (as SentencePiece's pieces never do); saved with Llama 2's normalizer.
    metaspace = {"type": "Metaspace", "replacement": META, "prepend_scheme": "always",
                 "split": True}
    spec = empty_tokenizer(bpe_model(unk_token="<unk>"), None, metaspace,
                           {"type": "Metaspace", "replacement": META,
                            "prepend_scheme": "always", "split": True})
    d = train(tokenizers, spec, 2500, corpus, special_tokens=["<unk>", "<s>", "</s>"],
              limit_alphabet=120, min_frequency=2)
    vocab = d["model"]["vocab"]
    # <0x00>..<0xFF> as ids 3..258, as in Llama 2's vocab.
    shifted = {}
    for token, i in vocab.items():
        shifted[token] = i if i < 3 else i + 256
    for b in range(256):
        shifted["<0x%02X>" % b] = 3 + b
    d["model"]["vocab"] = dict(sorted(shifted.items(), key=lambda kv: kv[1]))
    d["model"].update(byte_fallback=True, fuse_unk=True, unk_token="<unk>")
    d["added_tokens"] = [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")]
    d["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": META},
        {"type": "Replace", "pattern": {"String": " "}, "content": META}]}
    d["pre_tokenizer"] = None
    d["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": META}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    d["post_processor"] = template("<s>", 1)
    return d, ["<s>", "</s>", "<unk>"]


def make_mistral(tokenizers, corpus):
    # Mistral v0.3's form of the same: no normalizer, a Metaspace
    # pre-tokenizer that prepends "▁" to the text's first piece only.
    d, specials = make_llama2(tokenizers, corpus)
    d["normalizer"] = None
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": META, "prepend_scheme": "first",
                          "split": False}
    return d, specials


def make_qwen2(tokenizers, corpus):
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    spec = empty_tokenizer(bpe_model(), {"type": "NFC"},
                           byte_level_pre_tokenizer(QWEN2_PATTERN), BYTE_LEVEL_DECODER)
    d = train(tokenizers, spec, 3000, corpus, initial_alphabet=alphabet, min_frequency=2)
    n = len(d["model"]["vocab"])
    d["added_tokens"] = [added(n + i, s) for i, s in enumerate(QWEN2_SPECIALS)]
    d["post_processor"] = BYTE_LEVEL_PROCESSOR
    return d, QWEN2_SPECIALS


def expectations(tokenizers, transformers, tok_json, specials, seed):
    tok = tokenizers.Tokenizer.from_str(json.dumps(tok_json))
    fast = None
    if transformers is not None:
        try:
            fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
        except Exception as e:  # an API that moved: the check is a bonus
            print("make_tokenizer_fixtures: warning: no transformers cross-check: %s" % e,
                  file=sys.stderr)
    cases = []
    mismatches = []
    for text in test_corpus(specials):
        ids = tok.encode(text, add_special_tokens=False).ids
        ids_special = tok.encode(text, add_special_tokens=True).ids
        tok.encode_special_tokens = True
        ids_plain = tok.encode(text, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        case = {
            "text": text,
            "ids": ids,
            "ids_add_special": ids_special,
            "ids_special_as_text": ids_plain,
            "decoded": tok.decode(ids_special, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids_special, skip_special_tokens=True),
        }
        if fast is not None:
            # What transformers feeds a model from the same file: the same.
            try:
                got = (fast.encode(text, add_special_tokens=False),
                       fast.encode(text, add_special_tokens=True),
                       fast.decode(ids_special, skip_special_tokens=True,
                                   clean_up_tokenization_spaces=False))
                if got != (ids, ids_special, case["decoded_skip_special"]):
                    mismatches.append(text)
            except Exception as e:  # an API that moved: the check is a bonus
                print("make_tokenizer_fixtures: warning: transformers cross-check stopped: %s"
                      % e, file=sys.stderr)
                fast = None
        cases.append(case)
    rng = random.Random(seed)
    size = tok.get_vocab_size(with_added_tokens=True)
    decodes = []
    for i in range(300):
        n = rng.randint(1, 24)
        if i % 3 == 0:
            # Mostly low ids: bytes and byte-fallback tokens, in odd orders.
            ids = [rng.randrange(0, min(size, 300)) for _ in range(n)]
        else:
            ids = [rng.randrange(0, size) for _ in range(n)]
        decodes.append({"ids": ids,
                        "text": tok.decode(ids, skip_special_tokens=False),
                        "text_skip_special": tok.decode(ids, skip_special_tokens=True)})
    for text in mismatches:
        print("make_tokenizer_fixtures: warning: transformers differs from tokenizers on %r"
              % text[:60], file=sys.stderr)
    return {"vocab_size": size, "transformers_mismatches": len(mismatches), "encode": cases,
            "decode": decodes}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "tokenizers"),
                        help="where <name>/tokenizer.json and expected.json go")
    args = parser.parse_args()
    # The output folder beside this script is named tokenizers/: it must not
    # pass for the package.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    try:
        import tokenizers
        import tokenizers.trainers  # noqa: F401
        import tokenizers.pre_tokenizers  # noqa: F401
    except ImportError as e:
        fail("the Python package `tokenizers` is needed (pip install tokenizers, or a machine "
             "that has it): %s" % e)
    try:
        import transformers
    except ImportError:
        transformers = None
        print("make_tokenizer_fixtures: `transformers` is not installed: its cross-check is "
              "skipped", file=sys.stderr)
    if not hasattr(tokenizers.Tokenizer, "encode_special_tokens"):
        fail("tokenizers %s has no encode_special_tokens (0.15 or later is needed)"
             % tokenizers.__version__)

    corpus = training_corpus(seed=1)
    command = "python3 tests/data/llm/make_tokenizer_fixtures.py"
    if args.out != os.path.join(HERE, "tokenizers"):
        command += " --out " + args.out
    versions = {"tokenizers": tokenizers.__version__,
                "transformers": transformers.__version__ if transformers else None,
                "python": sys.version.split()[0]}
    for name, make in (("llama3_style", make_llama3), ("llama2_style", make_llama2),
                       ("mistral_style", make_mistral), ("qwen2_style", make_qwen2)):
        tok_json, specials = make(tokenizers, corpus)
        expected = expectations(tokenizers, transformers, tok_json, specials, seed=7)
        expected = dict({"name": name, "command": command, "versions": versions}, **expected)
        folder = os.path.join(args.out, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tok_json, f, ensure_ascii=False, indent=1)
            f.write("\n")
        with open(os.path.join(folder, "expected.json"), "w", encoding="utf-8") as f:
            json.dump(expected, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print("%s: %d tokens (with added), %d encode cases, %d decode cases -> %s"
              % (name, expected["vocab_size"], len(expected["encode"]),
                 len(expected["decode"]), folder))
    print("made by: %s (tokenizers %s, transformers %s)"
          % (command, versions["tokenizers"], versions["transformers"]))


if __name__ == "__main__":
    main()
