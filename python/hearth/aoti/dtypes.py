"""torch dtypes by the names safetensors, hearth's config and the command line
give them."""

from .messages import ExportError

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
    "uint16": ("U16", "TYPE_UINT16"),
    "uint32": ("U32", "TYPE_UINT32"),
    "uint64": ("U64", "TYPE_UINT64"),
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


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _config_type(dtype, what):
    name = _dtype_name(dtype)
    entry = _DTYPES.get(name)
    if entry is None or entry[1] is None:
        raise ExportError(f"{what} has dtype {name}, which a hearth config cannot name")
    return entry[1]


def _resolve_dtype(torch, text, allowed=None):
    name = _DTYPE_ALIASES.get(text)
    if name is None or (allowed is not None and name not in allowed):
        raise ExportError(f"unknown dtype {text!r} (one of "
                          + ", ".join(allowed or sorted(set(_DTYPE_ALIASES.values()))) + ")")
    return getattr(torch, name)
