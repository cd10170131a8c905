"""Export a PyTorch model as a model version of hearth's `aoti` backend.

    python3 -m hearth.aoti export my_model.py:build --example-input-shape 16,16384 \\
        --dynamic-batch 1..64 --out repo/mymodel/1/

writes

- `repo/mymodel/1/model.pt2`: the model compiled by AOTInductor
  (`torch.export.export`, then `torch._inductor.aoti_compile_and_package`) with
  `aot_inductor.package_constants_in_so=False` and no on-disk constants
  format: the package holds no copy of the weights, only code;
- `repo/mymodel/1/model.safetensors`: every constant the package expects, under
  the names its loader's `get_constant_fqns()` returns, contiguous, in the
  dtype and shape the package was compiled for. hearth's store loads this file
  once and every worker binds the package to the store's tensors
  (`load_constants(..., user_managed=true)`), so N workers share one copy;
- `repo/mymodel/config.yaml` (`backend: aoti`, inputs, outputs, batch size,
  instance group, and `parameters.standby_workers` from `--standby-workers`,
  default 1); an existing one is kept unless `--force`.

The package's metadata (`aot_inductor.metadata`, read in C++ by
`AOTIModelPackageLoader::get_metadata()`) carries hearth's view of it, every
value a string:

- `hearth.format`: "1";
- `hearth.inputs`, `hearth.outputs`: JSON lists, in call order, of
  `{"name", "data_type": "TYPE_FP32"..., "dims"}`, dims per row: without the
  batch dimension, -1 where another dimension is dynamic, `[]` for a tensor of
  shape [batch] (config.yaml says `[1]` there, as its dims cannot be empty);
- `hearth.batch`: JSON `{"dynamic": bool, "min": int, "max": int}`, the range
  the package accepts (torch.export's, which may be narrower than asked);
  a fixed batch has min = max = the example's;
- `hearth.constants`: JSON `{fqn: {"dtype": "F32"..., "shape": [...]}}`, the
  package's constants, which are exactly model.safetensors' tensors.

Every input and output has the batch as its first dimension. With
`--dynamic-batch MIN..MAX` it is a `torch.export.Dim("batch", min=MIN,
max=MAX)` shared by all inputs and config.yaml says `max_batch_size: MAX` with
per-row dims; without it the batch is fixed to the example's, and config.yaml
says `max_batch_size: 0` (hearth does not batch requests) with the whole shape,
batch included, as dims.

How the constants' names are found: they are predicted from the exported
program (the parameters, buffers and constants whose placeholders the graph
uses, one name for tensors that are one tensor, as AOTInductor dedups them)
before compiling, since the metadata is compiled in; then checked against the
constant table of the package's generated wrapper (`constants_info_[i]
.original_fqn`, what `get_constant_fqns()` returns), and compiled again under
the package's names if they differ. The Python loader is never called here
(it was seen crashing on some machines). Before export, tensors kept as plain
module attributes become non-persistent buffers, and a tensor created inside
forward makes the exporter export again with it as a buffer, so that every
constant is named by its module path (AOTInductor would otherwise name it
`_tensor_constantN`). Parameters and buffers are made contiguous: the stored
tensors are contiguous and the package must be compiled for that layout.

As a library: `hearth.aoti.export(module, out, example_input_shapes, ...)`.
Needs torch >= 2.6 (torch.export and AOTInductor packaging); `import
hearth.aoti` itself imports nothing heavy.
"""

import argparse
import contextlib
import ctypes
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import zipfile

__all__ = ["export", "ExportError", "unavailable_reason", "write_safetensors", "main"]

FORMAT = "1"
MAX_BATCH_SIZE = 4096  # hearth's limit on a config's max_batch_size
MAX_WORKERS = 256  # hearth's limit on instance_group.count
MAX_STANDBY_WORKERS = 8  # and on parameters.standby_workers
PACKAGE = "model.pt2"
WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"

