"""DLPack export (v0.8 layout, unversioned "dltensor" capsules) through ctypes.

Ownership: every exported DLManagedTensor, its shape array and a reference to
the exporting Tensor (hence to the attachment) live in `_live` until either
the consumer calls the deleter (after it took the capsule and renamed it
"used_dltensor") or the capsule dies unconsumed and its destructor releases
it. Whichever happens releases the entry exactly once; the attachment is
detached only when no capsule, array or Tensor refers to it any more.
"""

import ctypes
import threading

KDL_CPU = 1
KDL_CUDA = 2

_CAPSULE_NAME = b"dltensor"  # module global: the capsule keeps a pointer to it
_USED_NAME = b"used_dltensor"


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

# address of the DLManagedTensor -> (struct, shape array, owner)
_live = {}
_live_lock = threading.Lock()


def _release(address):
    with _live_lock:
        entry = _live.pop(address, None)
    del entry  # drops the owner reference outside the lock


@_Deleter
def _deleter(managed):
    # Called by the consumer, from any thread; ctypes takes the GIL for us.
    _release(ctypes.cast(managed, ctypes.c_void_p).value)


_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_api = ctypes.pythonapi
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_GetName.argtypes = [ctypes.c_void_p]
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p


@_CapsuleDestructor
def _capsule_destructor(capsule):
    # The capsule is being deallocated, so it is passed as a bare address: a
    # py_object argument would resurrect it. A consumer that took ownership
    # renamed it "used_dltensor" and will call the deleter itself.
    if _api.PyCapsule_GetName(capsule) == _CAPSULE_NAME:
        _release(_api.PyCapsule_GetPointer(capsule, _CAPSULE_NAME))


_destructor_address = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value


def export(owner, data_ptr, device_type, device_id, shape, code, bits):
    """Returns a "dltensor" capsule over `data_ptr`; keeps `owner` alive until released."""
    ndim = len(shape)
    shape_array = (ctypes.c_int64 * max(ndim, 1))(*shape)
    managed = DLManagedTensor()
    managed.dl_tensor.data = data_ptr
    managed.dl_tensor.device = DLDevice(device_type, device_id)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = DLDataType(code, bits, 1)
    managed.dl_tensor.shape = ctypes.cast(shape_array, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = None  # compact row-major
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    with _live_lock:
        _live[address] = (managed, shape_array, owner)
    try:
        return _api.PyCapsule_New(address, _CAPSULE_NAME, _destructor_address)
    except BaseException:
        _release(address)
        raise


def live_exports():
    """How many exported tensors are still held by a capsule or a consumer (for tests)."""
    with _live_lock:
        return len(_live)
