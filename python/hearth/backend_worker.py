"""The Python backend's worker process: `backend: python` in a model's config.

`hearth serve` starts hearth-worker, which execs `<python> -m
hearth.backend_worker` in its place with the control socket and the request
slot as descriptors 3 and 4. This module speaks the worker protocol through
libhearth's C ABI (hearth_worker_*): it reads the setup, attaches the model's
weights from the store (one copy, mapped read-only), imports
`<version dir>/model.py`, and serves batches with its `Model` class:

    class Model:
        def initialize(self, args): ...  # once per worker
        def execute(self, inputs): ...   # {name: array} batched along dim 0 -> {name: array-like}
        def finalize(self): ...          # optional, on orderly shutdown

`args`: model_config (the config as a dict, Triton's JSON form), model_name,
model_version, model_repository (the version directory), device ("cpu" or
"cuda:N"), and weights: the store's tensors as a read-only Mapping from name
to torch.Tensor (zero-copy, on the store's device), or hearth.Tensor where
torch cannot be imported.

`inputs` are read-only NumPy arrays viewing the request slot (torch tensors
with `parameters: {tensor_type: torch}`), valid only during execute(): copy
what must outlive it. BYTES (TYPE_STRING) inputs are NumPy arrays of dtype
object holding `bytes`. Outputs may be NumPy arrays, torch tensors on any
device, or anything numpy.asarray takes (for BYTES, bytes or str elements);
arrays and tensors must have the config's dtype, and every output its shape
(the batch's rows first): a mismatch fails that batch naming the output.

An exception in initialize() fails the model (the traceback is in the log and
in /v2/models/{m}/ready's 503 body); one in execute() fails only the requests
that cause it: the server reruns the batch one request at a time, and each
failing request gets the traceback's last line.

Decoupled models (`model_transaction_policy: {decoupled: true}`) answer each
request with a stream of responses, and a worker holds up to
`args["max_streams"]` requests at once (config parameters.max_streams, 1 by
default). hearth._streams has the loop and hearth.Request:

        def execute(self, requests):  # new requests (hearth.Request)
        def step(self):               # optional: advance every unfinished one

A Request has `id`, `inputs` (as above, batch dimension 1 where the model
batches; valid until its final response or its cancellation), `parameters`
(the request's, parsed from JSON; {} when none), `resume_token_ids` ([] for a
new stream), `send(outputs=None, final=False)` (one response: a dict of any
subset of the config's outputs, each checked as above; False once the
request is over: drop it), `fail(error)` (hearth.InvalidArgument: the
client's fault, HTTP 400; anything else the model's, 500) and
`is_cancelled()` (the client went away or its timeout passed: the server has
ended it). The worker's loop, on one thread: take the requests opened and
cancelled, call execute() with the new ones, call step() once if the model
has one and a request it was given is unfinished, and start again (it
waits for the server only when there is nothing to step). send() and fail()
are called from that thread, inside execute() or step(). An exception in
execute() fails the requests of that call not yet ended; one in step()
every unfinished request. A model without step() ends each request inside
the execute() that gave it.

With config `parameters: {resumable: "true"}` (and an output token_ids,
TYPE_INT64 [-1]) a stream whose worker died is opened again on another with
`resume_token_ids`: the token ids of every response its client got, which
the model goes on after without sending them again.

`execute(self, inputs, parameters)` as a generator function still works:
each request's generator is advanced by one response in turn, each yielded
dict one response; returning ends the stream, raising ends it with an
error, and a request over early closes the generator at its yield
(GeneratorExit there). It cannot be resumable. On a decoupled model, an
execute that is neither a generator function nor execute(self, requests),
and on a batched model a generator function, fails the model at start.
A model.py written for Triton's Python backend (a class TritonPythonModel and
no Model) is served through hearth._triton's adapters, with
`triton_python_backend_utils` importable; a version directory without a
checkpoint (model.py alone) attaches nothing and gets weights {}.
docs/python-backend.md has the whole contract.
"""

import argparse
import ctypes
import importlib.util
import inspect
import json
import os
import sys
import threading
import time
import traceback

from hearth import _capi
from hearth import _platform

# enum hearth_dtype -> NumPy dtype string; BF16 has no NumPy type.
_NUMPY = {0: "<f8", 1: "<f4", 2: "<f2", 4: "<i8", 5: "<i4", 6: "<i2", 7: "i1", 8: "u1", 9: "?",
          13: "<u2", 14: "<u4", 15: "<u8"}
_BYTES = 12
_TRITON = {"TYPE_FP64": 0, "TYPE_FP32": 1, "TYPE_FP16": 2, "TYPE_BF16": 3, "TYPE_INT64": 4,
           "TYPE_INT32": 5, "TYPE_INT16": 6, "TYPE_INT8": 7, "TYPE_UINT8": 8, "TYPE_BOOL": 9,
           "TYPE_STRING": _BYTES, "TYPE_UINT16": 13, "TYPE_UINT32": 14, "TYPE_UINT64": 15}
