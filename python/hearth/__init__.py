"""hearth: read-only model weights shared by a `hearth store`, for Python workers.

    import hearth
    weights = hearth.attach("mlp")           # records the request; maps nothing
    w = weights["encoder.weight"].numpy()    # first use attaches in this process

`attach()` returns a read-only Mapping from tensor name to `Tensor`. The real
attach (connect to the store's socket, receive the arena's descriptor, map it
read-only) happens on first use, in the process that uses it: a pre-forking
server (gunicorn --preload) can call `attach()` in its master, which then maps
nothing, and every forked worker maps the arena itself on first use. If the
process id changes after a fork, the mapping re-attaches.

Tensors export their memory through `numpy()` / `__array_interface__`
(read-only arrays: the recommended path), `__cuda_array_interface__` and DLPack
(`numpy.from_dlpack`, `torch.from_dlpack`). The bytes are mapped read-only: an
array that a DLPack consumer marks writeable is still a view of read-only
memory, and writing through it kills the process (SIGSEGV on the host, an
illegal-address fault on a GPU).

Why ctypes rather than a compiled extension: the binding needs no compiler
and no Python headers, and one pure-Python package works with any interpreter
and virtual environment that can load libhearth. The per-call overhead of
ctypes does not matter here: a process attaches once and then works on raw
pointers.

Fork safety: `import hearth` never imports torch and never touches CUDA. A
process forked from a parent that had initialised CUDA (through torch, or a
CUDA attachment of hearth's) cannot use CUDA; first use of a CUDA attachment
in such a child raises HearthError saying how to fix it. Host-memory
attachments work after any fork.

Finding libhearth: $HEARTH_LIBRARY, else build/src/capi/libhearth.so of the
repository this package lives in, else ctypes.util.find_library("hearth").
The socket: the `socket` argument, else $HEARTH_SOCKET, else the library's
default path. With `device=` (a store started with several devices, `hearth
store --device cuda:0,cuda:1`, runs one store per device), that device's
store's socket: SOCKET-cuda1.sock for store.sock and cuda:1 (see
device_socket()), and the attachment must be on that device.

On Windows (_platform.py holds every difference): the library is hearth.dll
($HEARTH_LIBRARY, else the repository's build-windows or build folder, this
package's folder, beside hearth.exe on PATH, then PATH), and the store's
address, in `socket` and $HEARTH_SOCKET, is its pipe name (1 to 64 of
[A-Za-z0-9._-], as `hearth store --socket NAME` takes it): a path there is a
ValueError saying so. There is no fork: uvicorn's and torch.multiprocessing's
workers are spawned interpreters, each attaching on first use; a write
through a mapping is an access violation rather than SIGSEGV. `store_uid` is
Linux's: a Windows store's pipe admits only its own user.

Trust: before it believes a manifest or maps a descriptor, the library checks
who listens on the socket. A store running as another uid than this process's
(or root) is refused with PermissionDenied naming the socket, the store's uid
and pid, unless that uid is trusted: `attach(..., store_uid=UID)` (an int or
a list of them) or $HEARTH_STORE_UID (comma-separated uids, read by the
library, so by every hearth client).
"""

import collections.abc
import ctypes
import os
import sys
import threading

from . import _capi
from . import _dlpack
from . import _platform
from ._streams import Request  # noqa: F401  (a decoupled model's requests)

__all__ = [
    "attach",
    "device_socket",
    "Weights",
    "Tensor",
    "HearthError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "Unavailable",
    "ResourceExhausted",
]


# ---- errors ---------------------------------------------------------------


class HearthError(RuntimeError):
    """A failure reported by libhearth (or by this binding). `code` is the hearth_status."""

    def __init__(self, message, code=_capi.ERROR_INTERNAL):
        super().__init__(message)
        self.code = code


class InvalidArgument(HearthError):
    pass


class NotFound(HearthError):
    pass


class PermissionDenied(HearthError):
    pass


class Unavailable(HearthError):
    pass


class ResourceExhausted(HearthError):
    pass


_ERROR_TYPES = {
    _capi.ERROR_INVALID_ARGUMENT: InvalidArgument,
    _capi.ERROR_NOT_FOUND: NotFound,
    _capi.ERROR_PERMISSION_DENIED: PermissionDenied,
    _capi.ERROR_UNAVAILABLE: Unavailable,
    _capi.ERROR_RESOURCE_EXHAUSTED: ResourceExhausted,
}


