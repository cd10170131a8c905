"""Loads libhearth (the C ABI in include/hearth/hearth.h) through ctypes.

Nothing here runs at import time: the library is found and loaded on the
first call to `library()`, so `import hearth` works without it.
"""

import ctypes
import ctypes.util
import os
import pathlib
import threading

# enum hearth_status
OK = 0
ERROR_INVALID_ARGUMENT = -1
ERROR_NOT_FOUND = -2
ERROR_PERMISSION_DENIED = -3
ERROR_UNAVAILABLE = -4
ERROR_RESOURCE_EXHAUSTED = -5
ERROR_INTERNAL = -6

# enum hearth_device_type
DEVICE_CPU = 0
DEVICE_CUDA = 1


class TensorInfo(ctypes.Structure):
    """struct hearth_tensor_info; pointers in it belong to the attachment."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_int32),
        ("dtype_name", ctypes.c_char_p),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("data", ctypes.c_void_p),
        ("offset", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("device_type", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
    ]


class AttachOptions(ctypes.Structure):
    """struct hearth_attach_options (ABI version 2)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("socket_path", ctypes.c_char_p),
        ("trusted_store_uids", ctypes.POINTER(ctypes.c_uint32)),
        ("trusted_store_uid_count", ctypes.c_size_t),
    ]


_lock = threading.Lock()
_lib = None


def _repository_library():
    # python/hearth/_capi.py -> repository root is three levels up.
    root = pathlib.Path(__file__).resolve().parent.parent.parent
    return root / "build" / "src" / "capi" / "libhearth.so"


def candidates():
    """The places searched for libhearth, in order, as (source, path) pairs.

    An explicit $HEARTH_LIBRARY is the only candidate: a broken setting is
    reported rather than silently replaced by another build.
    """
    env = os.environ.get("HEARTH_LIBRARY")
    if env:
        return [("$HEARTH_LIBRARY", env)]
    found = []
    repo = _repository_library()
    if repo.exists():
        found.append(("repository build", str(repo)))
    system = ctypes.util.find_library("hearth")
    if system:
        found.append(("system library path", system))
    return found


def _declare(lib):
    c = ctypes
    handle = c.c_void_p
    lib.hearth_abi_version.argtypes = []
    lib.hearth_abi_version.restype = c.c_int32
    lib.hearth_attach.argtypes = [c.c_char_p, c.c_char_p, c.c_uint64, c.POINTER(handle)]
    lib.hearth_attach.restype = c.c_int32
    # ABI version 2; an older library lacks it (has_attach_options() says so).
    if hasattr(lib, "hearth_attach_with_options"):
        lib.hearth_attach_with_options.argtypes = [c.POINTER(AttachOptions), c.c_char_p,
                                                   c.c_uint64, c.POINTER(handle)]
        lib.hearth_attach_with_options.restype = c.c_int32
    lib.hearth_tensor_count.argtypes = [handle]
    lib.hearth_tensor_count.restype = c.c_size_t
    lib.hearth_tensor_info_at.argtypes = [handle, c.c_size_t, c.POINTER(TensorInfo)]
    lib.hearth_tensor_info_at.restype = c.c_int32
    lib.hearth_tensor_info_by_name.argtypes = [handle, c.c_char_p, c.POINTER(TensorInfo)]
    lib.hearth_tensor_info_by_name.restype = c.c_int32
    lib.hearth_model_name.argtypes = [handle]
    lib.hearth_model_name.restype = c.c_char_p
    lib.hearth_model_version.argtypes = [handle]
    lib.hearth_model_version.restype = c.c_uint64
    lib.hearth_checksum.argtypes = [handle]
    lib.hearth_checksum.restype = c.c_uint64
    lib.hearth_device_type.argtypes = [handle]
    lib.hearth_device_type.restype = c.c_int32
    lib.hearth_device_index.argtypes = [handle]
    lib.hearth_device_index.restype = c.c_int32
    lib.hearth_copy_to_host.argtypes = [handle, c.c_size_t, c.c_uint64, c.c_void_p, c.c_uint64]
    lib.hearth_copy_to_host.restype = c.c_int32
    lib.hearth_detach.argtypes = [handle]
    lib.hearth_detach.restype = None
    lib.hearth_default_socket.argtypes = []
    lib.hearth_default_socket.restype = c.c_char_p
    lib.hearth_last_error.argtypes = []
    lib.hearth_last_error.restype = c.c_char_p


def library():
    """Returns the loaded libhearth; raises OSError naming every place searched."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for source, path in candidates():
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{source} {path}: {e}")
                continue
            _declare(lib)
            _lib = lib
            return lib
        searched = "; ".join(tried) if tried else (
            f"$HEARTH_LIBRARY is unset, {_repository_library()} does not exist, "
            "and ctypes.util.find_library('hearth') found nothing")
        raise OSError(
            "hearth: cannot load libhearth (" + searched + "). Build it with "
            "`cmake --build build --target hearth` or set HEARTH_LIBRARY to libhearth.so")


def has_attach_options(lib):
    """Whether `lib` has hearth_attach_with_options (ABI version 2 or later)."""
    return hasattr(lib, "hearth_attach_with_options")
