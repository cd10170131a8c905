"""`hearth serve`'s Triton REST extensions, driven with `requests` (no Triton
client in CI) against a real server: the model config agrees with
config.yaml; statistics count this test's requests in Triton's fields; the
repository index, and unload / load / a new version's load while requests
keep coming over REST (none fails); system shared memory with /dev/shm
objects of mode 0600 (inputs read from and outputs written to regions,
answers equal to inline ones and to NumPy); classification equals the top
logits; priority levels are the model's; sequences are refused; CUDA shared
memory lists no regions and refuses a malformed one; HEAD has no body.

Paths: $HEARTH_CLI (default build/bin/hearth).
"""

import json
import mmap
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import threading

import numpy as np
import pytest
import requests

from serve_support import (CLI, MLP, SCALE_N, infer_json, mlp_config, mlp_reference, read_safetensors,
                           scale_config, start_serve, stop_serve)


def write_repository(root):
    for name in ("mlp", "scale", "broken", "prio", "swap"):
        (root / name / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "mlp", "--dims", ",".join(map(str, MLP)), "--seed", "5",
                    "--out", str(root / "mlp" / "1" / "model.safetensors")], check=True, capture_output=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "6",
                    "--out", str(root / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    for name in ("broken", "prio", "swap"):
        shutil.copy(root / "scale" / "1" / "model.safetensors", root / name / "1" / "model.safetensors")
    (root / "mlp" / "config.yaml").write_text(mlp_config(count=1))
    (root / "scale" / "config.yaml").write_text(scale_config(count=2, extra="""dynamic_batching:
  max_queue_delay_microseconds: 100
  preferred_batch_size: [2, 4]
"""))
    (root / "prio" / "config.yaml").write_text(scale_config(count=1, extra="""dynamic_batching:
  priority_levels: 2
  default_priority_level: 2
"""))
    (root / "swap" / "config.yaml").write_text(scale_config(count=1))
    (root / "broken" / "config.yaml").write_text(scale_config(count=1).replace(f"dims: [{SCALE_N}]", "dims: [9]"))


@pytest.fixture(scope="module")
def server():
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-rest-triton-"))
    write_repository(tmp / "repo")
    state = start_serve(tmp, tmp / "repo", ["--grpc-port", "-1"])
    state["weights"] = {
        "mlp": read_safetensors(tmp / "repo" / "mlp" / "1" / "model.safetensors"),
        "scale": read_safetensors(tmp / "repo" / "scale" / "1" / "model.safetensors"),
    }
    state["tmp"] = tmp
    yield state
    code, text = stop_serve(state)
    shutil.rmtree(tmp, ignore_errors=True)
    assert code == 0, text[-2000:]


def scale_x(rows, seed):
    return np.random.default_rng(seed).standard_normal((rows, SCALE_N)).astype(np.float32)


def scale_reference(server, x, weight=None):
    w = server["weights"]["scale"]["weight"] if weight is None else weight
    return (x.astype(np.float64) @ w.astype(np.float64)).ravel()


def infer_scale(url, model, x, **extra):
    return infer_json(url, model, [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                    "data": x.ravel().tolist()}], **extra)


def error_of(r):
    return r.json().get("error", "") if r.headers.get("Content-Type") == "application/json" else r.text


def test_model_config_says_what_config_yaml_says(server):
    for path in ("/v2/models/scale/config", "/v2/models/scale/versions/1/config"):
        r = requests.get(server["url"] + path, timeout=30)
        assert r.status_code == 200, r.text
        config = r.json()
        assert config["name"] == "scale" and config["max_batch_size"] == 4
        assert [(i["name"], i["data_type"], [int(d) for d in i["dims"]]) for i in config["input"]] == \
            [("x", "TYPE_FP32", [SCALE_N])]
        assert config["dynamic_batching"]["preferred_batch_size"] == [2, 4]
    r = requests.get(server["url"] + "/v2/models/nope/config", timeout=30)
    assert r.status_code == 404 and "nope" in error_of(r)


