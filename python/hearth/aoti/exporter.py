"""export(): an nn.Module through torch.export and AOTInductor into a model
version (see the package's docstring for what it writes)."""

import inspect
import json
import os
import re
import sys
import zipfile

from .constants import (_constant_pool, _describe_constants, _predicted_constants,
                        _reconcile, package_constants)
from .dtypes import _WEIGHT_DTYPES, _config_type, _dtype_name, _resolve_dtype
from .messages import ExportError, _say
from .repository import (CONFIG, MAX_BATCH_SIZE, MAX_STANDBY_WORKERS, MAX_WORKERS, PACKAGE,
                         WEIGHTS, _config_yaml, _place, _staging, _version_paths,
                         write_safetensors)

FORMAT = "1"


def _size(nbytes):
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"



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


# ---- the program ------------------------------------------------------------


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


# ---- the package ------------------------------------------------------------


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


# ---- export -----------------------------------------------------------------


def _example_inputs(torch, shapes, dtypes, device):
    generator = torch.Generator().manual_seed(0)
    args = []
    for shape, dtype in zip(shapes, dtypes):
        if dtype.is_floating_point:
            args.append(torch.randn(shape, generator=generator, dtype=dtype).to(device))
        else:
            args.append(torch.zeros(shape, dtype=dtype, device=device))
    return tuple(args)


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
