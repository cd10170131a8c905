"""A decoupled model's requests in its worker: hearth.Request, and the loop
that hands them to the model (hearth.backend_worker's `_serve_streams`).

A worker holds up to `max_streams` requests at once (the config's
parameters.max_streams, 1 by default). A model whose `execute(self,
requests)` is a plain function is given new requests as they come, and
answers each through its `send`; its optional `step()` is called again and
again while any request it was given is unfinished, so that it can advance
all of them together (one forward per step for every active stream). A
model whose execute is a generator function, `execute(self, inputs,
parameters)`, keeps working unchanged: each request's generator is advanced
by one response in turn.
"""

import ctypes
import json
import sys
import traceback


class _ServerGone(Exception):
    """The server closed the control channel: the worker exits quietly."""


class Request:
    """One request of a decoupled model: its inputs, parameters and the way
    to answer it.

    - `id`: the client's id for it ("" when it gave none).
    - `inputs`: {name: array} as the generator API's inputs (BYTES inputs as
      NumPy object arrays of bytes); views of the request slot, valid until
      the request's final response or its cancellation: copy what must
      outlive them.
    - `parameters`: the request's parameters, a dict ({} when none).
    - `resume_token_ids`: [] for a new stream. When the worker that served
      this stream died, the server hands it to another with the token ids its
      client already has (the model's `token_ids` outputs of every response
      sent, in order; config `parameters: {resumable: "true"}`): the model
      goes on from there without sending their text again.
    """

    __slots__ = ("id", "inputs", "parameters", "resume_token_ids", "_key", "_worker", "_over",
                 "_cancelled")

    def __init__(self, worker, key, request_id, inputs, parameters, resume_token_ids):
        self.id = request_id
        self.inputs = inputs
        self.parameters = parameters
        self.resume_token_ids = resume_token_ids
        self._key = key
        self._worker = worker
        self._over = False
        self._cancelled = False

    def __repr__(self):
        return f"hearth.Request(id={self.id!r}, parameters={self.parameters!r})"

    def is_cancelled(self):
        """True once its client went away or its deadline passed: the server
        has ended it; drop it (send() now sends nothing)."""
        return self._cancelled

    def send(self, outputs=None, final=False):
        """One response: a dict of outputs (any subset of the config's; each
        checked as a batch's outputs are). final=True ends the stream
        (outputs may then be None). False: the request is over (cancelled,
        or it ended with an error its outputs caused): drop it."""
        if self._over:
            return False
        return self._worker.respond(self, outputs or {}, bool(final))

    def fail(self, error):
        """Ends the stream with `error` (an exception, or a message):
        hearth.InvalidArgument is the client's fault (HTTP 400), anything
        else the model's (500)."""
        if self._over:
            return
        self._worker.fail(self, error)


class StreamWorker:
    """The worker's side: requests by key, responses through libhearth."""

    def __init__(self, w, np, torch, inputs_spec, outputs_spec, give_outputs, read_inputs,
                 error_code, last_line, output_error):
        self.w = w
        self.np = np
        self.torch = torch
        self.inputs_spec = inputs_spec
        self.outputs_spec = outputs_spec
        self._give = give_outputs
        self._read = read_inputs
        self._code = error_code
        self._line = last_line
        self._output_error = output_error
        self.live = {}  # key -> Request, until it ends

    def open(self, key):
        lib, h = self.w.lib, self.w.h
        rid, params = ctypes.c_char_p(), ctypes.c_char_p()
        resume, count = ctypes.POINTER(ctypes.c_int64)(), ctypes.c_uint64()
        if lib.hearth_worker_stream_request(h, key, ctypes.byref(rid), ctypes.byref(params),
                                            ctypes.byref(resume), ctypes.byref(count)) != 0:
            raise OSError(self.w.error())
        request = Request(self, key, (rid.value or b"").decode(errors="replace"), None, None,
                          [resume[i] for i in range(count.value)])
        self.live[key] = request
        try:
            text = (params.value or b"").decode()
            parameters = json.loads(text) if text else {}
            if not isinstance(parameters, dict):
                raise ValueError(f"the request's parameters are a JSON "
                                 f"{type(parameters).__name__}, not an object")
        except (ValueError, UnicodeError) as e:
            self._end(request, self._invalid(), f"the request's parameters: {e}")
            return None
        request.parameters = parameters
        request.inputs = self._read(self.w, self.np, self.torch, self.inputs_spec, key)
        return request

    def cancelled(self, key):
        request = self.live.pop(key, None)
        if request is not None:
            request._cancelled = True
            request._over = True
        return request

    def _invalid(self):
        from . import _capi
        return _capi.ERROR_INVALID_ARGUMENT

    def respond(self, request, outputs, final):
        lib, h = self.w.lib, self.w.h
        try:
            if not isinstance(outputs, dict):
                raise self._output_error(
                    f"a response is a dict of outputs, not {type(outputs).__name__}")
            self._give(self.w, self.np, self.outputs_spec, outputs, True, request._key)
        except self._output_error as e:
            self._end(request, self._invalid(), str(e))
            return False
        except (TypeError, ValueError, UnicodeError, OverflowError) as e:
            self._end(request, self._invalid(),
                      f"the outputs cannot be converted: {type(e).__name__}: {e}")
            return False
        r = lib.hearth_worker_stream_respond(h, request._key, 1 if final else 0, 0, None)
        return self._after(request, r, final)

    def fail(self, request, error):
        if isinstance(error, BaseException):
            code, message = self._code(error), self._line(error)
        else:
            from . import _capi
            code, message = _capi.ERROR_INTERNAL, str(error)
        self._end(request, code, message)

    def _end(self, request, code, message):
        lib, h = self.w.lib, self.w.h
        r = lib.hearth_worker_stream_respond(h, request._key, 1, code,
                                             message.encode(errors="replace"))
        self._after(request, r, True)

    def _after(self, request, r, final):
        if r == 0:
            raise _ServerGone()
        if r < 0:
            raise OSError(self.w.error())
        if r == 2 or final:
            request._over = True
            if r == 2:
                request._cancelled = True
            self.live.pop(request._key, None)
            return r == 1
        return True


