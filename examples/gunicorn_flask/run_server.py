"""The service of seeds/gunicorn-preload-cuda.txt, with its weights held by a hearth store.

    gunicorn -w 3 --preload -b 127.0.0.1:8080 run_server:app

The original loaded `model = torch.rand(500).to("cuda:0")` at import, so that
`--preload` would share it with the forked workers; the first request then
failed with "Cannot re-initialize CUDA in forked subprocess". Here the module
calls `hearth.attach("scale")` at import, in the preloading master, and that
call only records the request: the master maps nothing and never touches a
GPU. Each forked worker maps the store's single copy of the weights read-only
on its first request, so 3 workers share one copy, on the host or on a GPU.

Environment:
    HEARTH_SOCKET   the store's socket (else the library's default path)
    HEARTH_MODEL    the model name (default "scale"): one 1-D tensor "weight" [N]

POST /  {"number": n [, "seed": s]}  ->  {"result": float, "pid": worker pid}

    The seed computed `(torch.rand(n, 500) * model).sum()`. Random inputs make
    answers impossible to check, so the input here is deterministic:
        x = numpy.random.default_rng(seed).random((n, N), dtype=float32)   # seed defaults to n
        result = sum over i, j of x[i, j] * weight[j]
               = dot(x.sum(axis=0, dtype=float64), weight as float64)
    On a GPU store the same sum runs in torch on the shared device tensor.

GET /health  ->  {"status": "ok", "pid", "model", "version", "device", "attached"}
"""

import os

import numpy as np
from flask import Flask, jsonify, request

import hearth

MODEL = os.environ.get("HEARTH_MODEL", "scale")
MAX_NUMBER = 10000

# Lazy: records the request only. The gunicorn master (--preload) maps nothing;
# every worker attaches in its own process on first use.
weights = hearth.attach(MODEL)

app = Flask(__name__)


def make_input(number, seed, n):
    """The deterministic stand-in for the seed's torch.rand((number, n))."""
    return np.random.default_rng(seed).random((number, n), dtype=np.float32)


def scale_sum(x, weight):
    """sum(x * weight) over every element, accumulated in float64.

    `weight` is the shared read-only hearth.Tensor of shape [N].
    """
    if weight.device == "cpu":
        w = weight.numpy()  # read-only view of the shared bytes: no copy
        return float(np.dot(x.sum(axis=0, dtype=np.float64), w.astype(np.float64, copy=False)))
    # A GPU store: torch in the worker (never in the master), zero-copy through DLPack.
    import torch

    w = torch.from_dlpack(weight)
    xs = torch.from_numpy(x).to(w.device).sum(dim=0, dtype=torch.float64)
    return float(torch.dot(xs, w.to(torch.float64)).item())


def bad_request(message):
    return jsonify({"error": message}), 400


@app.post("/")
def predict():
    data = request.get_json(silent=True)
    if not isinstance(data, dict):
        return bad_request('expected a JSON object such as {"number": 1}')
    number = data.get("number")
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= MAX_NUMBER:
        return bad_request(f"'number' must be an integer from 1 to {MAX_NUMBER}")
    seed = data.get("seed", number)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        return bad_request("'seed' must be a non-negative integer")
    try:
        weight = weights["weight"]
    except hearth.HearthError as e:
        return jsonify({"error": str(e)}), 503
    if len(weight.shape) != 1:
        return jsonify({"error": f"model {MODEL!r}: 'weight' has shape {weight.shape}, "
                                 "expected one dimension"}), 500
    x = make_input(number, seed, weight.shape[0])
    return jsonify({"result": scale_sum(x, weight), "pid": os.getpid()})


@app.get("/health")
def health():
    try:
        return jsonify({"status": "ok", "pid": os.getpid(), "model": weights.model,
                        "version": weights.version, "device": weights.device,
                        "attached": weights.attached})
    except hearth.HearthError as e:
        return jsonify({"status": "unavailable", "pid": os.getpid(), "error": str(e)}), 503