# torch dtype name -> (safetensors name, Triton config name or None)
_DTYPES = {
    "float64": ("F64", "TYPE_FP64"),
    "float32": ("F32", "TYPE_FP32"),
    "float16": ("F16", "TYPE_FP16"),
    "bfloat16": ("BF16", "TYPE_BF16"),
    "int64": ("I64", "TYPE_INT64"),
    "int32": ("I32", "TYPE_INT32"),
    "int16": ("I16", "TYPE_INT16"),
    "int8": ("I8", "TYPE_INT8"),
    "uint8": ("U8", "TYPE_UINT8"),
    "bool": ("BOOL", "TYPE_BOOL"),
    "float8_e4m3fn": ("F8_E4M3", None),
    "float8_e5m2": ("F8_E5M2", None),
}
# What --dtype and --weights-dtype accept.
_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "int64": "int64", "int32": "int32", "bool": "bool",
}
_WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "float64")
# at::k* names in older generated wrappers.
_ATEN_DTYPES = {
    "Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "Double": "float64",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool", "Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2": "float8_e5m2",
}


class ExportError(Exception):
    """The model or the options cannot be exported; the message says why."""


def _size(nbytes):
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _say(message):
    print(f"hearth.aoti: {message}", file=sys.stderr, flush=True)


def _torch_version(torch):
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def unavailable_reason():
    """None if this interpreter's torch can export for hearth, else why not."""
    try:
        import torch
    except ImportError:
        return f"torch is not installed for {sys.executable}"
    if _torch_version(torch) < (2, 6):
        return (f"torch {torch.__version__} has no AOTInductor packaging "
                "(torch.export and torch._inductor.aoti_compile_and_package need torch >= 2.6)")
    try:
        import torch.export
        import torch._inductor
    except ImportError as e:
        return f"torch {torch.__version__}: {e}"
    if not hasattr(torch.export, "export") or not hasattr(torch._inductor,
                                                          "aoti_compile_and_package"):
        return f"torch {torch.__version__} lacks torch.export.export or aoti_compile_and_package"
    return None


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _config_type(dtype, what):
    name = _dtype_name(dtype)
    entry = _DTYPES.get(name)
    if entry is None or entry[1] is None:
        raise ExportError(f"{what} has dtype {name}, which a hearth config cannot name")
    return entry[1]


def _storage_key(tensor):
    """Equal for tensors AOTInductor stores as one constant (its is_same_tensor)."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype, tensor.device)


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


# ---- the model --------------------------------------------------------------


def _load_target(spec):
    """`path/to/file.py:name` or `package.module:name` -> (object, description)."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ExportError(f"{spec!r}: expected FILE.py:CALLABLE or MODULE:CALLABLE")
    if module_part.endswith(".py") or os.sep in module_part:
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise ExportError(f"{module_part}: no such file")
        # Its own directory first, as when it runs as a script: it may import
        # modules beside it.
        sys.path.insert(0, os.path.dirname(path))
        name = "_hearth_aoti_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise ExportError(f"{module_part} failed to import: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as e:
            raise ExportError(f"{module_part} failed to import: {type(e).__name__}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ExportError(f"{module_part} has no attribute {attr!r}") from None


def build_module(spec):
    """Calls the callable that `spec` names and returns its nn.Module (an
    nn.Module object named directly is taken as it is)."""
    import torch

    target = _load_target(spec)
    if isinstance(target, torch.nn.Module):
        return target
    if not callable(target):
        raise ExportError(f"{spec} is a {type(target).__name__}, not a callable")
    try:
        module = target()
    except Exception as e:
        raise ExportError(f"{spec}() raised {type(e).__name__}: {e}") from e
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"{spec}() returned {type(module).__name__}, not a torch.nn.Module")
    return module


def _prepare(torch, module, device, weights_dtype):
    """Plain tensor attributes become non-persistent buffers (so that they are
    named by their module path), then the module moves to `device` and
    `weights_dtype`, and every parameter and buffer is made contiguous."""
    for sub in module.modules():
        for attr, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                delattr(sub, attr)
                sub.register_buffer(attr, value, persistent=False)
    module = module.to(device)
    if weights_dtype is not None:
        module = module.to(weights_dtype)
    made = {}  # id(old buffer) -> contiguous copy, so buffers shared by modules stay shared
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None and not p.is_contiguous():
                p.data = p.data.contiguous()
        for attr, b in list(sub._buffers.items()):
            if b is not None and not b.is_contiguous():
                sub._buffers[attr] = made.setdefault(id(b), b.contiguous())
    return module.eval()


