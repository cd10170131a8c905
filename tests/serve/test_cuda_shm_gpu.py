"""CUDA shared memory (Triton's cudasharedmemory extension) end to end, on a
GPU: this test is the client. It allocates device memory with the CUDA
driver (ctypes, no torch), registers it by its CUDA IPC handle over REST,
and sends requests whose inputs are read from, and outputs written to, its
regions; the workers copy them device to device (the built-in backends take
the regions' addresses; a Python model gets them through its slot). Answers
equal the inline ones; merged batches that mix regions and inline requests
stay right; a region registered larger than its allocation, a handle the
driver refuses, or an offset past the region fail that request alone,
naming it, while the server goes on serving.

Runs with HEARTH_TEST_DEVICE=cuda on a machine with a GPU; skips otherwise.
"""

import base64
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest
import requests

from cuda_driver import Cuda
from serve_support import (CLI, MLP, ON_GPU, SCALE_N, infer_json, mlp_config, mlp_reference, read_safetensors,
                           scale_config, start_serve, stop_serve)

pytestmark = pytest.mark.skipif(not ON_GPU, reason="CUDA shared memory needs a GPU (HEARTH_TEST_DEVICE=cuda)")


def python_scale_config():
    """The scale model's config, served by examples/python_backend/scale_model.py."""
    return scale_config(count=1, extra=f"parameters:\n  python: {sys.executable}\n",
                        kind="KIND_GPU").replace("backend: scale", "backend: python", 1)


@pytest.fixture(scope="module")
def server():
    try:
        cuda = Cuda(0)
    except OSError as e:
        pytest.skip(f"no CUDA driver here: {e}")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-cuda-shm-"))
    root = tmp / "repo"
    for name in ("scale", "mlp", "pyscale", "bigscale"):
        (root / name / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "6",
                    "--out", str(root / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    subprocess.run([CLI, "make-model", "mlp", "--dims", ",".join(map(str, MLP)), "--seed", "5",
                    "--out", str(root / "mlp" / "1" / "model.safetensors")], check=True, capture_output=True)
    shutil.copy(root / "scale" / "1" / "model.safetensors", root / "pyscale" / "1" / "model.safetensors")
    shutil.copy(root / "scale" / "1" / "model.safetensors", root / "bigscale" / "1" / "model.safetensors")
    (root / "bigscale" / "config.yaml").write_text(scale_config(count=1, extra=f"""dynamic_batching:
  max_queue_delay_microseconds: 20000
  preferred_batch_size: [{BIG_ROWS}]
""").replace("max_batch_size: 4", f"max_batch_size: {BIG_ROWS}"))
    (root / "scale" / "config.yaml").write_text(scale_config(count=2, extra="""dynamic_batching:
  max_queue_delay_microseconds: 2000
  preferred_batch_size: [4]
"""))
    (root / "mlp" / "config.yaml").write_text(mlp_config(count=1))
    have_torch = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0
    if have_torch:
        example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python_backend" / "scale_model.py"
        shutil.copy(example, root / "pyscale" / "1" / "model.py")
        (root / "pyscale" / "config.yaml").write_text(python_scale_config())
    else:
        shutil.rmtree(root / "pyscale")
    state = start_serve(tmp, root, ["--grpc-port", "-1"])
    state["cuda"] = cuda
    state["have_torch"] = have_torch
    state["weights"] = {"scale": read_safetensors(root / "scale" / "1" / "model.safetensors"),
                        "mlp": read_safetensors(root / "mlp" / "1" / "model.safetensors")}
    state["allocations"] = []
    yield state
    requests.post(state["url"] + "/v2/cudasharedmemory/unregister", timeout=30)
    code, text = stop_serve(state)
    for ptr in state["allocations"]:
        cuda.free(ptr)
    shutil.rmtree(tmp, ignore_errors=True)
    assert code == 0, text[-3000:]


def region(server, name, nbytes, register_size=None, handle=None):
    """Allocates `nbytes` on the device and registers it as `name`."""
    cuda = server["cuda"]
    ptr = cuda.alloc(nbytes)
    server["allocations"].append(ptr)
    raw = cuda.handle(ptr) if handle is None else handle
    r = requests.post(f"{server['url']}/v2/cudasharedmemory/region/{name}/register",
                      json={"raw_handle": {"b64": base64.b64encode(raw).decode()}, "device_id": 0,
                            "byte_size": register_size or nbytes}, timeout=30)
    assert r.status_code == 200, r.text
    return ptr


def error_of(r):
    return r.json().get("error", "") if r.headers.get("Content-Type") == "application/json" else r.text


def shm_body(model, input_name, shape, in_region, in_offset, nbytes, outputs):
    return {"inputs": [{"name": input_name, "datatype": "FP32", "shape": list(shape),
                        "parameters": {"shared_memory_region": in_region, "shared_memory_offset": in_offset,
                                       "shared_memory_byte_size": nbytes}}],
            "outputs": [{"name": name, "parameters": {"shared_memory_region": r, "shared_memory_offset": off,
                                                      "shared_memory_byte_size": size}}
                        for name, r, off, size in outputs]}


# Rows a batch of bigscale holds (its max_batch_size): 8 MiB of input.
BIG_ROWS = 4096


def slot_sizes(server, model):
    """The sizes of the server's request slots for `model` (memfds)."""
    pid, sizes = server["proc"].pid, []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:hearth-slot-{model} "):
                sizes.append(os.stat(f"/proc/{pid}/fd/{fd}").st_size)
        except OSError:
            pass  # closed meanwhile
    return sizes


def scale_x(rows, seed):
    return np.random.default_rng(seed).standard_normal((rows, SCALE_N)).astype(np.float32)


def inline_scale(url, model, x):
    r = infer_json(url, model, [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}])
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["outputs"][0]["data"], np.float32)