# The torch dtype of each hearth dtype; UINT16, UINT32 and UINT64 only where
# torch has them (2.3 and later); elsewhere those tensors stay NumPy arrays.
_TORCH_NAMES = {0: "float64", 1: "float32", 2: "float16", 3: "bfloat16", 4: "int64", 5: "int32",
                6: "int16", 7: "int8", 8: "uint8", 9: "bool", 13: "uint16", 14: "uint32",
                15: "uint64"}


class TensorSpec(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


def _declare(lib):
    c = ctypes
    h = c.c_void_p
    for name, args, res in [
        ("hearth_worker_open", [c.c_int, c.c_int, c.c_int32, c.POINTER(h)], c.c_int32),
        ("hearth_worker_config_json", [h], c.c_char_p),
        ("hearth_worker_version_dir", [h], c.c_char_p),
        ("hearth_worker_max_batch_size", [h], c.c_int32),
        ("hearth_worker_parameter_count", [h], c.c_size_t),
        ("hearth_worker_parameter", [h, c.c_size_t, c.POINTER(c.c_void_p), c.POINTER(c.c_size_t),
                                     c.POINTER(c.c_void_p), c.POINTER(c.c_size_t)], c.c_int32),
        ("hearth_worker_ready", [h, c.POINTER(TensorSpec), c.c_size_t, c.POINTER(TensorSpec),
                                 c.c_size_t, c.c_uint64, c.c_char_p], c.c_int32),
        ("hearth_worker_fail", [h, c.c_int32, c.c_char_p], c.c_int32),
        ("hearth_worker_next", [h], c.c_int32),
        ("hearth_worker_rows", [h], c.c_int64),
        ("hearth_worker_input", [h, c.c_size_t, c.POINTER(c.c_void_p), c.POINTER(c.c_uint64),
                                 c.POINTER(c.POINTER(c.c_int64)), c.POINTER(c.c_int32)], c.c_int32),
        ("hearth_worker_output", [h, c.c_size_t, c.POINTER(c.c_int64), c.c_int32, c.c_uint64,
                                  c.POINTER(c.c_void_p)], c.c_int32),
        ("hearth_worker_done", [h, c.c_int32, c.c_char_p, c.c_int32], c.c_int32),
        ("hearth_worker_close", [h], None),
    ]:
        if not hasattr(lib, name):
            raise OSError(f"libhearth has no {name}: it is older than this package "
                          "(ABI version 3 is needed)")
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    # ABI version 4 (decoupled models): looked for only by a decoupled model's worker.
    for name, args, res in [
        ("hearth_worker_decoupled", [h], c.c_int32),
        # ABI version 5: standby workers.
        ("hearth_worker_wait_start", [h], c.c_int32),
        # ABI version 6: the phases of a worker's start, for the server's metrics.
        ("hearth_worker_start_phase", [h, c.c_char_p, c.c_uint64], c.c_int32),
        # ABI version 7: a decoupled model's worker holds many streams.
        ("hearth_worker_stream_capacity", [h], c.c_int32),
        ("hearth_worker_stream_next", [h, c.c_int32, c.POINTER(c.c_uint64)], c.c_int32),
        ("hearth_worker_stream_input", [h, c.c_uint64, c.c_size_t, c.POINTER(c.c_void_p),
                                        c.POINTER(c.c_uint64), c.POINTER(c.POINTER(c.c_int64)),
                                        c.POINTER(c.c_int32)], c.c_int32),
        ("hearth_worker_stream_request", [h, c.c_uint64, c.POINTER(c.c_char_p),
                                          c.POINTER(c.c_char_p), c.POINTER(c.POINTER(c.c_int64)),
                                          c.POINTER(c.c_uint64)], c.c_int32),
        ("hearth_worker_stream_output", [h, c.c_uint64, c.c_size_t, c.POINTER(c.c_int64),
                                         c.c_int32, c.c_uint64, c.POINTER(c.c_void_p)], c.c_int32),
        ("hearth_worker_stream_respond", [h, c.c_uint64, c.c_int32, c.c_int32, c.c_char_p],
         c.c_int32),
    ]:
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = res


class _BatchError(Exception):
    """A batch's outputs are wrong: fails that batch, never the worker."""


class _Worker:
    def __init__(self, lib, handle):
        self.lib = lib
        self.h = handle
        self.config = json.loads(lib.hearth_worker_config_json(handle).decode())
        self.version_dir = lib.hearth_worker_version_dir(handle).decode()
        self.max_batch_size = lib.hearth_worker_max_batch_size(handle)
        self.parameters = {}
        for i in range(lib.hearth_worker_parameter_count(handle)):
            k, kn, v, vn = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_void_p(), ctypes.c_size_t()
            lib.hearth_worker_parameter(handle, i, ctypes.byref(k), ctypes.byref(kn),
                                        ctypes.byref(v), ctypes.byref(vn))
            self.parameters[ctypes.string_at(k, kn.value).decode(errors="replace")] = \
                ctypes.string_at(v, vn.value).decode(errors="replace")
        self._keep = []

    def error(self):
        return self.lib.hearth_last_error().decode(errors="replace")

    def fail(self, code, message):
        self.lib.hearth_worker_fail(self.h, code, message.encode(errors="replace"))

    def specs(self, entries):
        out = (TensorSpec * len(entries))()
        for i, (name, dtype, dims) in enumerate(entries):
            arr = (ctypes.c_int64 * len(dims))(*dims)
            self._keep += [arr, name.encode()]
            out[i] = TensorSpec(self._keep[-1], dtype, len(dims), arr)
        return out


# A control input's type, by the field that gives its false and true values.
_CONTROL_TYPES = {"int32_false_true": 5, "fp32_false_true": 1, "bool_false_true": 9}


def _signature(config, which):
    """The config's inputs or outputs, then, for a model with
    sequence_batching, the control and state inputs the server adds to each
    request and the state outputs it takes back (as the server's
    WorkerInputs and WorkerOutputs list them)."""
    entries = []
    for io in config.get(which, []):
        dtype = _TRITON.get(io["data_type"])
        if dtype is None:
            raise ValueError(f"{which} {io['name']!r}: data_type {io['data_type']} is not supported")
        entries.append((io["name"], dtype, [int(d) for d in io["dims"]]))
    sequence = config.get("sequence_batching")
    if sequence:
        if which == "input":
            for control_input in sequence.get("control_input", []):
                control = control_input["control"][0]
                if "data_type" in control:
                    dtype = _TRITON[control["data_type"]]
                else:
                    dtype = next(t for k, t in _CONTROL_TYPES.items() if k in control)
                entries.append((control_input["name"], dtype, [1]))
        for state in sequence.get("state", []):
            name = state["input_name"] if which == "input" else state["output_name"]
            entries.append((name, _TRITON[state["data_type"]], [int(d) for d in state["dims"]]))
    return entries


def _load_model_class(version_dir, decoupled=False):
    """model.py's class Model, or its Triton TritonPythonModel behind
    hearth._triton's adapter (a hearth Model): a model.py written for
    Triton's Python backend runs unchanged."""
    path = os.path.join(version_dir, "model.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no model.py (backend: python runs its Model class)")
    spec = importlib.util.spec_from_file_location("hearth_user_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["hearth_user_model"] = module
    # model.py may import modules that live beside it.
    sys.path.insert(0, version_dir)
    spec.loader.exec_module(module)
    if hasattr(module, "Model"):
        return module.Model
    if hasattr(module, "TritonPythonModel"):
        from hearth import _triton
        return _triton.adapter(module.TritonPythonModel, decoupled, path)
    raise AttributeError(f"{path} defines no class Model (nor Triton's TritonPythonModel)")


def _holds_weights(version_dir):
    """Whether the version directory holds a checkpoint; a backend: python
    version without one (model.py alone) has nothing in the store."""
    return any(os.path.exists(os.path.join(version_dir, name))
               for name in ("model.safetensors", "model.safetensors.index.json"))


def _decode_bytes(np, raw, shape):
    """KServe's BYTES form (4-byte little-endian length, then the bytes) -> object array."""
    out = []
    at = 0
    for _ in range(int(np.prod(shape)) if len(shape) else 1):
        n = int.from_bytes(raw[at:at + 4], "little")
        out.append(raw[at + 4:at + 4 + n])
        at += 4 + n
    arr = np.empty(len(out), dtype=object)
    arr[:] = out
    return arr.reshape(shape)


def _encode_bytes(np, name, value):
    arr = np.asarray(value, dtype=object)
    parts = []
    for e in arr.reshape(-1):
        if isinstance(e, str):
            e = e.encode()
        elif isinstance(e, (bytes, bytearray, memoryview)):
            e = bytes(e)
        elif isinstance(e, np.bytes_):
            e = bytes(e)
        else:
            raise _BatchError(f"output {name!r} is BYTES: its elements must be bytes or str, "
                              f"not {type(e).__name__}")
        parts.append(len(e).to_bytes(4, "little") + e)
    return arr.shape, b"".join(parts)


def _to_numpy(np, name, value, dtype):
    """An output as a C-contiguous NumPy array of the config's dtype."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, on any device
        import torch
        want = getattr(torch, _TORCH_NAMES[dtype], None)
        if want is None:
            raise _BatchError(f"output {name!r} is {_TORCH_NAMES[dtype]}, which torch "
                              f"{torch.__version__} lacks: return a NumPy array")
        if value.dtype != want:
            raise _BatchError(f"output {name!r} is a {value.dtype} tensor; the config says {want}")
        value = value.detach().cpu().contiguous()
        if dtype == 3:
            return value.view(torch.int16).numpy()
        return value.numpy()
    if dtype == 3:
        raise _BatchError(f"output {name!r} is BF16: return a torch tensor (NumPy has no bfloat16)")
    want = np.dtype(_NUMPY[dtype])
    if isinstance(value, np.ndarray):
        if value.dtype != want:
            raise _BatchError(f"output {name!r} has dtype {value.dtype}; the config says {want}")
        return np.ascontiguousarray(value)
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise _BatchError(f"output {name!r}: cannot be made an array: {e}") from None
    # Python numbers become int64 / float64 / bool: taken where the kind agrees
    # (ints for an integer output, floats for a float one), never truncated.
    if arr.dtype != want and not (arr.dtype.kind == want.kind or
                                  (arr.dtype.kind in "iub" and want.kind in "iuf")):
        raise _BatchError(f"output {name!r} holds {arr.dtype} values; the config says {want}")
    return np.ascontiguousarray(arr.astype(want, copy=False))


def _exit_if_cuda_is_lost():
    """After an exception: a CUDA context that a kernel fault (a device-side
    assert, an illegal address) has made unusable fails every later batch, so
    the process leaves without answering; the server reruns the batch
    elsewhere, as after any crash, and starts a fresh worker."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"hearth.backend_worker: the CUDA context is lost ({e}); exiting", file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)


def _device_memory():
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_reserved())


def _inject_fault(np, kind, trigger, inputs):
    """parameters.fault_injection (tests of crash handling): fail the way a
    buggy model would when any FP32 input element equals the trigger."""
    if not any(a.dtype == np.float32 and (np.asarray(a) == trigger).any()
               for a in inputs.values() if hasattr(a, "dtype") and a.dtype != object):
        return
    print(f"hearth.backend_worker {os.getpid()}: fault injection: {kind}", file=sys.stderr, flush=True)
    if kind == "abort":
        os.abort()
    if kind == "segv":
        ctypes.string_at(0)
    if kind == "hang":
        import signal
        while True:
            signal.pause()


def _read_inputs(w, np, torch, inputs_spec, key=None):
    """The current run's inputs (or those of stream `key`) as read-only
    arrays (or tensors) over the slot."""
    lib, h = w.lib, w.h
    data, nbytes = ctypes.c_void_p(), ctypes.c_uint64()
    shape_p, ndim = ctypes.POINTER(ctypes.c_int64)(), ctypes.c_int32()
    inputs = {}
    for i, (name, dtype, _) in enumerate(inputs_spec):
        where = (ctypes.byref(data), ctypes.byref(nbytes), ctypes.byref(shape_p),
                 ctypes.byref(ndim))
        if key is None:
            lib.hearth_worker_input(h, i, *where)
        else:
            lib.hearth_worker_stream_input(h, key, i, *where)
        shape = tuple(shape_p[k] for k in range(ndim.value))
        n = nbytes.value
        if key is not None and n == 0 and not shape:
            continue  # an optional input the request left out
        if dtype == _BYTES:
            inputs[name] = _decode_bytes(np, ctypes.string_at(data.value, n) if n else b"", shape)
            continue
        raw = (ctypes.c_char * n).from_address(data.value) if n else b""
        if dtype == 3:
            arr = np.frombuffer(raw, dtype="<i2").reshape(shape)
            arr.flags.writeable = False
            inputs[name] = torch.from_numpy(arr.copy()).view(torch.bfloat16) if torch \
                else arr
            continue
        arr = np.frombuffer(raw, dtype=_NUMPY[dtype]).reshape(shape)
        arr.flags.writeable = False
        if torch is not None and hasattr(torch, _TORCH_NAMES[dtype]):
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only: torch warns, the view is fine
                arr = torch.from_numpy(arr)
        inputs[name] = arr
    return inputs


def _give_outputs(w, np, outputs_spec, outputs, subset, key=None):
    """Copies `outputs` into room the slot gives them, each checked against
    the config (the C side checks the shape). subset: outputs may be left
    out (a decoupled model's response), but none the config lacks may be
    given. Raises _BatchError naming the output at fault."""
    lib, h = w.lib, w.h
    room = ctypes.c_void_p()
    if subset:
        known = {name for name, _, _ in outputs_spec}
        unknown = sorted(str(k) for k in outputs if k not in known)
        if unknown:
            raise _BatchError(f"execute() yielded output {unknown[0]!r}, which the config does not "
                              f"declare (it declares {', '.join(sorted(known))})")
    for i, (name, dtype, _) in enumerate(outputs_spec):
        if name not in outputs:
            if subset:
                continue
            raise _BatchError(f"execute() returned no output {name!r}")
        if dtype == _BYTES:
            shape, payload = _encode_bytes(np, name, outputs[name])
        else:
            arr = _to_numpy(np, name, outputs[name], dtype)
            shape, payload = arr.shape, arr
        shape_c = (ctypes.c_int64 * len(shape))(*shape)
        size = len(payload) if dtype == _BYTES else payload.nbytes
        got = lib.hearth_worker_output(h, i, shape_c, len(shape), size, ctypes.byref(room)) \
            if key is None else \
            lib.hearth_worker_stream_output(h, key, i, shape_c, len(shape), size, ctypes.byref(room))
        if got != 0:
            raise _BatchError(w.error())
        if size:
            src = payload if dtype == _BYTES else payload.ctypes.data
            ctypes.memmove(room.value, src, size)


def _last_line(e):
    return traceback.format_exception_only(type(e), e)[-1].strip()


def _serve(w, model, inputs_spec, outputs_spec, tensor_type, fault=None):
    import numpy as np
    lib, h = w.lib, w.h
    torch = None
    if tensor_type == "torch":
        import torch
    first_batch = True
    while True:
        r = lib.hearth_worker_next(h)
        if r == 0:
            return 0
        if r < 0:
            print(f"hearth.backend_worker: {w.error()}", file=sys.stderr)
            return 2
        inputs = _read_inputs(w, np, torch, inputs_spec)
        if fault is not None:
            _inject_fault(np, fault[0], fault[1], inputs)
        try:
            began = time.monotonic()
            outputs = model.execute(inputs)
            if first_batch:
                first_batch = False
                print(f"hearth.backend_worker: pid {os.getpid()}: its first batch ran in "
                      f"{time.monotonic() - began:.3f} s", file=sys.stderr, flush=True)
        except Exception as e:  # the model's fault: fail these requests, serve on
            if _message(e) == _last_line(e):  # not a Triton model's error response
                traceback.print_exc()
            _exit_if_cuda_is_lost()
            lib.hearth_worker_done(h, _error_code(e), _message(e).encode(errors="replace"), 1)
            continue
        try:
            if not isinstance(outputs, dict):
                raise _BatchError(f"execute() returned {type(outputs).__name__}, not a dict of outputs")
            _give_outputs(w, np, outputs_spec, outputs, subset=False)
        except _BatchError as e:
            lib.hearth_worker_done(h, _capi.ERROR_INVALID_ARGUMENT, str(e).encode(errors="replace"), 0)
            continue
        except (TypeError, ValueError, UnicodeError, OverflowError) as e:
            # Converting what execute() returned: the outputs' fault, not the inputs'.
            message = f"the outputs cannot be converted: {type(e).__name__}: {e}"
            lib.hearth_worker_done(h, _capi.ERROR_INVALID_ARGUMENT, message.encode(errors="replace"), 0)
            continue
        except Exception as e:
            traceback.print_exc()
            _exit_if_cuda_is_lost()
            lib.hearth_worker_done(h, _capi.ERROR_INTERNAL, _last_line(e).encode(errors="replace"), 1)
            continue
        if lib.hearth_worker_done(h, 0, None, 0) != 0:
            return 0  # the server has gone


def _request_parameters(text):
    """The run's parameters JSON as a dict; ValueError saying why it is not one."""
    if not text:
        return {}
    parameters = json.loads(text)
    if not isinstance(parameters, dict):
        raise ValueError(f"the request's parameters are a JSON {type(parameters).__name__}, "
                         "not an object")
    return parameters


def _error_code(e):
    """hearth.InvalidArgument from a model: the request is at fault (a
    front-end's 400); anything else is the model's (500). A Triton model's
    TritonError says which by its code."""
    hearth = sys.modules.get("hearth")
    if hearth is not None and isinstance(e, hearth.InvalidArgument):
        return _capi.ERROR_INVALID_ARGUMENT
    triton = sys.modules.get("hearth._triton")
    if triton is not None and triton.status_of(e) is not None:
        return triton.status_of(e)[0]
    return _capi.ERROR_INTERNAL


def _message(e):
    """What the client is told of an exception: its last line, or a Triton
    model's TritonError's message."""
    triton = sys.modules.get("hearth._triton")
    if triton is not None and triton.status_of(e) is not None:
        return triton.status_of(e)[1]
    return _last_line(e)


def _serve_decoupled(w, model, inputs_spec, outputs_spec, tensor_type, fault=None):
    """A decoupled model's requests, many at once (hearth._streams)."""
    import numpy as np
    from . import _streams
    torch = None
    if tensor_type == "torch":
        import torch
    sw = _streams.StreamWorker(w, np, torch, inputs_spec, outputs_spec, _give_outputs, _read_inputs,
                               _error_code, _message, _BatchError)
    check = None
    if fault is not None:
        def check(inputs):
            _inject_fault(np, fault[0], fault[1], inputs)
    return _streams.serve(w, model, sw, inspect.isgeneratorfunction(type(model).execute), check)


def _check_execute(Model, decoupled, path):
    """A decoupled model's execute must be a generator function, a batched model's must not."""
    execute = getattr(Model, "execute", None)
    if not callable(execute):
        raise AttributeError(f"{path}: class Model has no execute method")
    streams = inspect.isgeneratorfunction(execute)
    if decoupled and not streams:
        n = len(inspect.signature(execute).parameters)
        if n != 2:
            raise TypeError(
                f"{path}: the config says model_transaction_policy: {{decoupled: true}}, so "
                "Model.execute is either def execute(self, requests), given new requests to "
                "answer through their send(), or a generator function, def execute(self, inputs, "
                "parameters), that yields each response's outputs as a dict; this execute takes "
                f"{n - 1} arguments and does not yield")
    if streams and not decoupled:
        raise TypeError(
            f"{path}: Model.execute is a generator function (it yields), but the model is not "
            "decoupled: return one dict of outputs per batch, or set model_transaction_policy: "
            "{decoupled: true} in config.yaml to stream each yield as a response")


def _since_process_start():
    """Seconds from this process's start (the kernel's start time, in clock
    ticks: up to one tick more than it was) to now; None where /proc cannot say."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError):
        return None


class _Phases:
    """The phases of a worker's start, each timed from the end of the one before."""

    def __init__(self, first="interpreter"):
        # `first`: what ran from the process's start to here (the interpreter
        # starting, or a fork from the zygote).
        self.times = []
        since_start = _since_process_start()
        if since_start is not None:
            self.times.append((first, since_start))
        self.last = time.monotonic()

    def done(self, phase):
        now = time.monotonic()
        self.times.append((phase, now - self.last))
        self.last = now

    def skip(self):
        """What passed since the last phase is none of the start's (a standby's wait)."""
        self.last = time.monotonic()

    def text(self):
        return ", ".join(f"{name} {seconds:.3f} s" for name, seconds in self.times)


class _EarlyContext:
    """An exec'd worker on a GPU makes the device's primary context through
    libcuda on a thread while its main thread imports torch and model.py: the
    driver's part of the start (0.1-0.5 s alone, seconds when many workers
    start at once, the driver making contexts one after another) overlaps the
    imports. torch's runtime and libhearth then take the same primary
    context. A failure here changes nothing: it is logged, and torch makes
    the context as it would have."""

    def __init__(self, ordinal):
        self.error = None
        self._thread = threading.Thread(target=self._make, args=(ordinal,), name="hearth-context",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def ordinal(device):
        """The CUDA ordinal of `device` ("cuda" or "cuda:N") where a context
        can be made early (Linux), else None."""
        kind, _, index = device.partition(":")
        if not sys.platform.startswith("linux") or kind != "cuda" or not (index == "" or index.isdigit()):
            return None
        return int(index or 0)

    def _make(self, index):
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), index)),
                               ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev))):
                rc = getattr(cuda, call)(*args)
                if rc != 0:
                    self.error = f"{call}: CUresult {rc}"
                    return
        except OSError as e:
            self.error = str(e)

    def join(self):
        self._thread.join()
        if self.error is not None:
            print(f"hearth.backend_worker: the CUDA context made beside the imports: {self.error} "
                  "(torch makes it instead)", file=sys.stderr)