def _owner(root, fqn):
    *path, attr = fqn.split(".")
    owner = root
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def _constant_tensor_inputs(torch, ep):
    from torch.export.graph_signature import InputKind

    used = {n.name for n in ep.graph.nodes if n.op == "placeholder" and n.users}
    return [s.target for s in ep.graph_signature.input_specs
            if s.kind == InputKind.CONSTANT_TENSOR and s.arg.name in used
            and isinstance(ep.constants.get(s.target), torch.Tensor)]


def _export_program(torch, module, args, batch_dim, device):
    dynamic_shapes = None if batch_dim is None else tuple({0: batch_dim} for _ in args)
    try:
        ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    except Exception as e:
        raise ExportError(f"torch.export.export failed: {type(e).__name__}: {e}") from e
    literals = _constant_tensor_inputs(torch, ep)
    if not literals:
        return ep
    # Tensors made inside forward (torch.tensor(...)) are lifted as constants,
    # which AOTInductor renames _tensor_constantN. As buffers of the exported
    # module they keep their names; export that module again.
    kwargs = {"check_guards": False} if "check_guards" in inspect.signature(
        ep.module).parameters else {}
    gm = ep.module(**kwargs)
    for fqn in literals:
        owner, attr = _owner(gm, fqn)
        value = getattr(owner, attr)
        delattr(owner, attr)
        # On the model's device: a CPU scalar beside CUDA tensors would become
        # a device copy that AOTInductor names after the device.
        owner.register_buffer(attr, value.to(device), persistent=False)
    try:
        ep = torch.export.export(gm, args, dynamic_shapes=dynamic_shapes)
    except Exception as e:
        raise ExportError(
            f"forward creates tensors ({', '.join(literals)}) that AOTInductor would rename, "
            f"and exporting them as buffers failed ({type(e).__name__}: {e}); register them "
            "as buffers in the module's __init__") from e
    left = _constant_tensor_inputs(torch, ep)
    if left:
        raise ExportError(f"forward creates tensors ({', '.join(left)}) that AOTInductor would "
                          "rename; register them as buffers in the module's __init__")
    return ep


def _symbol(dim):
    node = getattr(dim, "node", None)
    return getattr(node, "expr", None) if node is not None else None


def _signature(torch, ep, shapes, input_names, output_names, batch_range):
    """The inputs' and outputs' specs, and the batch range the program accepts."""
    graph_signature = ep.graph_signature
    written = dict(graph_signature.buffers_to_mutate)
    written.update(getattr(graph_signature, "parameters_to_mutate", None) or {})
    if written:
        raise ExportError("forward writes " + ", ".join(sorted(written.values())) + "; hearth's "
                          "weights are read-only, shared by every worker")
    nodes = {n.name: n for n in ep.graph.nodes}
    user_inputs = [nodes[name] for name in graph_signature.user_inputs]
    if len(user_inputs) != len(shapes):
        raise ExportError(f"the exported program takes {len(user_inputs)} tensor inputs, "
                          f"but {len(shapes)} example shapes were given")
    batch = shapes[0][0]
    dynamic = batch_range is not None
    batch_symbol = _symbol(user_inputs[0].meta["val"].shape[0]) if dynamic else None
    lo, hi = (batch, batch)
    if dynamic:
        lo, hi = batch_range
        bounds = ep.range_constraints.get(batch_symbol) if batch_symbol is not None else None
        if bounds is None:
            raise ExportError("torch.export made the batch dimension static; the model's code "
                              "fixes its size")
        try:
            lo, hi = int(bounds.lower), min(int(bounds.upper), hi)
        except (TypeError, ValueError, OverflowError):
            lo = int(bounds.lower)
        if (lo, hi) != tuple(batch_range):
            _say(f"note: torch.export narrowed the batch range from {batch_range[0]}..."
                 f"{batch_range[1]} to {lo}..{hi}")

    def spec(what, name, val):
        if not isinstance(val, torch.Tensor):
            raise ExportError(f"{what} {name} is a {type(val).__name__}, not a tensor")
        shape = list(val.shape)
        if not shape:
            raise ExportError(f"{what} {name} is a scalar: every input and output needs the "
                              "batch as its first dimension")
        first = shape[0]
        batch_major = (_symbol(first) == batch_symbol) if dynamic else (first == batch)
        if not batch_major:
            raise ExportError(f"{what} {name} has shape {shape}, whose first dimension is not "
                              f"the batch ({'dynamic' if dynamic else batch}): hearth splits "
                              "batches along the first dimension of every input and output")
        dims = []
        for d in shape[1:]:
            if isinstance(d, int):
                if d == 0:
                    raise ExportError(f"{what} {name} has shape {shape}: a dimension of 0")
                dims.append(d)
            else:
                dims.append(-1)
        return {"name": name, "data_type": _config_type(val.dtype, f"{what} {name}"),
                "dims": dims}

    inputs = [spec("input", name, node.meta["val"])
              for name, node in zip(input_names, user_inputs)]
    outs = []
    for name in graph_signature.user_outputs:
        node = nodes.get(name) if name is not None else None
        if node is None:
            raise ExportError("the model returns something other than tensors (a constant or "
                              "None); AOTInductor packages return tensors only")
        outs.append(node.meta.get("val"))
    if output_names is None:
        output_names = ["output"] if len(outs) == 1 else [f"output__{i}" for i in range(len(outs))]
    elif len(output_names) != len(outs):
        raise ExportError(f"--output-names gives {len(output_names)} names, but the model "
                          f"returns {len(outs)} tensors")
    outputs = [spec("output", name, val) for name, val in zip(output_names, outs)]
    return inputs, outputs, {"dynamic": dynamic, "min": lo, "max": hi}