def test_inputs_and_outputs_in_cuda_regions_equal_inline_answers(server):
    url, cuda = server["url"], server["cuda"]
    rows = 3
    x = scale_x(rows, 1)
    ins = region(server, "sc-in", 1 << 20)
    outs = region(server, "sc-out", 1 << 20)
    cuda.put(ins + 4096, x)
    status = requests.get(f"{url}/v2/cudasharedmemory/status", timeout=30).json()
    assert {(s["name"], s["device_id"], s["byte_size"]) for s in status} >= {("sc-in", 0, 1 << 20),
                                                                              ("sc-out", 0, 1 << 20)}
    for model in ["scale"] + (["pyscale"] if server["have_torch"] else []):
        cuda.put(outs, np.zeros(64, np.uint8))
        body = shm_body(model, "x", x.shape, "sc-in", 4096, x.nbytes, [("y", "sc-out", 16, 4 * rows)])
        r = requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)
        assert r.status_code == 200, r.text
        (y,) = r.json()["outputs"]
        assert (y["name"], y["datatype"], y["shape"]) == ("y", "FP32", [rows, 1]) and "data" not in y, y
        got = cuda.get(outs + 16, 4 * rows).view("<f4")
        np.testing.assert_allclose(got, inline_scale(url, model, x), rtol=1e-6, atol=1e-6)
        want = (x.astype(np.float64) @ server["weights"]["scale"]["weight"].astype(np.float64)).ravel()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
        # The bytes before the output's offset are left alone.
        assert not cuda.get(outs, 16).any()
    # Unregistered and registered again under the same name on other memory:
    # the answers go to the new memory (workers keep regions open between
    # batches, by registration, never by name).
    assert requests.post(f"{url}/v2/cudasharedmemory/region/sc-out/unregister", timeout=30).status_code == 200
    fresh = region(server, "sc-out", 1 << 20)
    cuda.put(outs, np.zeros(64, np.uint8))
    body = shm_body("scale", "x", x.shape, "sc-in", 4096, x.nbytes, [("y", "sc-out", 16, 4 * rows)])
    for _ in range(4):  # on every worker, in all likelihood
        assert requests.post(f"{url}/v2/models/scale/infer", json=body, timeout=60).status_code == 200
    np.testing.assert_allclose(cuda.get(fresh + 16, 4 * rows).view("<f4"), inline_scale(url, "scale", x),
                               rtol=1e-6, atol=1e-6)
    assert not cuda.get(outs, 64).any()


