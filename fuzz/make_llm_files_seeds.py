#!/usr/bin/env python3
"""Writes fuzz/seeds/llm_files/: inputs for llm_files_fuzzer.

Each seed is a case byte, then a file's text:
  0 config.json: the published configs quoted in tests/backends/llm/llm_config_test.cc;
  1 generation_config.json: the published ones quoted there;
  2 tokenizer.json: tests/data/llm/byte_level_tiny.json and sentencepiece_tiny.json;
  3 tokenizer_config.json: each template of tests/data/llm/templates/*.jinja as
    "chat_template", and one list of named templates.
Named by their SHA-1.

    python3 fuzz/make_llm_files_seeds.py
"""

import hashlib
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "llm"
CONFIG_TEST = ROOT / "tests" / "backends" / "llm" / "llm_config_test.cc"
OUT = ROOT / "fuzz" / "seeds" / "llm_files"


def main():
    seeds = []
    quoted = re.findall(r'constexpr std::string_view (k\w+) = R"\((.*?)\)";',
                        CONFIG_TEST.read_text(encoding="utf-8"), re.S)
    for name, text in quoted:
        seeds.append((1 if name.endswith("Generation") else 0, text))
    for name in ("byte_level_tiny.json", "sentencepiece_tiny.json"):
        seeds.append((2, (DATA / name).read_text(encoding="utf-8")))
    templates = sorted((DATA / "templates").glob("*.jinja"))
    for path in templates:
        seeds.append((3, json.dumps({
            "add_bos_token": True,
            "bos_token": "<s>",
            "eos_token": {"content": "</s>", "lstrip": False},
            "chat_template": path.read_text(encoding="utf-8"),
        }, indent=2)))
    seeds.append((3, json.dumps({
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "default", "template": templates[0].read_text(encoding="utf-8")},
            {"name": "tool_use", "template": "{{ tools | tojson }}{{ messages[0]['content'] }}"},
        ],
    })))
    if len([s for s in seeds if s[0] in (0, 1)]) < 4:
        raise SystemExit(f"{CONFIG_TEST}: the quoted configs were not found")
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    for case, text in seeds:
        data = bytes([case]) + text.encode("utf-8")
        (OUT / hashlib.sha1(data).hexdigest()).write_bytes(data)
    print(f"{len(seeds)} seeds in {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