def _constant_pool(torch, module, ep):
    """Every name a constant of the program may go by -> its tensor."""
    pool = {}
    for name, t in module.named_parameters(remove_duplicate=False):
        pool[name] = t
    for name, t in module.named_buffers(remove_duplicate=False):
        pool[name] = t
    pool.update(ep.state_dict)
    pool.update((k, v) for k, v in ep.constants.items() if isinstance(v, torch.Tensor))
    return {name: t.detach() for name, t in pool.items()}


def _predicted_constants(torch, ep, pool):
    """The constants AOTInductor will keep, in graph order: the parameters,
    buffers and tensor constants whose placeholders have users, one name per
    tensor (the first)."""
    from torch.export.graph_signature import InputKind

    kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    used = {n.name for n in ep.graph.nodes if n.op == "placeholder" and n.users}
    constants, seen = {}, set()
    for s in ep.graph_signature.input_specs:
        if s.kind == InputKind.CUSTOM_OBJ:
            raise ExportError(f"the model holds a script object ({s.target}); hearth stores "
                              "tensors only")
        if s.kind not in kinds or s.arg.name not in used:
            continue
        t = pool.get(s.target)
        if t is None:
            raise ExportError(f"the exported program's constant {s.target} has no tensor")
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            constants[s.target] = t
    return constants


def _describe_constants(constants):
    return {name: {"dtype": _DTYPES[_dtype_name(t.dtype)][0], "shape": list(t.shape)}
            for name, t in sorted(constants.items())}


# ---- the package ------------------------------------------------------------

_MODEL_BASE = re.compile(r"AOTInductorModelBase\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,")
_CONSTANT_FIELD = re.compile(r"constants_info_\[(\d+)\]\.(\w+)\s*=\s*([^;\n]*);")


def _parse_braces(text):
    if text is None or not re.fullmatch(r"\{[\s\d,\-]*\}", text):
        return None
    inner = text.strip("{} ")
    return [int(x) for x in inner.split(",") if x.strip()] if inner else []


def _parse_dtype(text):
    if text is None:
        return None
    m = re.search(r"dtype_(\w+)", text)
    if m:
        return m.group(1)
    m = re.search(r"at::k(\w+)", text)
    return _ATEN_DTYPES.get(m.group(1)) if m else None


