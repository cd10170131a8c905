"""The package's constants: which tensors they are and under which names.

They are predicted from the exported program before compiling (the metadata is
compiled in), then read back from the constant table of the package's
generated wrapper and reconciled with the prediction."""

import re
import zipfile

from .dtypes import _DTYPES, _dtype_name
from .messages import ExportError


# ---- predicted from the exported program ------------------------------------


def _storage_key(tensor):
    """Equal for tensors AOTInductor stores as one constant (its is_same_tensor)."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype, tensor.device)


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


# ---- read from the package --------------------------------------------------

# at::k* names in older generated wrappers.
_ATEN_DTYPES = {
    "Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "Double": "float64",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool", "Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2": "float8_e5m2",
}
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


# ---- reconciled -------------------------------------------------------------


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