def _error(code, context, lib):
    message = lib.hearth_last_error().decode("utf-8", "replace")
    return _ERROR_TYPES.get(code, HearthError)(f"hearth: {context}: {message}", code)


def _load_library():
    try:
        return _capi.library()
    except OSError as e:
        raise HearthError(str(e)) from None


# ---- fork safety ----------------------------------------------------------

_FORK_ADVICE = (
    "this process was forked from a parent that had initialised CUDA, and CUDA cannot be "
    "used in such a child. Start workers with the 'spawn' or 'forkserver' start method "
    "(or fork+exec), or call hearth.attach() lazily in the parent and touch CUDA only in "
    "the workers (gunicorn --preload: do not import models onto the GPU in the master)")

_cuda_attachments_alive = 0  # CUDA attachments mapped by this process
_parent_used_cuda = False    # set in the parent just before a fork
_forked_after_cuda = False   # set in a child whose parent (or ancestor) had CUDA


def _process_uses_cuda():
    if _cuda_attachments_alive > 0 or _forked_after_cuda:
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def _before_fork():
    # Asked in the parent: in the child torch already reports "not initialised".
    global _parent_used_cuda
    _parent_used_cuda = _process_uses_cuda()


def _after_fork_in_child():
    global _forked_after_cuda, _cuda_attachments_alive
    if _parent_used_cuda:
        _forked_after_cuda = True
    _cuda_attachments_alive = 0  # the parent's, not ours


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


# ---- the attachment -------------------------------------------------------


class _Attachment:
    """Owns one hearth_attachment handle; detaches when the last reference goes.

    Referenced by the Weights mapping, by every Tensor and by every DLPack
    export, so the mapping outlives every view of it. Only the process that
    attached detaches: a forked child that inherited the object leaves the
    parent's CUDA handle alone (driver calls would fail there) and drops host
    handles (munmap and close act on the child's copies only).
    """

    def __init__(self, lib, handle, socket, device_type, device_index):
        self._lib = lib
        self._handle = handle
        self.pid = os.getpid()
        self.socket = socket
        self.device_type = device_type
        self.device_index = device_index
        self.model = lib.hearth_model_name(handle).decode()
        self.version = lib.hearth_model_version(handle)
        self.checksum = lib.hearth_checksum(handle)
        self.is_cuda = device_type == _capi.DEVICE_CUDA
        if self.is_cuda:
            global _cuda_attachments_alive
            _cuda_attachments_alive += 1

    @property
    def handle(self):
        return self._handle

    def check_usable(self):
        if self.is_cuda and self.pid != os.getpid():
            raise HearthError(
                f"hearth: tensor of {self.model}@{self.version} was attached on CUDA by process "
                f"{self.pid} and cannot be used in forked process {os.getpid()}: "
                + _FORK_ADVICE)

    def tensor_infos(self):
        lib, handle = self._lib, self._handle
        infos = []
        for i in range(lib.hearth_tensor_count(handle)):
            info = _capi.TensorInfo()
            rc = lib.hearth_tensor_info_at(handle, i, ctypes.byref(info))
            if rc != _capi.OK:
                raise _error(rc, f"tensor {i} of {self.model}", lib)
            infos.append((i, info))
        return infos

    def copy_to_host(self, index, dst_address, nbytes):
        rc = self._lib.hearth_copy_to_host(self._handle, index, 0, dst_address, nbytes)
        if rc != _capi.OK:
            raise _error(rc, f"copy tensor {index} of {self.model}", self._lib)

    def __del__(self):
        handle, self._handle = self._handle, None
        if handle is None or sys.is_finalizing():
            return  # at shutdown the process exit unmaps everything
        if self.is_cuda:
            if self.pid != os.getpid():
                return
            global _cuda_attachments_alive
            _cuda_attachments_alive -= 1
        try:
            self._lib.hearth_detach(handle)
        except Exception:
            pass


# ---- tensors --------------------------------------------------------------

# hearth_dtype -> (name, numpy typestr or None, (DLPack code, bits) or None)
_DTYPES = {
    0: ("F64", "<f8", (2, 64)),
    1: ("F32", "<f4", (2, 32)),
    2: ("F16", "<f2", (2, 16)),
    3: ("BF16", None, (4, 16)),
    4: ("I64", "<i8", (0, 64)),
    5: ("I32", "<i4", (0, 32)),
    6: ("I16", "<i2", (0, 16)),
    7: ("I8", "|i1", (0, 8)),
    8: ("U8", "|u1", (1, 8)),
    9: ("BOOL", "|b1", (6, 8)),
    10: ("F8_E4M3", None, None),
    11: ("F8_E5M2", None, None),
    13: ("U16", "<u2", (1, 16)),
    14: ("U32", "<u4", (1, 32)),
    15: ("U64", "<u8", (1, 64)),
}