def _start_profile():
    """$HEARTH_WORKER_PROFILE (a directory): the start from attach to the end
    of initialize runs under cProfile, written there as
    start-<model>-<pid>.prof (read it with python3 -m pstats)."""
    if not os.environ.get("HEARTH_WORKER_PROFILE"):
        return None
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
    return profile


def _end_profile(profile, model):
    if profile is None:
        return
    profile.disable()
    path = os.path.join(os.environ["HEARTH_WORKER_PROFILE"], f"start-{model}-{os.getpid()}.prof")
    try:
        profile.dump_stats(path)
    except OSError as e:
        print(f"hearth.backend_worker: HEARTH_WORKER_PROFILE: {e}", file=sys.stderr)


def _parser():
    p = argparse.ArgumentParser(prog="python -m hearth.backend_worker",
                                description="The Python backend's worker (started by hearth serve).")
    p.add_argument("--store-socket", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--version", type=int, default=0)
    p.add_argument("--backend", default="python")
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--slot-fd", type=int, required=True)
    p.add_argument("--allow-tf32", action="store_true")
    p.add_argument("--fault-kind", default="")
    p.add_argument("--fault-on-value", type=float, default=0.0)
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--standby", action="store_true",
                   help="import what the model needs, then wait until the server puts this worker to work")
    p.add_argument("--device", default="", help="a standby's hint: the model's device")
    p.add_argument("--zygote", action="store_true",
                   help="import what the model needs, then fork workers on the server's request")
    return p


