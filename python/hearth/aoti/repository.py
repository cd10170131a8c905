"""A model version in a hearth repository: where its files go, model.safetensors
and config.yaml written, and the files moved into place only once all are
written."""

import contextlib
import ctypes
import json
import os
import shutil
import struct
import sys
import tempfile

from .dtypes import _DTYPES, _dtype_name
from .messages import ExportError, _say

MAX_BATCH_SIZE = 4096  # hearth's limit on a config's max_batch_size
MAX_WORKERS = 256  # hearth's limit on instance_group.count
MAX_STANDBY_WORKERS = 8  # and on parameters.standby_workers
PACKAGE = "model.pt2"
WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"


# ---- safetensors ------------------------------------------------------------


def _raw_bytes(tensor):
    """A buffer over the bytes of a contiguous CPU tensor (no copy; keep tensor alive)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return b""
    return (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())


def _write_safetensors_builtin(path, tensors, metadata):
    """The safetensors format from its definition: an 8-byte little-endian header
    length, the JSON header (padded with spaces to 8 bytes), then every tensor's
    bytes back to back, no gaps. Larger elements first, so that each tensor
    starts aligned to its element size."""
    if sys.byteorder != "little":
        raise ExportError("safetensors is little-endian; this machine is not")
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[_dtype_name(t.dtype)][0], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            f.write(_raw_bytes(tensors[name]))


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: torch.Tensor} to `path` as safetensors (any device; copied to
    host as needed): with the `safetensors` package if it is importable, else
    with the writer above. Returns which wrote it ("safetensors" or "builtin")."""
    for name, t in tensors.items():
        entry = _DTYPES.get(_dtype_name(t.dtype))
        if entry is None:
            raise ExportError(f"constant {name} has dtype {_dtype_name(t.dtype)}, "
                              "which safetensors (as hearth reads it) cannot hold")
    host, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach()
        copy = t.device.type != "cpu"
        if not copy:
            # The safetensors package refuses tensors that share storage, and
            # a view must not drag its whole storage along.
            storage = t.untyped_storage()
            key = storage.data_ptr()
            copy = key in seen or storage.nbytes() != t.numel() * t.element_size()
            seen.add(key)
        host[name] = t.to("cpu", copy=True).contiguous() if copy else t.contiguous()
    try:
        from safetensors.torch import save_file
    except ImportError:
        _write_safetensors_builtin(path, host, metadata)
        return "builtin"
    save_file(host, path, metadata=dict(metadata) if metadata else None)
    return "safetensors"


# ---- config.yaml ------------------------------------------------------------


def _config_yaml(name, inputs, outputs, batch, kind, workers, source, standby_workers=1):
    def io(spec):
        dims = spec["dims"]
        if batch["dynamic"]:
            dims = dims or [1]  # a config's dims cannot be empty: [batch] is [batch, 1]
        else:
            dims = [batch["max"]] + dims
        return (f"  - {{name: {json.dumps(spec['name'])}, data_type: {spec['data_type']}, "
                f"dims: {json.dumps(dims)}}}")

    lines = [f"# Written by `python3 -m hearth.aoti export` from {source}.",
             f"name: {json.dumps(name)}",
             "backend: aoti"]
    if batch["dynamic"]:
        lines.append(f"max_batch_size: {batch['max']}  # the package takes batches of "
                     f"{batch['min']}..{batch['max']} rows")
    else:
        lines.append(f"max_batch_size: 0  # the package takes exactly {batch['max']} rows: "
                     "requests are not batched")
    lines.append("input:")
    lines += [io(s) for s in inputs]
    lines.append("output:")
    lines += [io(s) for s in outputs]
    lines.append("instance_group:")
    lines.append(f"  - {{count: {workers}, kind: {kind}}}")
    if standby_workers:
        lines.append("# Workers started ahead of need, libtorch loaded: a replacement for one that")
        lines.append("# dies skips that load. Host memory only.")
        lines.append(f"parameters: {{standby_workers: '{standby_workers}'}}")
    return "\n".join(lines) + "\n"


# ---- the version directory --------------------------------------------------


def _version_paths(out, name, force):
    """({"package", "weights", "config": path}, the model's name) for the
    version directory `out` (absolute): the model is named after out's parent.
    Refuses a `name` that differs and, without `force`, files that exist."""
    model_dir = os.path.dirname(out)
    model_name = os.path.basename(model_dir)
    if name is not None and name != model_name:
        raise ExportError(f"--name {name!r} differs from the model directory's name "
                          f"{model_name!r}; hearth serve refuses such a config")
    if not os.path.basename(out).isdigit():
        _say(f"note: hearth serve finds versions in numeric directories; {out} is not one")
    paths = {"package": os.path.join(out, PACKAGE), "weights": os.path.join(out, WEIGHTS),
             "config": os.path.join(model_dir, CONFIG)}
    if not force:
        existing = [p for p in paths.values() if os.path.lexists(p)]
        if existing:
            raise ExportError(", ".join(existing) + " already exist" + (
                "s" if len(existing) == 1 else "") + "; --force replaces them")
    return paths, model_name


@contextlib.contextmanager
def _staging(out):
    """Makes the version directory `out` (absolute) and yields a private
    directory inside it, removed on leaving; on an exception, the directories
    made here are removed too."""
    created = out  # the outermost directory this call makes, removed if it fails
    while not os.path.isdir(os.path.dirname(created)):
        created = os.path.dirname(created)
    created = None if os.path.isdir(created) else created
    os.makedirs(out, exist_ok=True)
    # Everything is written in a private directory inside OUT and then moved
    # into place, so that a failure leaves nothing behind.
    staging = tempfile.mkdtemp(prefix=".hearth-aoti-", dir=out)
    try:
        yield staging
    except BaseException:
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _place(temporary, destination, replace):
    """Moves `temporary` to `destination`; without `replace`, never over a file
    that exists (a link fails if the name does)."""
    if replace:
        os.replace(temporary, destination)
        return
    try:
        os.link(temporary, destination)
    except FileExistsError:
        raise ExportError(f"{destination} exists (it appeared meanwhile); --force replaces it") \
            from None
    except OSError:  # no hard links here (or another file system): check, then move
        if os.path.lexists(destination):
            raise ExportError(f"{destination} exists (it appeared meanwhile); --force replaces "
                              "it") from None
        shutil.move(temporary, destination)
        return
    os.unlink(temporary)
