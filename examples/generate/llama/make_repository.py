"""Writes a model repository entry serving a Llama-architecture checkpoint through model.py.

    python3 make_repository.py REPO [--checkpoint DIR] [--name llama] [--workers 4] [--kind KIND_GPU]

REPO/<name>/config.yaml (backend: python, decoupled) and REPO/<name>/1/, the
version directory: a Hugging Face checkpoint directory with model.py beside
it. With --checkpoint, the checkpoint's files (config.json, the safetensors
and their index, generation_config.json, the tokenizer files) are linked
into it (symbolic links; --copy copies them); without, a checkpoint with
random weights is made there, offline, by examples/llm_uvicorn/make_checkpoint.py
(its arguments after `--`, e.g. `-- --hidden 2048 --layers 16` for about 1 B
parameters), and its tokenizer is given a small chat template.

Needs torch >= 2 and transformers to make a checkpoint; none to link one.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
MAKE_CHECKPOINT = HERE.parent.parent / "llm_uvicorn" / "make_checkpoint.py"

# For checkpoints whose tokenizer has none (make_checkpoint.py's): one line
# per message, then the assistant's turn.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")

CONFIG = """backend: python
max_batch_size: 0
model_transaction_policy: {{decoupled: true}}
input:
{inputs}output:
  - {{name: text_output, data_type: TYPE_STRING, dims: [1]}}
  - {{name: prompt_tokens, data_type: TYPE_INT64, dims: [1]}}
  - {{name: completion_tokens, data_type: TYPE_INT64, dims: [1]}}
  - {{name: finish_reason, data_type: TYPE_STRING, dims: [1]}}
  - {{name: token_ids, data_type: TYPE_INT64, dims: [-1]}}
instance_group:
  - {{count: {workers}, kind: {kind}}}
parameters:
{parameters}"""


def _make_checkpoint(version, extra, dtype=None):
    spec = importlib.util.spec_from_file_location("make_checkpoint", MAKE_CHECKPOINT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.main(["--out", str(version), *extra]) != 0:
        raise SystemExit("make_checkpoint.py failed")
    import transformers
    if dtype is not None:
        _resave(version, dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(version), local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(str(version))


def _resave(version, dtype):
    """Writes the checkpoint's weights again in `dtype` (a torch dtype's name)."""
    import torch
    import transformers
    major_minor = tuple(int("".join(c for c in part if c.isdigit()) or 0)
                        for part in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if major_minor >= (4, 56) else "torch_dtype"  # renamed in 4.56
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(version), local_files_only=True, **{dtype_key: getattr(torch, dtype)})
    for old in version.glob("model*.safetensors*"):
        old.unlink()
    model.save_pretrained(str(version))


def _link_checkpoint(version, checkpoint, copy):
    checkpoint = pathlib.Path(checkpoint).resolve()
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"{checkpoint}: no config.json (a Hugging Face checkpoint directory)")
    for f in sorted(checkpoint.iterdir()):
        if not f.is_file() or f.name == "model.py":
            continue
        target = version / f.name
        if target.exists() or target.is_symlink():
            target.unlink()
        if copy:
            shutil.copy(f, target)
        else:
            target.symlink_to(f)


def write(repo, name="llama", workers=4, kind="KIND_GPU", python=None, checkpoint=None, copy=False,
          make_args=(), parameters=(), inputs=("text_input",), max_streams=64, dtype=None):
    """Writes REPO/<name>; returns the version directory. `dtype` ("float32",
    ...) writes a checkpoint made here in that dtype rather than bf16."""
    version = pathlib.Path(repo) / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    if checkpoint:
        if dtype is not None:
            raise ValueError("dtype applies to a checkpoint made here, not to --checkpoint's")
        _link_checkpoint(version, checkpoint, copy)
    else:
        _make_checkpoint(version, list(make_args), dtype)
    shutil.copy(HERE / "model.py", version / "model.py")
    entries = {"python": python or sys.executable, "max_streams": max_streams, "resumable": "true",
               **dict(parameters)}
    lines = "".join(f"  {k}: {json.dumps(str(v))}\n" for k, v in entries.items())
    declared = "".join(f"  - {{name: {name}, data_type: TYPE_STRING, dims: [1]}}\n"
                       for name in inputs)
    (version.parent / "config.yaml").write_text(CONFIG.format(workers=workers, kind=kind,
                                                              inputs=declared, parameters=lines))
    return version


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    make_args = []
    if "--" in argv:
        make_args = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("repo")
    p.add_argument("--name", default="llama")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--kind", default="KIND_GPU", choices=["KIND_CPU", "KIND_GPU"])
    p.add_argument("--python", help="the workers' interpreter (default: this one)")
    p.add_argument("--checkpoint", help="a Hugging Face checkpoint directory to serve")
    p.add_argument("--copy", action="store_true", help="copy the checkpoint's files, not link them")
    p.add_argument("--max-streams", type=int, default=64,
                   help="the streams each worker decodes together (its KV cache's rows)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the dtype of a checkpoint made here (default: make_checkpoint.py's bf16)")
    p.add_argument("--inputs", default="text_input",
                   help="the inputs to declare, comma-separated: text_input (a prompt: /v1/completions, "
                        "generate), messages (a chat: /v1/chat/completions), or both (every request "
                        "must then give both)")
    p.add_argument("--parameter", action="append", default=[], metavar="KEY=VALUE",
                   help="another entry of the config's parameters (repeatable)")
    a = p.parse_args(argv)
    extra = []
    for item in a.parameter:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--parameter {item!r}: give KEY=VALUE")
        extra.append((key, value))
    inputs = a.inputs.split(",")
    if not inputs or not set(inputs) <= {"text_input", "messages"} or len(set(inputs)) != len(inputs):
        p.error(f"--inputs {a.inputs!r}: text_input, messages, or both, comma-separated")
    if a.max_streams < 1:
        p.error(f"--max-streams {a.max_streams}: at least 1")
    if a.dtype and a.checkpoint:
        p.error("--dtype applies to a checkpoint made here, not to --checkpoint's")
    version = write(a.repo, a.name, a.workers, a.kind, a.python, a.checkpoint, a.copy, make_args,
                    extra, inputs, a.max_streams, a.dtype)
    print(f"wrote {version.parent}: hearth serve --model-repository {os.path.abspath(a.repo)} "
          f"--device {'cuda' if a.kind == 'KIND_GPU' else 'cpu'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