def _import_model(w, decoupled, phases):
    """The imports every worker needs and the model's class: the slow part
    of a start, done before the device is touched (by a standby before it
    waits, by a zygote once for all its workers). Returns the Model class."""
    import hearth  # noqa: F401
    try:
        import hearth.torch  # noqa: F401
        import torch  # noqa: F401  what state_dict needs: imported before a standby waits
    except ImportError:
        pass
    phases.done("imports")
    Model = _load_model_class(w.version_dir, decoupled)
    _check_execute(Model, decoupled, os.path.join(w.version_dir, "model.py"))
    phases.done("model.py")
    return Model


def _decoupled(lib, handle):
    return hasattr(lib, "hearth_worker_decoupled") and lib.hearth_worker_decoupled(handle) == 1


def main(argv=None):
    unsupported = _platform.current().serve_worker_unsupported()
    if unsupported:
        print(f"hearth.backend_worker: {unsupported}", file=sys.stderr)
        return 2
    a = _parser().parse_args(argv)
    if a.zygote:
        return _zygote_main(a)
    return _worker_main(a, _Phases(), None)


def _zygote_main(a):
    """A zygote (hearth/_zygote.py): reads the model's setup, imports what its
    workers need, checks that no device was touched, then forks workers."""
    from hearth import _zygote
    phases = _Phases()
    zygote = _zygote.Zygote(a.control_fd, a.parent_pid)
    lib = _capi.library()
    _declare(lib)
    # The setup is read through a copy of each descriptor: the zygote keeps
    # its socket for its own protocol, and closes the slot, which it never uses.
    handle = ctypes.c_void_p()
    if lib.hearth_worker_open(os.dup(a.control_fd), os.dup(a.slot_fd), 10000,
                              ctypes.byref(handle)) != 0:
        zygote.send("failed", f"reading the model's setup: {lib.hearth_last_error().decode()}")
        return 1
    os.close(a.slot_fd)
    try:
        w = _Worker(lib, handle)
        phases.done("setup")
        Model = _import_model(w, _decoupled(lib, handle), phases)
    except BaseException:
        text = traceback.format_exc()
        print(text, file=sys.stderr, end="")
        zygote.send("failed", text.strip().splitlines()[-1])
        return 1
    finally:
        lib.hearth_worker_close(handle)
    why = _zygote.unsupported() or _zygote.device_in_use() or _zygote.threads_running()
    if why is not None:
        zygote.send("refused", why)
        return 0
    worker_name = _zygote.process_name()
    _zygote.set_process_name("hearth-zygote")
    # The server ends it (end-of-file, or SIGKILL); a signal meant for the
    # server's group (a terminal's ^C) is the server's to handle.
    import signal
    handlers = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    zygote.send("ready", *(f"{name}={seconds:.3f}" for name, seconds in phases.times),
                f"threads={_zygote.native_threads()}")

    def run_worker(args):
        for number, handler in handlers.items():
            signal.signal(number, handler)
        if worker_name:
            _zygote.set_process_name(worker_name)
        return _worker_main(_parser().parse_args(args), _Phases("fork"), Model)

    return zygote.serve(run_worker)