def package_constants(path):
    """The constants the package's model expects, read from the constant table
    of its generated wrapper (what AOTIModelPackageLoader::get_constant_fqns()
    returns, as it is compiled into the .so): [{"fqn", "dtype" (torch name or
    None), "shape", "stride", "from_folded"}], or None if the package holds no
    wrapper this can read."""
    with zipfile.ZipFile(path) as archive:
        wrappers = [n for n in archive.namelist()
                    if n.endswith(".wrapper.cpp") and "data/aotinductor/" in n]
        if len(wrappers) != 1:
            return None
        text = archive.read(wrappers[0]).decode("utf-8", "replace")
    base = _MODEL_BASE.search(text)
    if base is None:
        return None
    count = int(base.group(3))
    fields = {}
    for index, key, value in _CONSTANT_FIELD.findall(text):
        fields.setdefault(int(index), {})[key] = value.strip()
    if sorted(fields) != list(range(count)):
        return None
    table = []
    for i in range(count):
        f = fields[i]
        fqn = re.fullmatch(r'"(.*)"', f.get("original_fqn", ""))
        shape = _parse_braces(f.get("shape"))
        if fqn is None or shape is None:
            return None
        table.append({"fqn": fqn.group(1), "dtype": _parse_dtype(f.get("dtype")), "shape": shape,
                      "stride": _parse_braces(f.get("stride")),
                      "from_folded": f.get("from_folded") == "true"})
    return table


