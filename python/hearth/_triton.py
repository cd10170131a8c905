"""Triton's Python-backend API over hearth's worker: what
`import triton_python_backend_utils as pb_utils` gives a Triton model.py, and
the adapters that serve its `TritonPythonModel` as a hearth `Model`.

A batched model (not decoupled) is given each of hearth's batches as one
InferenceRequest: the rows of the requests the server batched, along dim 0,
with no request id or parameters (hearth's batch protocol carries neither).
An error response fails that batch with a retry: the server reruns each of
its requests alone, so that only the one at fault fails, with the error's
message and code. A decoupled model is given hearth.Requests, each as an
InferenceRequest with its id, parameters and a response sender; the sender
may be called from any thread, also after execute returns (the worker's
thread hands what other threads send to hearth.Request.send, which only
it may call).

What Triton has and hearth does not (BLS: InferenceRequest.exec,
async_exec; request rescheduling; models that change their config in
auto_complete_config, beyond the inputs and outputs of a config that lists
none) raises TritonModelException naming it.
"""

import json
import queue
import sys
import threading

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

# TRITONSERVER_DataType, by number, and the config's names for them.
TYPE_INVALID, TYPE_BOOL, TYPE_UINT8, TYPE_UINT16, TYPE_UINT32, TYPE_UINT64 = 0, 1, 2, 3, 4, 5
TYPE_INT8, TYPE_INT16, TYPE_INT32, TYPE_INT64, TYPE_FP16, TYPE_FP32 = 6, 7, 8, 9, 10, 11
TYPE_FP64, TYPE_STRING, TYPE_BF16 = 12, 13, 14

_NUMPY_OF = {TYPE_BOOL: np.bool_, TYPE_UINT8: np.uint8, TYPE_UINT16: np.uint16,
             TYPE_UINT32: np.uint32, TYPE_UINT64: np.uint64, TYPE_INT8: np.int8,
             TYPE_INT16: np.int16, TYPE_INT32: np.int32, TYPE_INT64: np.int64,
             TYPE_FP16: np.float16, TYPE_FP32: np.float32, TYPE_FP64: np.float64,
             TYPE_STRING: np.object_}
_NAMES = {"TYPE_BOOL": TYPE_BOOL, "TYPE_UINT8": TYPE_UINT8, "TYPE_UINT16": TYPE_UINT16,
          "TYPE_UINT32": TYPE_UINT32, "TYPE_UINT64": TYPE_UINT64, "TYPE_INT8": TYPE_INT8,
          "TYPE_INT16": TYPE_INT16, "TYPE_INT32": TYPE_INT32, "TYPE_INT64": TYPE_INT64,
          "TYPE_FP16": TYPE_FP16, "TYPE_FP32": TYPE_FP32, "TYPE_FP64": TYPE_FP64,
          "TYPE_STRING": TYPE_STRING, "TYPE_BF16": TYPE_BF16}


def triton_to_numpy_type(data_type):
    """A TRITONSERVER_DataType number -> the NumPy type (np.object_ for
    TYPE_STRING); None for one NumPy lacks (BF16) or an unknown number."""
    return _NUMPY_OF.get(data_type)


def numpy_to_triton_type(data_type):
    """A NumPy type or dtype -> its TRITONSERVER_DataType number; bytes,
    str and object are TYPE_STRING. None when Triton has none."""
    try:
        dt = np.dtype(data_type)
    except TypeError:
        return None
    if dt.kind in "OSU":
        return TYPE_STRING
    for number, t in _NUMPY_OF.items():
        if t is not np.object_ and np.dtype(t) == dt:
            return number
    return None


def triton_string_to_numpy(triton_type_string):
    """'TYPE_FP32' (a config's data_type) -> np.float32."""
    number = _NAMES.get(triton_type_string)
    if number is None:
        raise TritonModelException(f"{triton_type_string!r} is not a Triton data type")
    t = _NUMPY_OF.get(number)
    if t is None:
        raise TritonModelException(f"{triton_type_string} has no NumPy type")
    return t