def serve(w, model, sw, generator_api, fault_check=None):
    """The worker's loop: new requests and cancellations from the server,
    then the model's work, until the server closes the channel (0) or an
    error (2)."""
    lib, h = w.lib, w.h
    step = None if generator_api else getattr(model, "step", None)
    gens = {}  # generator API: key -> (request, generator)
    key = ctypes.c_uint64()
    try:
        while True:
            busy = bool(gens) if generator_api else (step is not None and bool(sw.live))
            new = []
            timeout = 0 if busy else -1
            while True:
                r = lib.hearth_worker_stream_next(h, timeout, ctypes.byref(key))
                if r == 0:
                    return 0
                if r < 0:
                    print(f"hearth.backend_worker: {w.error()}", file=sys.stderr)
                    return 2
                if r == 3:
                    break
                timeout = 0
                if r == 1:
                    request = sw.open(key.value)
                    if request is not None:
                        if fault_check is not None:
                            fault_check(request.inputs)
                        new.append(request)
                elif r == 2:
                    request = sw.cancelled(key.value)
                    g = gens.pop(key.value, None)
                    if g is not None:
                        _close(g[1])
                    new = [n for n in new if n._key != key.value]
            if generator_api:
                for request in new:
                    try:
                        gens[request._key] = (request, model.execute(request.inputs,
                                                                     request.parameters))
                    except Exception as e:  # a wrapper around the generator that raised at once
                        traceback.print_exc()
                        request.fail(e)
                _advance(sw, gens)
                continue
            if new:
                try:
                    model.execute(new)
                except Exception as e:
                    traceback.print_exc()
                    _exit_if_cuda_is_lost()
                    for request in new:
                        request.fail(e)
            if step is not None and sw.live:
                try:
                    step()
                except Exception as e:  # every stream it holds ends with the error
                    traceback.print_exc()
                    _exit_if_cuda_is_lost()
                    for request in list(sw.live.values()):
                        request.fail(e)
    except _ServerGone:
        return 0


def _advance(sw, gens):
    """Each generator's next response, in turn; an ended one leaves."""
    for k, (request, gen) in list(gens.items()):
        if request._over:
            gens.pop(k, None)
            _close(gen)
            continue
        try:
            outputs = next(gen)
        except StopIteration:
            gens.pop(k, None)
            request.send(None, final=True)
            continue
        except Exception as e:  # this stream ends with the error
            traceback.print_exc()
            _exit_if_cuda_is_lost()
            gens.pop(k, None)
            request.fail(e)
            continue
        if not isinstance(outputs, dict):
            gens.pop(k, None)
            _close(gen)
            sw._end(request, sw._invalid(),
                    f"execute() yielded {type(outputs).__name__}, not a dict of outputs")
            continue
        if not request.send(outputs):
            gens.pop(k, None)
            _close(gen)


def _close(gen):
    """GeneratorExit at the model's yield, so that its finally blocks run.
    What they raise is logged: the stream is over either way."""
    try:
        gen.close()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        _exit_if_cuda_is_lost()


def _exit_if_cuda_is_lost():
    worker = sys.modules.get("hearth.backend_worker") or sys.modules.get("__main__")
    check = getattr(worker, "_exit_if_cuda_is_lost", None)
    if check is not None:
        check()