def _worker_main(a, phases, Model):
    """A worker's life. `Model`: the model's class, already imported (a
    worker forked from the zygote), or None."""
    lib = _capi.library()
    _declare(lib)
    handle = ctypes.c_void_p()
    if lib.hearth_worker_open(a.control_fd, a.slot_fd, 10000, ctypes.byref(handle)) != 0:
        print(f"hearth.backend_worker: {lib.hearth_last_error().decode()}", file=sys.stderr)
        return 1
    w = _Worker(lib, handle)
    model = None
    try:
        if a.fault_kind not in ("", "abort", "segv", "hang"):
            w.fail(_capi.ERROR_INVALID_ARGUMENT,
                   f"fault_injection kind {a.fault_kind!r}: backend: python injects abort, segv or "
                   "hang (cuda_illegal_address needs a kernel of hearth's GPU backends)")
            return 1
        tensor_type = w.parameters.get("tensor_type", "numpy")
        if tensor_type not in ("numpy", "torch"):
            w.fail(_capi.ERROR_INVALID_ARGUMENT,
                   f"parameters.tensor_type: {tensor_type!r} is not numpy or torch")
            return 1
        decoupled = _decoupled(lib, handle)
        if decoupled and not hasattr(lib, "hearth_worker_stream_next"):
            w.fail(_capi.ERROR_INVALID_ARGUMENT, "a decoupled model needs libhearth's ABI version 7 "
                   "(hearth_worker_stream_next); this libhearth is older")
            return 1
        standby_ms = None
        try:
            # Imports first (torch, model.py and what it imports: the slow part
            # of a start), which a standby does before it is needed. Nothing
            # here may touch the device: a standby holds no device context.
            started = time.monotonic()
            phases.done("setup")
            if Model is None:
                ordinal = None if a.standby else _EarlyContext.ordinal(a.device)
                early = None if ordinal is None else _EarlyContext(ordinal)
                Model = _import_model(w, decoupled, phases)
                if early is not None:
                    early.join()
                    phases.done("context")
            # A Triton model completes a config that lists no input or output
            # (its auto_complete_config); the server takes what it reports.
            if hasattr(Model, "complete_config"):
                w.config = Model.complete_config(w.config)
            inputs_spec = _signature(w.config, "input")
            outputs_spec = _signature(w.config, "output")
            if not inputs_spec or not outputs_spec:
                raise ValueError("backend: python needs the config to list its input and output "
                                 "(or, for a Triton model, an auto_complete_config that adds them)")
            if w.parameters.get("resumable") == "true" and \
                    inspect.isgeneratorfunction(getattr(Model, "execute", None)):
                raise TypeError("parameters.resumable: a stream resumes through "
                                "Request.resume_token_ids, which a generator execute(inputs, "
                                "parameters) is never given: write def execute(self, requests)")
            import hearth
            hearth_torch = sys.modules.get("hearth.torch")
            if a.standby:
                standby_ms = round(1000 * (time.monotonic() - started))
                if not hasattr(lib, "hearth_worker_wait_start"):
                    raise OSError("a standby worker needs libhearth's ABI version 5 "
                                  "(hearth_worker_wait_start); this libhearth is older")
                go = lib.hearth_worker_wait_start(handle)
                if go == 0:
                    return 0  # the server let this standby go
                if go < 0:
                    raise OSError(w.error())
                phases.skip()
            profile = _start_profile()
            if _holds_weights(w.version_dir):
                weights = hearth.attach(a.model, socket=a.store_socket, version=a.version or None)
                device = weights.device
                phases.done("attach")
                tensors = hearth_torch.state_dict(weights) if hearth_torch is not None else weights
                phases.done("tensors")
            else:
                device, tensors = a.device or "cpu", {}
            model = Model()
            args = {"model_config": w.config, "model_name": a.model,
                    "model_version": str(w.config.get("version_policy", {})
                                         .get("specific", {}).get("versions", [a.version])[0]),
                    "model_repository": w.version_dir, "device": device,
                    "weights": _ReadOnly(tensors),
                    "max_streams": lib.hearth_worker_stream_capacity(handle) if decoupled else 1}
            model.initialize(args)
            phases.done("initialize")
            _end_profile(profile, a.model)
            zygote = sys.modules.get("hearth._zygote")
            if zygote is not None:
                zygote.report_imports()  # a forked worker: what the zygote may import for the next
        except BaseException:
            text = traceback.format_exc()
            print(text, file=sys.stderr, end="")
            w.fail(_capi.ERROR_INVALID_ARGUMENT, text.strip())
            return 1
        text = f"{device} (python {sys.version.split()[0]}, pid {os.getpid()}"
        if phases.times and phases.times[0][0] == "fork":
            text += "; forked from the zygote"
        if standby_ms is not None:
            text += f"; a standby, loaded {standby_ms} ms before"
        text += f"; start: {phases.text()})"
        if hasattr(lib, "hearth_worker_start_phase"):
            for name, seconds in phases.times:
                lib.hearth_worker_start_phase(handle, name.encode(), round(seconds * 1e6))
        ins, outs = w.specs(inputs_spec), w.specs(outputs_spec)
        if lib.hearth_worker_ready(handle, ins, len(inputs_spec), outs, len(outputs_spec),
                                   _device_memory(), text.encode()) != 0:
            print(f"hearth.backend_worker: {w.error()}", file=sys.stderr)
            return 1
        fault = (a.fault_kind, a.fault_on_value) if a.fault_kind else None
        serve = _serve_decoupled if decoupled else _serve
        code = serve(w, model, inputs_spec, outputs_spec, tensor_type, fault)
        if hasattr(model, "finalize"):
            try:
                model.finalize()
            except Exception:
                traceback.print_exc()
        return code
    finally:
        lib.hearth_worker_close(handle)


class _ReadOnly(dict):
    """The weights Mapping handed to initialize(): no item can be replaced."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("the weights are the store's, read-only: copy a tensor to change it")

    __setitem__ = __delitem__ = pop = popitem = clear = update = setdefault = _refuse


if __name__ == "__main__":
    sys.exit(main())