def serialize_byte_tensor(input_tensor):
    """An array of bytes/str -> Triton's serialized form (each element a
    4-byte little-endian length and its bytes) as a 1-D uint8 array; None
    for an empty array."""
    if input_tensor.size == 0:
        return None
    parts = []
    for e in np.asarray(input_tensor).reshape(-1, order="C"):
        b = e.encode() if isinstance(e, str) else bytes(e)
        parts.append(len(b).to_bytes(4, "little") + b)
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor):
    """serialize_byte_tensor's inverse: a 1-D object array of bytes."""
    raw = bytes(np.asarray(encoded_tensor, dtype=np.uint8))
    out = []
    at = 0
    while at < len(raw):
        n = int.from_bytes(raw[at:at + 4], "little")
        out.append(raw[at + 4:at + 4 + n])
        at += 4 + n
    arr = np.empty(len(out), dtype=object)
    arr[:] = out
    return arr


class TritonModelException(Exception):
    """What the API raises; a model may raise it too."""


class TritonError(Exception):
    """An error response's error: a message and one of Triton's codes."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, \
        CANCELLED = range(8)

    def __init__(self, message, code=1):
        super().__init__(message)
        self._message = str(message)
        self._code = code

    def message(self):
        return self._message

    def code(self):
        return self._code


def _unsupported(what):
    return TritonModelException(f"{what} is Triton's, and hearth's Python backend does not "
                                "offer it (docs/python-backend.md, \"Triton Python models\")")


class Tensor:
    """A named array on the host (hearth hands a Triton model NumPy arrays)."""

    def __init__(self, name, data):
        if not isinstance(name, str):
            raise TritonModelException(f"a Tensor's name is a str, not {type(name).__name__}")
        if hasattr(data, "detach") and hasattr(data, "cpu"):  # a torch tensor
            data = data.detach().cpu().numpy()
        if not isinstance(data, np.ndarray):
            raise TritonModelException(f"Tensor {name!r}: data is a numpy.ndarray, not "
                                       f"{type(data).__name__}")
        if data.dtype.kind in "SU":
            data = data.astype(object)
        self._name = name
        self._data = data

    def __repr__(self):
        return f"pb_utils.Tensor({self._name!r}, {self._data.dtype}, shape {self._data.shape})"

    def name(self):
        return self._name

    def as_numpy(self):
        return self._data

    def shape(self):
        return list(self._data.shape)

    def triton_dtype(self):
        return numpy_to_triton_type(self._data.dtype)

    def is_cpu(self):
        return True

    def to_dlpack(self):
        """A DLPack capsule viewing the array (BYTES tensors have none)."""
        if self._data.dtype == object:
            raise TritonModelException(f"Tensor {self._name!r} holds BYTES, which DLPack cannot")
        return np.ascontiguousarray(self._data).__dlpack__()

    @staticmethod
    def from_dlpack(name, dlpack_tensor):
        """A Tensor from an object with __dlpack__ (a torch tensor, an array)
        or a DLPack capsule; device tensors are copied to the host."""
        if hasattr(dlpack_tensor, "__dlpack__"):
            if hasattr(dlpack_tensor, "detach"):
                return Tensor(name, dlpack_tensor)
            return Tensor(name, np.from_dlpack(dlpack_tensor))
        if type(dlpack_tensor).__name__ == "PyCapsule":
            import torch.utils.dlpack
            return Tensor(name, torch.utils.dlpack.from_dlpack(dlpack_tensor))
        raise TritonModelException(f"Tensor.from_dlpack({name!r}): a DLPack capsule or an object "
                                   f"with __dlpack__, not {type(dlpack_tensor).__name__}")


class InferenceResponse:
    """One response: output tensors, or an error."""

    def __init__(self, output_tensors=None, error=None):
        if error is not None and not isinstance(error, TritonError):
            error = TritonError(str(error))
        self._outputs = list(output_tensors or [])
        for t in self._outputs:
            if not isinstance(t, Tensor):
                raise TritonModelException(f"InferenceResponse: output_tensors holds "
                                           f"{type(t).__name__}, not pb_utils.Tensor")
        self._error = error

    def output_tensors(self):
        return self._outputs

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


class InferenceRequest:
    """A request as execute() is given it. Built by a model (for BLS) it can
    be made, but not run: exec and async_exec raise."""

    def __init__(self, model_name="", inputs=None, requested_output_names=None, request_id="",
                 parameters=None, **kwargs):
        self._model_name = model_name
        self._inputs = list(inputs or [])
        self._requested = list(requested_output_names or [])
        self._id = request_id
        if isinstance(parameters, dict):
            parameters = json.dumps(parameters)
        self._parameters = parameters or "{}"
        self._sender = None
        self._hearth = None

    def inputs(self):
        return self._inputs

    def request_id(self):
        return self._id

    def parameters(self):
        """The request's parameters as JSON text ("{}" when none)."""
        return self._parameters

    def requested_output_names(self):
        return self._requested

    def flags(self):
        return 0

    def correlation_id(self):
        return 0

    def model_name(self):
        return self._model_name

    def timeout(self):
        return 0

    def is_cancelled(self):
        return self._hearth is not None and self._hearth.is_cancelled()

    def get_response_sender(self):
        if self._sender is None:
            raise _unsupported("a response sender of a request that is not a decoupled model's "
                               "(hearth gives one only where model_transaction_policy is "
                               "decoupled)")
        return self._sender

    def set_release_flags(self, flags):
        raise _unsupported("rescheduling a request (set_release_flags)")

    def exec(self, *args, **kwargs):
        raise _unsupported("BLS (InferenceRequest.exec: one model calling another)")

    def async_exec(self, *args, **kwargs):
        raise _unsupported("BLS (InferenceRequest.async_exec: one model calling another)")