def test_statistics_count_this_tests_requests(server):
    url = server["url"]

    def scale_stats():
        r = requests.get(f"{url}/v2/models/scale/stats", timeout=30)
        assert r.status_code == 200, r.text
        (s,) = r.json()["model_stats"]
        assert (s["name"], s["version"]) == ("scale", "1")
        return s

    before = scale_stats()
    for rows in (1, 2, 3):
        assert infer_scale(url, "scale", scale_x(rows, rows)).status_code == 200
    after = scale_stats()
    assert after["inference_count"] - before["inference_count"] == 6
    stats = after["inference_stats"]
    # Every field of Triton's $inference_stats: perf_analyzer reads cache_hit and cache_miss
    # unconditionally (hearth has no response cache: they stay zero).
    assert set(stats) == {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
                          "cache_hit", "cache_miss"}
    assert stats["cache_hit"] == stats["cache_miss"] == {"count": 0, "ns": 0}
    assert after["response_stats"] == {} and after["memory_usage"] == []
    assert stats["success"]["count"] - before["inference_stats"]["success"]["count"] == 3
    assert 1 <= after["execution_count"] - before["execution_count"] <= 3
    assert stats["compute_infer"]["ns"] > before["inference_stats"]["compute_infer"]["ns"]
    assert after["last_inference"] > 0 and after["last_inference"] >= before["last_inference"]
    assert sum(b["compute_infer"]["count"] for b in after["batch_stats"]) == after["execution_count"]
    assert all(set(b) == {"batch_size", "compute_input", "compute_infer", "compute_output"}
               for b in after["batch_stats"])
    # /v2/models/stats is every model's, not a model named "stats".
    r = requests.get(f"{url}/v2/models/stats", timeout=30)
    assert r.status_code == 200, r.text
    assert {"mlp", "scale"} <= {s["name"] for s in r.json()["model_stats"]}
    assert requests.get(f"{url}/v2/models/scale/versions/1/stats", timeout=30).status_code == 200
    assert requests.get(f"{url}/v2/models/nope/stats", timeout=30).status_code == 404


def test_repository_index(server):
    r = requests.post(server["url"] + "/v2/repository/index", timeout=30)
    assert r.status_code == 200, r.text
    index = {m["name"]: m for m in r.json()}
    assert set(index) == {"mlp", "scale", "broken", "prio", "swap"}
    assert (index["mlp"]["state"], index["mlp"]["version"]) == ("READY", "1")
    assert index["broken"]["state"] == "UNAVAILABLE" and "dims" in index["broken"]["reason"]
    r = requests.post(server["url"] + "/v2/repository/index", json={"ready": True}, timeout=30)
    assert [m["name"] for m in r.json()] == ["mlp", "prio", "scale", "swap"]