class Tensor:
    """A read-only view of one tensor in an attached arena.

    Holds a reference to its attachment: the mapping stays valid while this
    object, or any array or DLPack export made from it, is alive. Thread-safe
    for reading.
    """

    __slots__ = ("name", "shape", "dtype", "nbytes", "data_ptr", "_index", "_dtype_code",
                 "_attachment", "__weakref__")

    def __init__(self, attachment, index, info):
        self._attachment = attachment
        self._index = index
        self.name = info.name.decode()
        self.shape = tuple(info.shape[i] for i in range(info.ndim))
        self._dtype_code = info.dtype
        self.dtype = info.dtype_name.decode()
        self.nbytes = info.nbytes
        self.data_ptr = info.data or 0

    @property
    def device(self):
        a = self._attachment
        return f"cuda:{a.device_index}" if a.is_cuda else "cpu"

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def numpy_dtype(self):
        """The numpy dtype; TypeError for dtypes numpy lacks (BF16, F8)."""
        import numpy

        return numpy.dtype(self._typestr())

    def _typestr(self):
        entry = _DTYPES.get(self._dtype_code)
        if entry is None or entry[1] is None:
            raise TypeError(
                f"hearth: tensor '{self.name}' has dtype {self.dtype}, which numpy cannot "
                "represent; use torch (hearth.torch.state_dict) or DLPack instead")
        return entry[1]

    def _interface(self):
        return {
            "shape": self.shape,
            "typestr": self._typestr(),
            "data": (self.data_ptr, True),  # read-only
            "strides": None,
            "version": 3,
        }

    @property
    def __array_interface__(self):
        if self._attachment.is_cuda:
            raise AttributeError(
                f"tensor '{self.name}' is on {self.device}; use __cuda_array_interface__ or "
                "DLPack, or tobytes() for a host copy")
        return self._interface()

    @property
    def __cuda_array_interface__(self):
        if not self._attachment.is_cuda:
            raise AttributeError(f"tensor '{self.name}' is in host memory, not on a GPU")
        self._attachment.check_usable()
        d = self._interface()
        d["stream"] = None  # the store wrote the bytes before serving them
        return d

    def numpy(self):
        """A read-only numpy array over the shared bytes (no copy). Host tensors only."""
        import numpy

        if self._attachment.is_cuda:
            raise TypeError(
                f"hearth: tensor '{self.name}' is on {self.device}; numpy() needs host memory "
                "(use tobytes() for a copy, or cupy/torch through DLPack)")
        return numpy.asarray(self)

    def tobytes(self):
        """A copy of the tensor's bytes in host memory (works for CUDA tensors too)."""
        self._attachment.check_usable()
        out = ctypes.create_string_buffer(self.nbytes)
        self._attachment.copy_to_host(self._index, ctypes.addressof(out), self.nbytes)
        return out.raw

    def __dlpack_device__(self):
        a = self._attachment
        return (_dlpack.KDL_CUDA, a.device_index) if a.is_cuda else (_dlpack.KDL_CPU, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """An unversioned DLPack capsule ("dltensor") over the read-only shared bytes.

        The consumer gets a view of read-only memory even if it marks it writeable.
        `stream` needs no synchronisation: the bytes never change while served.
        """
        self._attachment.check_usable()
        if copy:
            raise BufferError("hearth: tensors are shared read-only memory; copy=True is not "
                              "supported (import without copy, then copy in the consumer)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"hearth: tensor '{self.name}' is on {self.device}, not on "
                              f"DLPack device {tuple(dl_device)}")
        entry = _DTYPES.get(self._dtype_code)
        if entry is None or entry[2] is None:
            raise BufferError(f"hearth: tensor '{self.name}' has dtype {self.dtype}, which "
                              "DLPack 0.8 cannot describe")
        code, bits = entry[2]
        device_type, device_id = self.__dlpack_device__()
        return _dlpack.export(self, self.data_ptr, device_type, device_id, self.shape, code, bits)

    def __repr__(self):
        return (f"hearth.Tensor(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
                f"device={self.device!r})")


# ---- the mapping ----------------------------------------------------------


class Weights(collections.abc.Mapping):
    """A read-only Mapping from tensor name to Tensor for one attached model.

    Lazy: nothing is mapped until the first access of a tensor, len(), keys()
    or a property; then the model is attached in the calling process. After a
    fork the child attaches again on first use. Thread-safe.
    """

    def __init__(self, model, socket, version, store_uids=(), device=None):
        self._model = model
        self._socket = socket  # None: the library's default, resolved on first use
        self._version = version
        self._device = device  # None, or a canonical store device name: "cuda:1", "host0", "cpu"
        self._store_uids = tuple(store_uids)
        self._lock = threading.Lock()
        self._attachment = None
        self._tensors = None

    def _state(self):
        pid = os.getpid()
        att = self._attachment
        if att is not None and att.pid == pid:
            return att, self._tensors
        with self._lock:
            att = self._attachment
            if att is None or att.pid != pid:
                self._attachment = None
                self._tensors = None
                att = self._attach()
                self._tensors = {t.name: t for t in (Tensor(att, i, info)
                                                     for i, info in att.tensor_infos())}
                self._attachment = att
            return att, self._tensors

    def _attach(self):
        lib = _load_library()
        platform = _platform.current()
        socket = self._socket
        if not socket:
            socket = lib.hearth_default_socket().decode()
            try:
                socket = platform.check_address(socket, "the library's default store address")
            except ValueError as e:
                raise InvalidArgument(f"hearth: {e}", _capi.ERROR_INVALID_ARGUMENT) from None
        if self._device is not None:
            socket = _device_address(platform, socket, self._device)
        what = self._model + (f"@{self._version}" if self._version else "")
        where = platform.describe_address(socket)
        handle = ctypes.c_void_p()
        if self._store_uids:
            if not _capi.has_attach_options(lib):
                raise HearthError(
                    "hearth: store_uid needs libhearth of ABI version 2 or later; this one is "
                    f"version {lib.hearth_abi_version()}", _capi.ERROR_INVALID_ARGUMENT)
            uids = (ctypes.c_uint32 * len(self._store_uids))(*self._store_uids)
            options = _capi.AttachOptions(ctypes.sizeof(_capi.AttachOptions), socket.encode(),
                                          uids, len(self._store_uids))
            rc = lib.hearth_attach_with_options(ctypes.byref(options), self._model.encode(),
                                                self._version or 0, ctypes.byref(handle))
        else:
            rc = lib.hearth_attach(socket.encode(), self._model.encode(), self._version or 0,
                                   ctypes.byref(handle))
        if rc != _capi.OK:
            err = _error(rc, f"attach {what} from {where}", lib)
            if _forked_after_cuda:
                err.args = (f"{err.args[0]} (note: {_FORK_ADVICE})",)
            raise err
        device_type = lib.hearth_device_type(handle)
        if device_type == _capi.DEVICE_CUDA and _forked_after_cuda:
            # Not detached: detaching would call into a CUDA driver that is unusable here.
            raise HearthError(f"hearth: attach {what} from {where}: the model is on a GPU and "
                              + _FORK_ADVICE, _capi.ERROR_INVALID_ARGUMENT)
        att = _Attachment(lib, handle, socket, device_type, lib.hearth_device_index(handle))
        if self._device is not None:
            want_cuda = self._device.startswith("cuda:")
            on = f"cuda:{att.device_index}" if att.is_cuda else "cpu"
            if want_cuda != att.is_cuda or (want_cuda and on != self._device):
                raise HearthError(f"hearth: attach {what} from {where}: that store holds it on "
                                  f"{on}, not on {self._device}", _capi.ERROR_INVALID_ARGUMENT)
        return att

    @property
    def model(self):
        return self._state()[0].model

    @property
    def version(self):
        return self._state()[0].version

    @property
    def checksum(self):
        """The content checksum the store computed (as `hearth inspect` prints it)."""
        return self._state()[0].checksum

    @property
    def device(self):
        att = self._state()[0]
        return f"cuda:{att.device_index}" if att.is_cuda else "cpu"

    @property
    def socket(self):
        return self._state()[0].socket

    @property
    def attached(self):
        """True if this process has mapped the model (never triggers an attach)."""
        att = self._attachment
        return att is not None and att.pid == os.getpid()

    def __getitem__(self, name):
        tensors = self._state()[1]
        try:
            return tensors[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in model {self._model!r}") from None

    def __iter__(self):
        return iter(self._state()[1])

    def __len__(self):
        return len(self._state()[1])

    def __contains__(self, name):
        return name in self._state()[1]

    def __repr__(self):
        if not self.attached:
            return f"hearth.Weights(model={self._model!r}, not attached yet)"
        att = self._attachment
        return (f"hearth.Weights(model={att.model!r}, version={att.version}, "
                f"tensors={len(self._tensors)}, device={self.device!r})")


def _store_uids(store_uid):
    if store_uid is None:
        return ()
    unsupported = _platform.current().store_uid_unsupported()
    if unsupported:
        raise ValueError(f"hearth.attach: {unsupported}")
    uids = (store_uid,) if isinstance(store_uid, int) else tuple(store_uid)
    for uid in uids:
        if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < 2**32 - 1:
            raise ValueError("hearth.attach: store_uid must be a uid (an int) or a list of them, "
                             f"not {store_uid!r}")
    return uids


def _device_name(device):
    """The canonical name of a store's device, as `hearth store --device` takes
    it: "cpu", "cuda:N" ("cuda" is cuda:0; an int N too), or "hostN" (host
    memory standing in for GPU N, for tests). ValueError otherwise."""
    if isinstance(device, int) and not isinstance(device, bool) and 0 <= device < 1024:
        return f"cuda:{device}"
    if isinstance(device, str):
        if device in ("cpu", "host"):
            return "cpu"
        if device == "cuda":
            return "cuda:0"
        for prefix in ("cuda:", "host"):
            digits = device[len(prefix):] if device.startswith(prefix) else ""
            if (digits.isascii() and digits.isdigit() and int(digits) < 1024
                    and (prefix == "cuda:" or len(digits) == 1 or digits[0] != "0")):
                return prefix + str(int(digits))
    raise ValueError("hearth.attach: device must be 'cpu', 'cuda', 'cuda:N', 'hostN' or a GPU "
                     f"ordinal N (0 to 1023), not {device!r}")


def device_socket(socket, device):
    """The socket of `device`'s store among several, as `hearth store --device
    A,B --socket SOCKET` binds them: "-" and the device's name without its ':'
    before a final ".sock" of the file name, or after it
    (device_socket("/run/h/store.sock", "cuda:1") == "/run/h/store-cuda1.sock").
    hearth serve's stores are <run dir>/store-cpu.sock, store-cuda0.sock, ...
    On Windows `socket` is the store's pipe name and so is the result
    (device_socket("store", "cuda:1") == "store-cuda1"); ValueError for a path
    or for a result longer than a pipe name's 64 characters."""
    return _platform.current().device_address(socket, _device_name(device))


def _device_address(platform, socket, device):
    try:
        return platform.device_address(socket, device)
    except ValueError as e:
        raise InvalidArgument(f"hearth: {e}", _capi.ERROR_INVALID_ARGUMENT) from None


def attach(model, socket=None, version=None, store_uid=None, device=None):
    """Returns a lazy, read-only Mapping of `model`'s tensors held by a `hearth store`.

    Only records the request: the first use attaches in the calling process
    (see the module docstring). `version` None or 0 means the latest.
    `store_uid` (a uid or a list of uids) trusts a store run by that account
    besides this process's own uid and root ($HEARTH_STORE_UID does the same);
    Linux only. On Windows `socket` is the store's pipe name (ValueError for a
    path).
    `device` ("cuda:1", 1, "cpu", ...) picks that device's store of a store
    run with several devices (its socket: device_socket(socket, device)); the
    attachment must then be on that device (HearthError if not). Errors
    (HearthError: NotFound, Unavailable, PermissionDenied, ...) surface at
    that first use.
    """
    if not isinstance(model, str) or not model:
        raise ValueError("hearth.attach: model must be a non-empty string")
    if version is not None and (not isinstance(version, int) or version < 0):
        raise ValueError("hearth.attach: version must be a non-negative integer or None")
    uids = _store_uids(store_uid)
    device = _device_name(device) if device is not None else None
    platform = _platform.current()
    try:
        if socket is not None:
            socket = platform.check_address(socket, "socket")
        elif os.environ.get("HEARTH_SOCKET"):
            socket = platform.check_address(os.environ["HEARTH_SOCKET"], "$HEARTH_SOCKET")
        else:
            socket = None
        if device is not None and socket:
            platform.device_address(socket, device)  # a name too long for a pipe: said now
    except ValueError as e:
        raise ValueError(f"hearth.attach: {e}") from None
    return Weights(model, socket, version, uids, device)