def get_input_tensor_by_name(inference_request, name):
    for t in inference_request.inputs():
        if t.name() == name:
            return t
    return None


def get_output_tensor_by_name(inference_response, name):
    for t in inference_response.output_tensors():
        if t.name() == name:
            return t
    return None


def _config_dict(model_config):
    return json.loads(model_config) if isinstance(model_config, (str, bytes)) else model_config


def get_input_config_by_name(model_config, name):
    for io in _config_dict(model_config).get("input", []):
        if io.get("name") == name:
            return io
    return None


def get_output_config_by_name(model_config, name):
    for io in _config_dict(model_config).get("output", []):
        if io.get("name") == name:
            return io
    return None


class Logger:
    """pb_utils.Logger: to the worker's stderr, which is the server's log."""

    class LogLevel:
        INFO, WARNING, ERROR, VERBOSE = "INFO", "WARNING", "ERROR", "VERBOSE"

    prefix = ""

    @staticmethod
    def log(message, level="INFO"):
        print(f"{Logger.prefix}{getattr(level, 'name', level)}: {message}", file=sys.stderr,
              flush=True)

    @staticmethod
    def log_info(message):
        Logger.log(message, "INFO")

    @staticmethod
    def log_warn(message):
        Logger.log(message, "WARNING")

    @staticmethod
    def log_error(message):
        Logger.log(message, "ERROR")

    @staticmethod
    def log_verbose(message):
        Logger.log(message, "VERBOSE")


class ModelConfig:
    """auto_complete_config's argument: the model's config, which hearth has
    read from its config file. Changes are recorded and compared after the
    call (hearth cannot apply them: the server read the config already)."""

    def __init__(self, config):
        self._config = json.loads(json.dumps(config))

    def as_dict(self):
        return self._config

    def _add(self, which, io):
        if not isinstance(io, dict) or "name" not in io:
            raise ValueError(f"add_{which}: a dict with a name, not {io!r}")
        for have in self._config.setdefault(which, []):
            if have.get("name") == io["name"]:
                for key, value in io.items():
                    if key in have and _normal(have[key]) != _normal(value):
                        raise ValueError(f"add_{which}: {which} {io['name']!r} has {key} "
                                         f"{have[key]!r} in the config, not {value!r}")
                    have.setdefault(key, value)
                return
        self._config[which].append(dict(io))

    def add_input(self, input):  # noqa: A002  Triton's name
        self._add("input", input)

    def add_output(self, output):
        self._add("output", output)

    def set_max_batch_size(self, max_batch_size):
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self):
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict):
        self._config.setdefault("model_transaction_policy", {}).update(transaction_policy_dict)