def test_repository_control_under_load(server):
    url, repo = server["url"], server["tmp"] / "repo"
    x = scale_x(2, 34)

    def y_of():
        r = infer_scale(url, "swap", x)
        assert r.status_code == 200, r.text
        return np.array(r.json()["outputs"][0]["data"], np.float64)

    v1 = scale_reference(server, x)
    np.testing.assert_allclose(y_of(), v1, rtol=1e-4, atol=1e-3)
    r = requests.post(f"{url}/v2/repository/models/swap/unload", timeout=120)
    assert r.status_code == 200 and r.content == b"", r.text
    assert requests.get(f"{url}/v2/models/swap/ready", timeout=30).status_code != 200
    assert infer_scale(url, "swap", x).status_code == 503
    r = requests.post(f"{url}/v2/repository/models/swap/load", timeout=120)
    assert r.status_code == 200 and r.content == b"", r.text
    assert requests.get(f"{url}/v2/models/swap/ready", timeout=30).status_code == 200
    np.testing.assert_allclose(y_of(), v1, rtol=1e-4, atol=1e-3)

    # A version directory still empty (a copy not begun) is passed over, and
    # the log says so: version 1 is loaded again.
    (repo / "swap" / "2").mkdir()
    r = requests.post(f"{url}/v2/repository/models/swap/load", timeout=120)
    assert r.status_code == 200 and r.content == b"", r.text
    np.testing.assert_allclose(y_of(), v1, rtol=1e-4, atol=1e-3)
    assert ("model swap: version directory 2 holds no model.safetensors or model.safetensors.index.json: "
            "version 1 is loaded") in server["log"].read_text()
    subprocess.run([CLI, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "7",
                    "--out", str(repo / "swap" / "2" / "model.safetensors")], check=True, capture_output=True)
    w2 = read_safetensors(repo / "swap" / "2" / "model.safetensors")["weight"]
    v2 = scale_reference(server, x, w2)
    assert not np.allclose(v1, v2, rtol=1e-4, atol=1e-3)
    done, answers, failures = threading.Event(), [], []

    def keep_asking():
        with requests.Session() as s:
            while not done.is_set():
                r = s.post(f"{url}/v2/models/swap/infer", timeout=60, json={"inputs": [
                    {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]})
                if r.status_code == 200:
                    answers.append(np.array(r.json()["outputs"][0]["data"], np.float64))
                else:
                    failures.append((r.status_code, r.text))

    clients = [threading.Thread(target=keep_asking) for _ in range(4)]
    for c in clients:
        c.start()
    try:
        r = requests.post(f"{url}/v2/repository/models/swap/load", timeout=120)
    finally:
        done.set()
        for c in clients:
            c.join()
    assert r.status_code == 200, r.text
    assert failures == [], failures[:5]
    assert answers
    for y in answers:
        assert np.allclose(y, v1, rtol=1e-4, atol=1e-3) or np.allclose(y, v2, rtol=1e-4, atol=1e-3)
    assert requests.get(f"{url}/v2/models/swap", timeout=30).json()["versions"] == ["2"]
    np.testing.assert_allclose(y_of(), v2, rtol=1e-4, atol=1e-3)

    r = requests.post(f"{url}/v2/repository/models/nope/load", timeout=60)
    assert r.status_code == 404 and "nope" in error_of(r)
    r = requests.post(f"{url}/v2/repository/models/swap/load",
                      json={"parameters": {"file:1/model.safetensors": "AAAA"}}, timeout=60)
    assert r.status_code == 400 and "file overrides need the model's config too" in error_of(r)


def test_priority_levels_are_the_models(server):
    url = server["url"]
    x = scale_x(1, 31)
    for level in (1, 2, 0):
        r = infer_scale(url, "prio", x, parameters={"priority": level})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], scale_reference(server, x), rtol=1e-4, atol=1e-3)
    r = infer_scale(url, "prio", x, parameters={"priority": 3})
    assert r.status_code == 400 and "priority 3 is outside" in error_of(r), r.text
    r = infer_scale(url, "prio", x, parameters={"priority": -1})
    assert r.status_code == 400 and "non-negative" in error_of(r)
    assert infer_scale(url, "scale", x, parameters={"priority": 9}).status_code == 200


def test_sequences_are_refused_naming_the_parameter(server):
    x = scale_x(1, 3)
    for key, value in (("sequence_id", 7), ("sequence_id", "s"), ("sequence_start", True), ("sequence_end", True)):
        r = infer_scale(server["url"], "scale", x, parameters={key: value})
        assert r.status_code == 400 and key in error_of(r) and "has no sequence_batching" in error_of(r), r.text


def bytes_elements(raw):
    out, at = [], 0
    while at < len(raw):
        (n,) = np.frombuffer(raw[at:at + 4], "<u4")
        out.append(raw[at + 4:at + 4 + int(n)])
        at += 4 + int(n)
    return out


def test_classification_is_the_top_n_of_the_logits(server):
    url = server["url"]
    x = np.random.default_rng(32).standard_normal((3, MLP[0])).astype(np.float32)
    inputs = [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]
    logits = mlp_reference(server["weights"]["mlp"], x)[0]
    for n in (3, MLP[2] + 5):
        r = infer_json(url, "mlp", inputs, outputs=[{"name": "logits", "parameters": {"classification": n}}])
        assert r.status_code == 200, r.text
        (out,) = r.json()["outputs"]
        width = min(n, MLP[2])
        assert (out["name"], out["datatype"], out["shape"]) == ("logits", "BYTES", [3, width])
        for row in range(3):
            pairs = [e.split(":") for e in out["data"][row * width:(row + 1) * width]]
            indices = [int(i) for _, i in pairs]
            assert indices == np.argsort(-logits[row], kind="stable")[:width].tolist()
            np.testing.assert_allclose([float(v) for v, _ in pairs], logits[row][indices], rtol=1e-4, atol=1e-4)
    for bad in (0, -2, "3"):
        r = infer_json(url, "mlp", inputs, outputs=[{"name": "logits", "parameters": {"classification": bad}}])
        assert r.status_code == 400 and "'classification'" in error_of(r), r.text


