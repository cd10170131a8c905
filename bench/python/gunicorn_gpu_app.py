"""The gunicorn app of bench/python/gunicorn_gpu.py: two shared models per worker.

    gunicorn -w 8 --preload gunicorn_gpu_app:app     (cwd bench/python)

Like examples/gunicorn_flask/run_server.py, but it attaches two models of the
store, both lazily (the preloading master maps nothing and never touches a
GPU): "scale" (the example's 500-float weight) and "mlp" (the seed's
16384 -> 16384 -> 12800 MLP, 1.8 GiB of f32). Every request reads all of
both, so every worker that answered has mapped and read the whole MLP: the
benchmark then measures that 8 such workers hold no copy of it.

Environment: HEARTH_SOCKET, HEARTH_LIBRARY; HEARTH_SCALE_MODEL (default
"scale"), HEARTH_MLP_MODEL (default "mlp").

POST / {"number": n [, "seed": s]} -> {"pid", "device", "scale": float, "mlp": {name: float}}
    scale: run_server.py's result, sum(x * weight) with x =
           default_rng(seed).random((n, N), float32), seed defaulting to n;
    mlp:   the sum of every tensor of the MLP (float64 of float32 row sums on
           a GPU: no temporary the size of a weight).
GET /health -> {"status", "pid", "device"}
"""

import os

import numpy as np
from flask import Flask, jsonify, request

import hearth

MAX_NUMBER = 10000

scale = hearth.attach(os.environ.get("HEARTH_SCALE_MODEL", "scale"))  # lazy: maps nothing yet
mlp = hearth.attach(os.environ.get("HEARTH_MLP_MODEL", "mlp"))

app = Flask(__name__)


def scale_sum(number, seed, weight):
    x = np.random.default_rng(seed).random((number, weight.shape[0]), dtype=np.float32)
    if weight.device == "cpu":
        w = weight.numpy()  # read-only view of the shared bytes
        return float(np.dot(x.sum(axis=0, dtype=np.float64), w.astype(np.float64, copy=False)))
    import torch  # only in the workers, never in the master

    w = torch.from_dlpack(weight)
    xs = torch.from_numpy(x).to(w.device).sum(dim=0, dtype=torch.float64)
    return float(torch.dot(xs, w.to(torch.float64)).item())


def tensor_sum(tensor):
    """The sum of every element of a shared tensor, reading it in place."""
    if tensor.device == "cpu":
        return float(tensor.numpy().sum(dtype=np.float64))  # buffered: no full-size temporary
    import torch

    x = torch.from_dlpack(tensor)
    if x.dim() >= 2:
        # Row sums in the tensor's own dtype first: sum(dtype=float64) of the whole
        # tensor would first convert it, a temporary twice the size of the weight.
        x = x.reshape(x.shape[0], -1).sum(dim=1)
    return float(x.double().sum().item())


@app.post("/")
def predict():
    data = request.get_json(silent=True)
    if not isinstance(data, dict):
        return jsonify({"error": 'expected a JSON object such as {"number": 1}'}), 400
    number = data.get("number")
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= MAX_NUMBER:
        return jsonify({"error": f"'number' must be an integer from 1 to {MAX_NUMBER}"}), 400
    seed = data.get("seed", number)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        return jsonify({"error": "'seed' must be a non-negative integer"}), 400
    try:
        result = scale_sum(number, seed, scale["weight"])
        sums = {name: tensor_sum(t) for name, t in mlp.items()}
        device = mlp.device
    except hearth.HearthError as e:
        return jsonify({"error": str(e)}), 503
    return jsonify({"pid": os.getpid(), "device": device, "scale": result, "mlp": sums})


@app.get("/health")
def health():
    try:
        return jsonify({"status": "ok", "pid": os.getpid(), "device": scale.device})
    except hearth.HearthError as e:
        return jsonify({"status": "unavailable", "pid": os.getpid(), "error": str(e)}), 503