def _normal(value):
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def _differences(before, after, where=""):
    """What `after` changed of `before`, as 'field: a -> b' lines."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in sorted(set(before) | set(after), key=str):
            name = f"{where}.{key}" if where else str(key)
            if key not in before:
                if after[key] not in ({}, [], None, False, 0, ""):
                    out.append(f"{name}: added {after[key]!r}")
            elif key not in after:
                out.append(f"{name}: removed")
            else:
                out += _differences(before[key], after[key], name)
        return out
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        out = []
        for i, (b, a) in enumerate(zip(before, after)):
            out += _differences(b, a, f"{where}[{i}]")
        return out
    if _normal(before) != _normal(after):
        return [f"{where}: {before!r} -> {after!r}"]
    return []


def _run_auto_complete(cls, config):
    hook = getattr(cls, "auto_complete_config", None)
    if hook is None:
        return None
    given = ModelConfig(config)
    result = hook(given)
    return result.as_dict() if isinstance(result, ModelConfig) else given.as_dict()


def _refuse_changes(path, before, after, what):
    """TritonModelException if auto_complete_config turned `before` into a
    different `after`: it names the model's path, `what` it changed (and
    what to do instead), and each change."""
    changes = _differences(before, after)
    if changes:
        raise TritonModelException(
            f"{path}: TritonPythonModel.auto_complete_config changed {what}. Changes: "
            + "; ".join(changes))


def _lists_no_io(config):
    return not config.get("input") and not config.get("output")


def _complete_config(cls, config, path):
    """A config that lists no input and no output (a load's partial config
    override, say) completed as Triton completes it: the inputs and outputs
    that cls.auto_complete_config adds become the model's, and the server
    takes them as the model's signature. Any other change is refused, as in
    _check_auto_complete. Without the hook, the config as it is."""
    if not _lists_no_io(config):
        return config
    got = _run_auto_complete(cls, config)
    if got is None:
        return config
    completed = dict(config)
    for which in ("input", "output"):
        if got.get(which):
            completed[which] = got[which]
    _refuse_changes(path, completed, got,
                    "more of the model's config than its inputs and outputs (which hearth takes "
                    "from it when the config lists none): write the rest into the config")
    return completed


def _check_auto_complete(cls, config, path):
    """Calls cls.auto_complete_config, if it has one, on the config hearth
    read (completed by _complete_config where it listed no input or output);
    refuses any change (hearth serves the config file as written)."""
    got = _run_auto_complete(cls, config)
    if got is None:
        return
    _refuse_changes(path, config, got,
                    "the model's config, which hearth serves as its config file says (it cannot "
                    "apply changes made at load): write them into the config file")


def _triton_args(args, decoupled):
    """Triton's initialize() args from hearth's, with hearth's own beside them."""
    import os
    device = str(args.get("device", "cpu"))
    gpu = device.startswith("cuda")
    out = dict(args)
    out.update({
        "model_config": json.dumps(args["model_config"]),
        "model_instance_kind": "GPU" if gpu else "CPU",
        "model_instance_name": f"{args['model_name']}_0_{os.getpid()}",
        "model_instance_device_id": device.split(":", 1)[1] if gpu and ":" in device else "0",
        "model_repository": os.path.dirname(os.path.abspath(args["model_repository"])),
        "model_version": str(int(os.path.basename(os.path.abspath(args["model_repository"])))),
        "model_name": args["model_name"],
    })
    return out


def _error_of(response, where):
    """A response's error as an exception hearth's worker reports with the
    error's code: TritonError (its code kept) or a TritonModelException."""
    if not isinstance(response, InferenceResponse):
        return TritonModelException(f"{where} is a {type(response).__name__}, not "
                                    "pb_utils.InferenceResponse")
    return response.error() if response.has_error() else None


def _outputs_of(response):
    return {t.name(): t.as_numpy() for t in response.output_tensors()}


class _BatchedModel:
    """A Triton model, not decoupled, served as hearth's batched Model."""

    triton_class = None  # set by adapter()
    path = ""

    def initialize(self, args):
        _check_auto_complete(self.triton_class, args["model_config"], self.path)
        Logger.prefix = f"{args['model_name']}: "
        self._outputs = [io["name"] for io in args["model_config"].get("output", [])]
        self._model = self.triton_class()
        if hasattr(self._model, "initialize"):
            self._model.initialize(_triton_args(args, False))

    def execute(self, inputs):
        tensors = []
        for name, value in inputs.items():
            if hasattr(value, "detach"):  # parameters: {tensor_type: torch}
                value = value.detach().cpu().numpy()
            tensors.append(Tensor(name, value))
        request = InferenceRequest(inputs=tensors, requested_output_names=self._outputs)
        responses = self._model.execute([request])
        if not isinstance(responses, (list, tuple)) or len(responses) != 1:
            n = len(responses) if isinstance(responses, (list, tuple)) else type(responses).__name__
            raise TritonModelException(f"execute() was given 1 request and returned {n} "
                                       "responses: return a list of one InferenceResponse per "
                                       "request, in order")
        error = _error_of(responses[0], "execute()'s response")
        if error is not None:
            raise error
        return _outputs_of(responses[0])

    def finalize(self):
        if hasattr(self._model, "finalize"):
            self._model.finalize()


