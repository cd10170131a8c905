#!/usr/bin/env python3
"""Writes fuzz/seeds/chat_template/: inputs for chat_template_fuzzer.

Each seed is a template's source: the real chat templates of
tests/data/llm/templates/*.jinja and the template of every case of
tests/data/llm/templates/language_cases.json, named by their SHA-1.

    python3 fuzz/make_template_seeds.py
"""

import hashlib
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests" / "data" / "llm" / "templates"
OUT = ROOT / "fuzz" / "seeds" / "chat_template"


def main():
    sources = [p.read_text(encoding="utf-8") for p in sorted(TEMPLATES.glob("*.jinja"))]
    cases = json.loads((TEMPLATES / "language_cases.json").read_text(encoding="utf-8"))
    sources += [case["template"] for case in cases]
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    names = set()
    for source in sources:
        data = source.encode("utf-8")
        name = hashlib.sha1(data).hexdigest()
        if name not in names:
            names.add(name)
            (OUT / name).write_bytes(data)
    print(f"{len(names)} seeds in {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
