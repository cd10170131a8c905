"""Writes a model repository entry serving the tiny decoder (model.py beside this file).

    python3 make_repository.py REPO [--name tiny_decoder] [--workers 2] [--kind KIND_CPU]
                               [--max-streams 16]

REPO/<name>/config.yaml (backend: python, decoupled; max_streams, the
streams a worker decodes at once, and resumable: a stream a dead worker had
in flight goes on in another from the token ids it had sent) and
REPO/<name>/1/ holding model.py, config.json (the module's sizes) and
model.safetensors: deterministic weights (torch's generator seeded with
--seed), written from safetensors' definition (no safetensors package
needed). The weights are random, so the text is gibberish, but the same
gibberish for the same seed. The output layer's bias favours printable
ASCII, so that what the untrained model writes can be read (and each
character is one token).

Needs torch (Debian's 1.13 is enough).
"""

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent

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

_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64"}


def write_safetensors(path, tensors):
    """{name: torch.Tensor} as a safetensors file: an 8-byte header length,
    the JSON header (names, dtypes, shapes, offsets), then the bytes."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        raw = t.numpy().tobytes()
        header[name] = {"dtype": _DTYPES[str(t.dtype).replace("torch.", "")],
                        "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def model_module():
    """model.py beside this file, imported once under a name of its own."""
    name = "hearth_tiny_decoder_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "model.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def make_weights(config, seed):
    """The decoder's state dict: torch's default initialisation under `seed`,
    embeddings scaled up (peaked, context-dependent logits) and the output
    bias favouring printable ASCII and newline."""
    import torch
    tiny = model_module()
    EOS, TinyDecoder = tiny.EOS, tiny.TinyDecoder

    torch.manual_seed(seed)
    decoder = TinyDecoder.from_config(config)
    with torch.no_grad():
        decoder.tok.weight.mul_(0.5)
        decoder.pos.weight.mul_(0.1)
        decoder.head.weight.mul_(4.0)
        bias = torch.full((decoder.head.bias.shape[0],), -12.0)
        bias[0x20:0x7F] = 0.0
        bias[ord("\n")] = -1.0
        bias[EOS] = -3.0
        decoder.head.bias.copy_(bias)
    return decoder.state_dict()


def write(repo, name="tiny_decoder", workers=2, kind="KIND_CPU", python=None, seed=0,
          dim=64, layers=2, heads=4, max_positions=512, parameters=(), inputs=("text_input",),
          max_streams=16, dtype="float32"):
    """Writes REPO/<name>; returns the version directory. dtype: the
    weights' (float64 makes a batch of streams pick exactly what each picks
    alone: their reduction orders differ by ~1e-14, not ~1e-6)."""
    version = pathlib.Path(repo) / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    config = {"dim": dim, "layers": layers, "heads": heads, "max_positions": max_positions}
    (version / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    import torch
    weights = {k: v.to(getattr(torch, dtype)) for k, v in make_weights(config, seed).items()}
    write_safetensors(version / "model.safetensors", weights)
    shutil.copy(HERE / "model.py", version / "model.py")
    # resumable needs the token_ids output, which CONFIG always declares.
    entries = {"python": python or sys.executable, "torch_threads": "1",
               "max_streams": max_streams, "resumable": "true", **dict(parameters)}
    lines = "".join(f"  {k}: {json.dumps(str(v))}\n" for k, v in entries.items())
    # Both: each optional, a request gives one of them (a prompt or a chat).
    optional = ", optional: true" if len(inputs) > 1 else ""
    declared = "".join(f"  - {{name: {name}, data_type: TYPE_STRING, dims: [1]{optional}}}\n"
                       for name in inputs)
    (version.parent / "config.yaml").write_text(CONFIG.format(workers=workers, kind=kind,
                                                              inputs=declared, parameters=lines))
    return version


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("repo")
    p.add_argument("--name", default="tiny_decoder")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kind", default="KIND_CPU", choices=["KIND_CPU", "KIND_GPU"])
    p.add_argument("--python", help="the workers' interpreter (default: this one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--max-streams", type=int, default=16,
                   help="the streams a worker decodes at once, one forward for them all")
    p.add_argument("--inputs", default="text_input",
                   help="the inputs to declare, comma-separated: text_input (a prompt: /v1/completions, "
                        "generate), messages (a chat: /v1/chat/completions), or both (every request "
                        "declares both optional: a request gives one or the other)")
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
    version = write(a.repo, a.name, a.workers, a.kind, a.python, a.seed, a.dim, a.layers,
                    a.heads, a.max_positions, extra, inputs, a.max_streams)
    print(f"wrote {version.parent}: hearth serve --model-repository {os.path.abspath(a.repo)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