class _ResponseSender:
    """A decoupled request's sender: callable from any thread."""

    def __init__(self, model, request):
        self._model = model
        self._request = request
        self._closed = False

    def send(self, response=None, flags=0):
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException(f"send(flags={flags}): the flags are 0 or "
                                       "TRITONSERVER_RESPONSE_COMPLETE_FINAL")
        if response is None and flags == 0:
            raise TritonModelException("send(): a response, or flags="
                                       "TRITONSERVER_RESPONSE_COMPLETE_FINAL, or both")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(f"send(): the response is a {type(response).__name__}, not "
                                       "pb_utils.InferenceResponse")
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        if flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self._closed = True
        self._model._send(self._request, response, flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self):
        return self._request.is_cancelled()


class _DecoupledModel:
    """A decoupled Triton model served as hearth's stream Model: execute()
    is given hearth.Requests; step() hands to them what the model's threads
    sent since (only the worker's thread may call hearth.Request.send)."""

    triton_class = None
    path = ""
    # How long step() waits for a response from the model's threads before
    # it lets the worker look for new requests and cancellations.
    poll_seconds = 0.005

    def initialize(self, args):
        _check_auto_complete(self.triton_class, args["model_config"], self.path)
        Logger.prefix = f"{args['model_name']}: "
        self._outputs = [io["name"] for io in args["model_config"].get("output", [])]
        self._thread = threading.get_ident()
        self._queue = queue.SimpleQueue()
        self._model = self.triton_class()
        if hasattr(self._model, "initialize"):
            self._model.initialize(_triton_args(args, True))

    def _send(self, request, response, final):
        if threading.get_ident() != self._thread:
            self._queue.put((request, response, final))
            return
        self._drain()
        self._deliver(request, response, final)

    def _deliver(self, request, response, final):
        if response is not None and response.has_error():
            error = response.error()
            _fail(request, error.code(), error.message())
            return
        request.send(_outputs_of(response) if response is not None else None, final=final)

    def _drain(self, wait=0.0):
        try:
            item = self._queue.get(timeout=wait) if wait else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._deliver(*item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return

    def execute(self, requests):
        wrapped = []
        for r in requests:
            w = InferenceRequest(inputs=[Tensor(n, v) for n, v in r.inputs.items()],
                                 requested_output_names=self._outputs, request_id=r.id,
                                 parameters=json.dumps(r.parameters))
            w._hearth = r
            w._sender = _ResponseSender(self, r)
            wrapped.append(w)
        result = self._model.execute(wrapped)
        if result is not None:
            for r in requests:
                _fail(r, TritonError.INTERNAL, "a decoupled model's execute() returns None and "
                      "answers through each request's response sender; this one returned "
                      f"{type(result).__name__}")
        self._drain()

    def step(self):
        self._drain(self.poll_seconds)

    def finalize(self):
        if hasattr(self._model, "finalize"):
            self._model.finalize()


def _fail(request, code, message):
    """Ends a hearth.Request with a Triton error code's status."""
    from . import _capi
    if request._over:
        return
    status = _capi.ERROR_INVALID_ARGUMENT if code == TritonError.INVALID_ARG else \
        _capi.ERROR_INTERNAL
    request._worker._end(request, status, message)


def status_of(error):
    """(hearth status, message) for an exception from a Triton model's
    execute, or None when it is no error of this API's."""
    from . import _capi
    if isinstance(error, TritonError):
        return (_capi.ERROR_INVALID_ARGUMENT if error.code() == TritonError.INVALID_ARG
                else _capi.ERROR_INTERNAL), error.message()
    return None


def adapter(triton_class, decoupled, path):
    """A hearth Model class serving `triton_class` (model.py's TritonPythonModel).
    Its complete_config(config) is _complete_config for that class."""
    base = _DecoupledModel if decoupled else _BatchedModel
    return type("Model", (base,), {
        "triton_class": triton_class, "path": path,
        "complete_config": staticmethod(lambda config: _complete_config(triton_class, config, path)),
    })


__all__ = [
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL", "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END", "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64",
    "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32", "TYPE_FP64",
    "TYPE_STRING", "TYPE_BF16",
    "triton_to_numpy_type", "numpy_to_triton_type", "triton_string_to_numpy",
    "serialize_byte_tensor", "deserialize_bytes_tensor",
    "TritonModelException", "TritonError", "Tensor", "InferenceResponse", "InferenceRequest",
    "get_input_tensor_by_name", "get_output_tensor_by_name", "get_input_config_by_name",
    "get_output_config_by_name", "Logger", "ModelConfig",
]