class PosixShm:
    """A POSIX shared-memory object of this user in /dev/shm with `mode`,
    mapped here; unlinked by close()."""

    def __init__(self, name, size, mode=0o600):
        self.key = "/" + name
        self.path = "/dev/shm/" + name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            os.fchmod(fd, mode)
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def close(self):
        self.map.close()
        os.unlink(self.path)


def test_system_shared_memory(server):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here for POSIX shared memory")
    url = server["url"]
    shm = f"{url}/v2/systemsharedmemory"
    tag = f"hearth-rest-{os.getpid()}"
    rows = 3
    x = scale_x(rows, 33)
    objects = []
    try:
        inputs = PosixShm(tag + "-in", 4096 + x.nbytes)
        outputs = PosixShm(tag + "-out", 256)
        objects += [inputs, outputs]
        r = requests.post(f"{shm}/region/in/register", json={"key": inputs.key, "offset": 4096, "byte_size": x.nbytes},
                          timeout=30)
        assert r.status_code == 200 and r.content == b"", r.text
        r = requests.post(f"{shm}/region/out/register", json={"key": outputs.key, "offset": 64, "byte_size": 128},
                          timeout=30)
        assert r.status_code == 200, r.text
        status = requests.get(f"{shm}/status", timeout=30).json()
        assert sorted((s["name"], s["key"], s["offset"], s["byte_size"]) for s in status) == [
            ("in", inputs.key, 4096, x.nbytes), ("out", outputs.key, 64, 128)]
        assert [s["name"] for s in requests.get(f"{shm}/region/out/status", timeout=30).json()] == ["out"]

        inputs.map[4096:4096 + x.nbytes] = x.tobytes()
        body = {"id": "shm-1",
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, SCALE_N],
                            "parameters": {"shared_memory_region": "in", "shared_memory_offset": 0,
                                           "shared_memory_byte_size": x.nbytes}}],
                "outputs": [{"name": "y", "parameters": {"shared_memory_region": "out", "shared_memory_offset": 16,
                                                         "shared_memory_byte_size": 4 * rows}}]}
        r = requests.post(f"{url}/v2/models/scale/infer", json=body, timeout=30)
        assert r.status_code == 200, r.text
        (y,) = r.json()["outputs"]
        assert (y["name"], y["datatype"], y["shape"]) == ("y", "FP32", [rows, 1])
        # As Triton answers an output in a region: name, datatype and shape, no data and no
        # parameters (Triton's C++ client reads an output with parameters as binary data of
        # binary_data_size bytes, and fails without it).
        assert "data" not in y and "parameters" not in y, y
        in_region = np.frombuffer(outputs.map[64 + 16:64 + 16 + 4 * rows], "<f4")
        inline = infer_scale(url, "scale", x).json()["outputs"][0]["data"]
        np.testing.assert_allclose(in_region, inline, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(in_region, scale_reference(server, x), rtol=1e-4, atol=1e-3)

        def infer_error(spoil):
            bad = json.loads(json.dumps(body))
            spoil(bad)
            r = requests.post(f"{url}/v2/models/scale/infer", json=bad, timeout=30)
            return r.status_code, error_of(r)

        code, e = infer_error(lambda b: b["inputs"][0]["parameters"].update(shared_memory_region="nope"))
        assert code == 404 and "no shared-memory region named 'nope'" in e, e
        code, e = infer_error(lambda b: b["inputs"][0]["parameters"].update(shared_memory_offset=4))
        assert code == 400 and "lies outside region 'in'" in e, e
        code, e = infer_error(lambda b: b["inputs"][0]["parameters"].update(shared_memory_byte_size=12))
        assert code == 400 and e == f'input "x": shared_memory_byte_size is 12 but shape [{rows},{SCALE_N}] of FP32 needs {x.nbytes}', e
        code, e = infer_error(lambda b: b["outputs"][0]["parameters"].update(shared_memory_byte_size=4))
        assert code == 400 and "do not fit" in e, e

        def register(name, **fields):
            r = requests.post(f"{shm}/region/{name}/register", json=fields, timeout=30)
            return r.status_code, error_of(r)

        assert register("in", key=inputs.key, byte_size=8)[0] == 400  # already registered
        assert register("other", key="/" + tag + "-absent", byte_size=8)[0] == 404
        code, e = register("other", key=outputs.key, offset=200, byte_size=100)
        assert code == 400 and "lies outside" in e, e
        shared = PosixShm(tag + "-open", 64, mode=0o666)
        objects.append(shared)
        code, e = register("other", key=shared.key, byte_size=8)
        assert code == 403 and "writable by nobody else" in e, e

        assert requests.post(f"{shm}/region/in/unregister", timeout=30).status_code == 200
        r = requests.post(f"{url}/v2/models/scale/infer", json=body, timeout=30)
        assert r.status_code == 404 and "'in'" in error_of(r)
        assert requests.get(f"{shm}/region/in/status", timeout=30).status_code == 404
        assert requests.post(f"{shm}/unregister", timeout=30).status_code == 200
        assert requests.get(f"{shm}/status", timeout=30).json() == []
    finally:
        requests.post(f"{shm}/unregister", timeout=30)
        for o in objects:
            o.close()


def test_cuda_shared_memory_with_no_regions_and_a_malformed_registration(server):
    # The rest of CUDA shared memory is test_cuda_shm.py's.
    url = server["url"] + "/v2/cudasharedmemory"
    r = requests.post(url + "/region/c/register", json={"raw_handle": {"b64": "AA=="}, "device_id": 0,
                                                         "byte_size": 4}, timeout=30)
    assert r.status_code == 400 and "'raw_handle' must be a CUDA IPC handle" in error_of(r), r.text
    assert "of 64 bytes, not 1" in error_of(r), r.text
    # None registered: the status of all is empty and unregistering all succeeds
    # (perf_analyzer --shared-memory system does both on every run); a named one is unknown.
    r = requests.get(url + "/status", timeout=30)
    assert r.status_code == 200 and r.json() == [], r.text
    r = requests.post(url + "/unregister", timeout=30)
    assert r.status_code == 200 and r.content == b"", r.text
    for method, path in (("get", "/region/c/status"), ("post", "/region/c/unregister")):
        r = getattr(requests, method)(url + path, timeout=30)
        assert r.status_code == 404 and "no CUDA shared-memory region named 'c'" in error_of(r), r.text


def test_head_has_no_body(server):
    host, port = server["url"].removeprefix("http://").rsplit(":", 1)
    get = requests.get(server["url"] + "/v2/models/scale", timeout=30)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"HEAD /v2/models/scale HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and rest == b"", raw
    assert f"Content-Length: {len(get.content)}".encode() in head.split(b"\r\n")


def test_gzip_and_deflate_bodies_both_ways(server):
    import gzip
    import zlib
    url = server["url"]
    x = scale_x(4, 35)
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.ravel().tolist()}]}).encode()
    expected = scale_reference(server, x)
    for coding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        # As tritonclient's request_compression_algorithm sends it.
        r = requests.post(f"{url}/v2/models/scale/infer", data=packed, timeout=30,
                          headers={"Content-Encoding": coding, "Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], expected, rtol=1e-4, atol=1e-3)
    r = requests.post(f"{url}/v2/models/scale/infer", data=b"not gzip", timeout=30,
                      headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "gzip" in error_of(r)
    # Responses: compressed when asked (response_compression_algorithm), read raw here.
    for coding, unpack in (("gzip", gzip.decompress), ("deflate", zlib.decompress)):
        r = requests.get(f"{url}/v2/models/stats", headers={"Accept-Encoding": coding}, stream=True, timeout=30)
        raw = r.raw.read(decode_content=False)
        assert r.headers["Content-Encoding"] == coding
        assert json.loads(unpack(raw))["model_stats"]
    r = requests.get(f"{url}/v2/models/stats", headers={"Accept-Encoding": "identity"}, timeout=30)
    assert "Content-Encoding" not in r.headers and r.json()["model_stats"]