def test_two_outputs_of_the_mlp_go_to_their_regions(server):
    url, cuda = server["url"], server["cuda"]
    rows = 2
    x = np.random.default_rng(3).standard_normal((rows, MLP[0])).astype(np.float32)
    ins = region(server, "mlp-in", 1 << 20)
    outs = region(server, "mlp-out", 1 << 20)
    cuda.put(ins, x)
    logits_bytes, argmax_bytes = 4 * rows * MLP[2], 8 * rows
    body = shm_body("mlp", "input", x.shape, "mlp-in", 0, x.nbytes,
                    [("logits", "mlp-out", 0, logits_bytes), ("argmax", "mlp-out", 65536, argmax_bytes)])
    body["inputs"][0]["name"] = "input"
    r = requests.post(f"{url}/v2/models/mlp/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    logits = cuda.get(outs, logits_bytes).view("<f4").reshape(rows, MLP[2])
    argmax = cuda.get(outs + 65536, argmax_bytes).view("<i8").ravel()
    want_logits, want_argmax = mlp_reference(server["weights"]["mlp"], x)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(argmax, np.asarray(want_argmax).ravel())


def test_merged_batches_of_regions_and_inline_requests_are_all_right(server):
    """Requests at once into a model that merges up to 4: some read and
    write regions (several requests share one region at different offsets),
    some are inline; each answer is its own."""
    url, cuda = server["url"], server["cuda"]
    ins = region(server, "mix-in", 1 << 20)
    outs = region(server, "mix-out", 1 << 20)
    n = 24
    xs = [scale_x(1 + k % 3, 100 + k) for k in range(n)]
    for k, x in enumerate(xs):
        cuda.put(ins + k * 16384, x)
    answers, errors = {}, []

    def one(k):
        x = xs[k]
        try:
            if k % 2 == 0:
                body = shm_body("scale", "x", x.shape, "mix-in", k * 16384, x.nbytes,
                                [("y", "mix-out", k * 64, 4 * x.shape[0])])
                r = requests.post(f"{url}/v2/models/scale/infer", json=body, timeout=60)
                assert r.status_code == 200, r.text
            else:
                answers[k] = inline_scale(url, "scale", x)
        except Exception as e:  # noqa: BLE001: reported below
            errors.append(f"request {k}: {e}")

    for _ in range(3):
        threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        w = server["weights"]["scale"]["weight"].astype(np.float64)
        for k, x in enumerate(xs):
            want = (x.astype(np.float64) @ w).ravel()
            got = cuda.get(outs + k * 64, 4 * x.shape[0]).view("<f4") if k % 2 == 0 else answers[k]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3, err_msg=f"request {k}")