def _check_package(torch, path, metadata):
    """The package holds no copy of the weights and carries `metadata`."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        copies = [n for n in names if "/data/weights/" in "/" + n
                  or n.endswith(("_weights.blob", "weights_config.json"))]
        if copies:
            raise ExportError(f"torch {torch.__version__} put a copy of the weights in the "
                              f"package ({', '.join(copies)}) despite "
                              "package_constants_in_so=False")
        found = [n for n in names if n.endswith("_metadata.json") and "data/aotinductor/" in n]
        for n in found:
            stored = json.loads(archive.read(n))
            stale = [k for k, v in metadata.items() if stored.get(k) != v]
            if stale:
                raise ExportError(f"the package's {n} does not hold the metadata given to "
                                  f"the compiler ({', '.join(stale)} differ)")
    if not found:
        _say("warning: the package holds no *_metadata.json; could not check its metadata")


def _contiguous(shape, stride):
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _reconcile(table, constants, pool):
    """None if the package's table is `constants`; else the constants named as
    the package names them. Raises if the package wants a tensor we do not have."""
    problems, wanted = [], {}
    for entry in table:
        fqn = entry["fqn"]
        if entry["from_folded"]:
            problems.append(f"{fqn} is folded at load time (not a stored tensor)")
            continue
        t = pool.get(fqn)
        if t is None:
            problems.append(f"{fqn} ({entry['dtype']} {entry['shape']}) is no parameter, buffer "
                            "or constant of the exported program")
            continue
        if list(t.shape) != entry["shape"] or (entry["dtype"] and entry["dtype"] != _dtype_name(
                t.dtype)):
            problems.append(f"{fqn} is {entry['dtype']} {entry['shape']} in the package but "
                            f"{_dtype_name(t.dtype)} {list(t.shape)} in the program")
            continue
        if entry["stride"] is not None and not _contiguous(entry["shape"], entry["stride"]):
            problems.append(f"{fqn} has strides {entry['stride']} in the package: not contiguous")
            continue
        wanted[fqn] = t
    if problems:
        raise ExportError("the package's constants cannot be bound to stored tensors: "
                          + "; ".join(problems))
    if len(wanted) != len(table):
        raise ExportError("the package lists a constant twice: "
                          + ", ".join(e["fqn"] for e in table))
    if set(wanted) == set(constants):
        return None
    return wanted


def _compile(torch, ep, path, metadata):
    import torch._inductor

    aot = torch._inductor.config.aot_inductor
    configs = {
        # No constant in the .so and none beside it in the package: the store
        # holds the only copy (model.safetensors).
        "aot_inductor.package_constants_in_so": False,
        # Small tensors stay constants rather than being inlined as literals,
        # so that every constant is one of the stored tensors.
        "always_keep_tensor_constants": True,
        # Freezing would fold parameters into new constants of its own.
        "freezing": False,
        # inductor adds its device keys to this dict: give it a copy.
        "aot_inductor.metadata": dict(metadata),
    }
    if hasattr(aot, "package_constants_on_disk_format"):
        configs["aot_inductor.package_constants_on_disk_format"] = None
    elif hasattr(aot, "package_constants_on_disk"):
        configs["aot_inductor.package_constants_on_disk"] = False
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=configs)
    except Exception as e:
        raise ExportError(f"AOTInductor compilation failed: {type(e).__name__}: {e}") from e


def _metadata(inputs, outputs, batch, constants):
    compact = {"separators": (",", ":")}
    return {
        "hearth.format": FORMAT,
        "hearth.inputs": json.dumps(inputs, **compact),
        "hearth.outputs": json.dumps(outputs, **compact),
        "hearth.batch": json.dumps(batch, **compact),
        "hearth.constants": json.dumps(_describe_constants(constants), **compact),
    }


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


# ---- export -----------------------------------------------------------------


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


def _example_inputs(torch, shapes, dtypes, device):
    generator = torch.Generator().manual_seed(0)
    args = []
    for shape, dtype in zip(shapes, dtypes):
        if dtype.is_floating_point:
            args.append(torch.randn(shape, generator=generator, dtype=dtype).to(device))
        else:
            args.append(torch.zeros(shape, dtype=dtype, device=device))
    return tuple(args)


def _resolve_dtype(torch, text, allowed=None):
    name = _DTYPE_ALIASES.get(text)
    if name is None or (allowed is not None and name not in allowed):
        raise ExportError(f"unknown dtype {text!r} (one of "
                          + ", ".join(allowed or sorted(set(_DTYPE_ALIASES.values()))) + ")")
    return getattr(torch, name)


def export(module, out, example_input_shapes, *, dtypes=("float32",), weights_dtype=None,
           dynamic_batch=None, device=None, input_names=None, output_names=None, name=None,
           workers=1, force=False, source=None, standby_workers=1):
    """Exports nn.Module `module` as a hearth `aoti` model version in directory
    `out` (model.pt2, model.safetensors) and writes `out/../config.yaml`.

    example_input_shapes: one shape (a sequence of ints, batch first) per
    input. dtypes: one dtype name for every input or one per input.
    dynamic_batch: None (the batch is fixed to the example's) or (min, max).
    Returns {"package", "weights", "config": paths, "metadata": {...}}.
    Raises ExportError naming what is wrong; nothing is written then.
    """
    import torch

    reason = unavailable_reason()
    if reason:
        raise ExportError(reason)
    source = source or type(module).__name__
    shapes = [tuple(int(d) for d in s) for s in example_input_shapes]
    if not shapes:
        raise ExportError("give one example input shape per input (--example-input-shape)")
    for s in shapes:
        if not s or any(d < 1 for d in s):
            raise ExportError(f"example input shape {list(s)}: needs at least the batch "
                              "dimension, every dimension at least 1")
    batch = shapes[0][0]
    if any(s[0] != batch for s in shapes):
        raise ExportError("every input's first dimension is the batch: the example shapes' "
                          f"first dimensions differ ({', '.join(str(s[0]) for s in shapes)})")
    if dynamic_batch is not None:
        lo, hi = dynamic_batch
        if not 1 <= lo <= hi <= MAX_BATCH_SIZE:
            raise ExportError(f"--dynamic-batch {lo}..{hi}: needs 1 <= MIN <= MAX <= "
                              f"{MAX_BATCH_SIZE} (hearth's largest max_batch_size)")
        if not lo <= batch <= hi:
            raise ExportError(f"the example batch {batch} is outside --dynamic-batch {lo}..{hi}")
        if batch < 2:
            raise ExportError("torch.export specializes a dimension whose example size is 1: "
                              "give an example batch of at least 2 with --dynamic-batch")
    if isinstance(dtypes, str):
        dtypes = [dtypes]
    dtypes = [_resolve_dtype(torch, d) if isinstance(d, str) else d for d in dtypes]
    if len(dtypes) == 1:
        dtypes = dtypes * len(shapes)
    if len(dtypes) != len(shapes):
        raise ExportError(f"{len(dtypes)} input dtypes for {len(shapes)} inputs (give one, or "
                          "one per input)")
    if isinstance(weights_dtype, str):
        weights_dtype = _resolve_dtype(torch, weights_dtype, _WEIGHT_DTYPES)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ExportError(f"device {device}: cuda or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExportError("--device cuda, but torch sees no CUDA device")
    if input_names is None:
        input_names = ["input"] if len(shapes) == 1 else [f"input__{i}" for i in range(len(shapes))]
    if len(input_names) != len(shapes):
        raise ExportError(f"{len(input_names)} input names for {len(shapes)} inputs")
    for names in (input_names, output_names or []):
        if len(set(names)) != len(names) or not all(names):
            raise ExportError(f"names must be distinct and non-empty: {list(names)}")
    if not 1 <= workers <= MAX_WORKERS:
        raise ExportError(f"--workers {workers}: needs 1..{MAX_WORKERS}")
    if not 0 <= standby_workers <= MAX_STANDBY_WORKERS:
        raise ExportError(f"--standby-workers {standby_workers}: needs 0..{MAX_STANDBY_WORKERS}")

    out = os.path.abspath(out)
    paths, model_name = _version_paths(out, name, force)

    try:
        module = _prepare(torch, module, device, weights_dtype)
    except Exception as e:
        raise ExportError(f"moving the module to {device}"
                          + (f" and {_dtype_name(weights_dtype)}" if weights_dtype else "")
                          + f" failed: {type(e).__name__}: {e}") from e
    args = _example_inputs(torch, shapes, dtypes, device)
    batch_dim = None
    if dynamic_batch is not None:
        batch_dim = torch.export.Dim("batch", min=dynamic_batch[0], max=dynamic_batch[1])
    shape_text = " ".join(str(list(s)) for s in shapes)
    _say(f"exporting {source} on {device} with inputs {shape_text} "
         f"({', '.join(_dtype_name(d) for d in dtypes)}), batch "
         + (f"{dynamic_batch[0]}..{dynamic_batch[1]}" if dynamic_batch else f"fixed at {batch}"))
    ep = _export_program(torch, module, args, batch_dim, device)
    inputs, outputs, batch_info = _signature(torch, ep, shapes, list(input_names),
                                             list(output_names) if output_names else None,
                                             dynamic_batch)
    pool = _constant_pool(torch, module, ep)
    constants = _predicted_constants(torch, ep, pool)

    with _staging(out) as staging:
        # The package is written under its final file name, as the archive's
        # root folder is named after it.
        package = os.path.join(staging, PACKAGE)
        for attempt in (1, 2):
            _say("compiling with AOTInductor (this takes a while)")
            metadata = _metadata(inputs, outputs, batch_info, constants)
            _compile(torch, ep, package, metadata)
            _check_package(torch, package, metadata)
            table = package_constants(package)
            if table is None:
                _say("warning: could not check the constants' names against the package's "
                     "generated code; model.safetensors uses the names predicted from the "
                     "exported program")
                break
            renamed = _reconcile(table, constants, pool)
            if renamed is None:
                break
            if attempt == 2:
                raise ExportError("the package's constants still differ from its metadata "
                                  "after compiling again: " + ", ".join(sorted(renamed)))
            _say("note: the package names its constants otherwise than predicted ("
                 + ", ".join(sorted(set(renamed) ^ set(constants))) + "); compiling again "
                 "with its names in the metadata")
            constants = renamed
        total = sum(t.numel() * t.element_size() for t in constants.values())
        _say(f"writing {len(constants)} constants of {_size(total)} to {paths['weights']}")
        weights = os.path.join(staging, WEIGHTS)
        write_safetensors(weights, constants, {"format": "pt"})
        config = os.path.join(staging, CONFIG)
        kind = "KIND_GPU" if device.type == "cuda" else "KIND_CPU"
        with open(config, "w") as f:
            f.write(_config_yaml(model_name, inputs, outputs, batch_info, kind, workers, source,
                                 standby_workers))
        _place(weights, paths["weights"], force)
        _place(package, paths["package"], force)
        _place(config, paths["config"], force)
    size = os.path.getsize(paths["package"])
    _say(f"wrote {paths['package']} ({_size(size)}, no weights), {paths['weights']}, "
         f"{paths['config']}")
    return dict(paths, metadata=metadata)


# ---- command line -----------------------------------------------------------


def _shape(text):
    try:
        dims = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape: comma-separated positive integers, batch first") from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r}: every dimension must be at least 1")
    return tuple(dims)


def _range(text):
    m = re.fullmatch(r"(\d+)\.\.(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN..MAX (e.g. 1..64)")
    lo, hi = int(m.group(1)), int(m.group(2))
    if not 1 <= lo <= hi <= MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 1 <= MIN <= MAX <= {MAX_BATCH_SIZE}")
    return lo, hi


def _names(text):
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: empty name")
    return names


def _parser():
    parser = argparse.ArgumentParser(
        prog="python3 -m hearth.aoti",
        description="Compile a PyTorch model with AOTInductor into a model version of "
                    "hearth's aoti backend.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    e = commands.add_parser(
        "export", help="export an nn.Module as model.pt2 + model.safetensors + config.yaml",
        description="Exports the nn.Module that MODEL returns: OUT/model.pt2 (the compiled "
                    "package, without weights), OUT/model.safetensors (its constants, under the "
                    "package's names) and OUT/../config.yaml.",
        epilog="example: python3 -m hearth.aoti export my_model.py:build "
               "--example-input-shape 16,16384 --dynamic-batch 1..64 --out repo/mymodel/1/")
    e.add_argument("model", metavar="MODEL",
                   help="FILE.py:CALLABLE or MODULE:CALLABLE, called with no arguments, "
                        "returning a torch.nn.Module (on any device)")
    e.add_argument("--example-input-shape", type=_shape, action="append", required=True,
                   metavar="B,D1,...", dest="shapes",
                   help="an example input's shape, batch first; once per input, in call order")
    e.add_argument("--dtype", action="append", metavar="DTYPE", dest="dtypes",
                   help="the inputs' dtype: float32 (default), float16, bfloat16, float64, "
                        "int64, int32 or bool; once for all inputs or once per input")
    e.add_argument("--weights-dtype", metavar="DTYPE",
                   help="cast the module's floating parameters and buffers to float32, "
                        "float16 or bfloat16 (default: as built)")
    e.add_argument("--dynamic-batch", type=_range, metavar="MIN..MAX",
                   help="make the batch dimension of every input dynamic in MIN..MAX "
                        "(config: max_batch_size MAX); without it the batch is fixed to the "
                        "example's (config: max_batch_size 0, whole shapes as dims)")
    e.add_argument("--device", help="cuda or cpu (default: cuda if torch sees one)")
    e.add_argument("--input-names", type=_names, metavar="A,B,...",
                   help="default: input (one input) or input__0, input__1, ...")
    e.add_argument("--output-names", type=_names, metavar="A,B,...",
                   help="default: output (one output) or output__0, output__1, ...")
    e.add_argument("--name", help="the model's name in config.yaml; must be, and defaults to, "
                                  "the name of OUT's parent directory")
    e.add_argument("--workers", type=int, default=1, metavar="N",
                   help="instance_group count (default 1)")
    e.add_argument("--standby-workers", type=int, default=1, metavar="N",
                   help="parameters.standby_workers: processes kept with libtorch loaded, that "
                        "replace a worker that dies (default 1; 0: none)")
    e.add_argument("--out", required=True, metavar="OUT",
                   help="the version directory, e.g. repo/mymodel/1/")
    e.add_argument("--force", action="store_true",
                   help="replace existing model.pt2, model.safetensors and config.yaml")
    e.add_argument("--traceback", action="store_true", help="on failure, show the traceback")
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        reason = unavailable_reason()
        if reason:
            raise ExportError(reason)
        module = build_module(args.model)
        export(module, args.out, args.shapes, dtypes=args.dtypes or ["float32"],
               weights_dtype=args.weights_dtype, dynamic_batch=args.dynamic_batch,
               device=args.device, input_names=args.input_names,
               output_names=args.output_names, name=args.name, workers=args.workers,
               standby_workers=args.standby_workers,
               force=args.force, source=args.model)
    except ExportError as e:
        if args.traceback:
            raise
        print(f"hearth.aoti: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
