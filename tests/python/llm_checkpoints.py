"""Llama checkpoints for the transformers and llm_uvicorn tests: written by
examples/llm_uvicorn/make_checkpoint.py with random weights, in shards or in
one file, and what a store is given for them; and whether this interpreter
can run transformers at all."""

import json
import os
import pathlib
import subprocess
import sys

import hearth_testing as ht

# Checkpoints are written in several shards (HEARTH_TEST_SHARDED_CHECKPOINTS=0: one file).
SHARDED = os.environ.get("HEARTH_TEST_SHARDED_CHECKPOINTS", "1") != "0"

MAKE_CHECKPOINT = ht.ROOT / "examples" / "llm_uvicorn" / "make_checkpoint.py"
MIB = 1 << 20


def _missing():
    """Why the transformers tests cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed for this interpreter"
    if int(torch.__version__.split(".")[0]) < 2:
        return f"torch {torch.__version__} < 2 (transformers needs torch 2)"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed for this interpreter"
    return None


MISSING = _missing()


def make_checkpoint(directory, *args):
    proc = subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--out", str(directory), *args],
                          env=ht.child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"make_checkpoint.py failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def store_path(directory, summary):
    """What `hearth store --model` is given: the directory, or its one file."""
    if SHARDED:
        return str(directory)
    assert summary["safetensors"] == ["model.safetensors"], summary
    return str(pathlib.Path(directory) / "model.safetensors")