def test_bad_regions_fail_their_request_alone_and_the_server_goes_on(server):
    url, cuda = server["url"], server["cuda"]
    x = scale_x(2, 7)
    good_in = region(server, "ok-in", 1 << 20)
    cuda.put(good_in, x)
    region(server, "ok-out", 1 << 20)
    # Registered as larger than its allocation: the worker finds out.
    region(server, "too-big", 1 << 20, register_size=64 << 20)
    # A handle the driver refuses (the server cannot check it; the worker can).
    region(server, "junk", 1 << 20, handle=bytes(range(64)))

    def ask(in_region, in_offset=0, out_region="ok-out"):
        body = shm_body("scale", "x", x.shape, in_region, in_offset, x.nbytes, [("y", out_region, 0, 8)])
        return requests.post(f"{url}/v2/models/scale/infer", json=body, timeout=60)

    r = ask("too-big")
    assert r.status_code == 400 and "its allocation has" in error_of(r), r.text
    r = ask("junk")
    assert r.status_code == 400 and "CUDA IPC handle" in error_of(r), r.text
    r = ask("ok-in", in_offset=(1 << 20) - 16)
    assert r.status_code == 400 and "ok-in" in error_of(r), r.text
    r = ask("ok-in", out_region="junk")
    assert r.status_code == 400 and "CUDA IPC handle" in error_of(r), r.text
    # Still serving, from regions and inline.
    assert ask("ok-in").status_code == 200
    np.testing.assert_allclose(inline_scale(url, "scale", x),
                               (x.astype(np.float64) @ server["weights"]["scale"]["weight"]).ravel(),
                               rtol=1e-4, atol=1e-3)
    # Unregistered, a region is no longer found.
    assert requests.post(f"{url}/v2/cudasharedmemory/region/ok-in/unregister", timeout=30).status_code == 200
    r = ask("ok-in")
    assert r.status_code in (400, 404) and "ok-in" in error_of(r), r.text


def test_bytes_in_regions_take_no_room_in_the_slot_of_a_backend_on_the_gpu(server):
    """The scale backend takes device addresses: a request whose 4 MiB
    input is in a region, alone or merged with inline ones, leaves the
    worker's slot (page-locked host memory) at the size the inline bytes
    need, and every answer is right."""
    url, cuda = server["url"], server["cuda"]
    w = server["weights"]["scale"]["weight"].astype(np.float64)
    rows = BIG_ROWS // 2
    x = scale_x(rows, 11)
    ins = region(server, "big-in", 2 * x.nbytes)
    outs = region(server, "big-out", 1 << 20)
    cuda.put(ins, x)
    cuda.put(ins + x.nbytes, x[::-1].copy())
    body = shm_body("bigscale", "x", x.shape, "big-in", 0, x.nbytes, [("y", "big-out", 0, 4 * rows)])
    r = requests.post(f"{url}/v2/models/bigscale/infer", json=body, timeout=120)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(cuda.get(outs, 4 * rows).view("<f4"), (x.astype(np.float64) @ w).ravel(),
                               rtol=1e-4, atol=1e-3)
    # Merged: two region requests (the second reversed, at the region's
    # second half) and small inline ones, sent at once into a queue that
    # waits 20 ms for them.
    smalls = [scale_x(1, 20 + k) for k in range(4)]
    answers, errors = {}, []

    def big(k):
        b = shm_body("bigscale", "x", x.shape, "big-in", k * x.nbytes, x.nbytes,
                     [("y", "big-out", (1 + k) * 4 * rows, 4 * rows)])
        r = requests.post(f"{url}/v2/models/bigscale/infer", json=b, timeout=120)
        if r.status_code != 200:
            errors.append(r.text)

    def small(k):
        try:
            answers[k] = inline_scale(url, "bigscale", smalls[k])
        except Exception as e:  # noqa: BLE001: reported below
            errors.append(f"inline {k}: {e}")

    threads = [threading.Thread(target=big, args=(k,)) for k in range(2)]
    threads += [threading.Thread(target=small, args=(k,)) for k in range(len(smalls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k, xk in enumerate((x, x[::-1])):
        got = cuda.get(outs + (1 + k) * 4 * rows, 4 * rows).view("<f4")
        np.testing.assert_allclose(got, (xk.astype(np.float64) @ w).ravel(), rtol=1e-4, atol=1e-3,
                                   err_msg=f"region request {k}")
    for k, xk in enumerate(smalls):
        np.testing.assert_allclose(answers[k], (xk.astype(np.float64) @ w).ravel(), rtol=1e-4, atol=1e-3,
                                   err_msg=f"inline request {k}")
    sizes = slot_sizes(server, "bigscale")
    assert sizes, "no slot of bigscale found"
    # 8 MiB of inputs went through regions; a slot holding them would be
    # at least that (slots grow in powers of two from 64 KiB).
    assert max(sizes) <= 1 << 20, sizes
