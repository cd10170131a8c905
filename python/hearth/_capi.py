"""Loads libhearth (the C ABI in include/hearth/hearth.h) through ctypes.

Nothing here runs at import time: the library is found and loaded on the
first call to `library()`, so `import hearth` works without it.
"""

import ctypes
import os
import threading

from . import _platform

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


def candidates():
    """The places searched for libhearth (hearth.dll on Windows), in order, as
    (source, path) pairs; _platform says where each system looks.

    An explicit $HEARTH_LIBRARY is the only candidate: a broken setting is
    reported rather than silently replaced by another build.
    """
    env = os.environ.get("HEARTH_LIBRARY")
    if env:
        return [("$HEARTH_LIBRARY", env)]
    return _platform.current().library_candidates()


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
        platform = _platform.current()
        tried = []
        for source, path in candidates():
            try:
                lib = platform.load(path)
            except OSError as e:
                tried.append(f"{source} {path}: {e}")
                continue
            _declare(lib)
            _lib = lib
            return lib
        searched = "; ".join(tried) if tried else platform.not_found()
        raise OSError(f"hearth: cannot load {platform.library_name} ({searched}). "
                      + platform.build_advice())


def has_attach_options(lib):
    """Whether `lib` has hearth_attach_with_options (ABI version 2 or later)."""
    return hasattr(lib, "hearth_attach_with_options")
