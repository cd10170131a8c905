"""`hearth serve` over real HTTP on host memory: every endpoint, answers
against a NumPy reference computed from the checkpoints, JSON and binary
agreeing, every error case (after which the server still answers right),
workers killed under load, and workers sharing the store's one memfd.

Paths: $HEARTH_CLI (default build/bin/hearth). With HEARTH_TEST_DEVICE=cuda
the models are KIND_GPU and the server runs with --device cuda (the GPU run).
"""

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time

import numpy as np
import pytest
import requests

from serve_support import (CLI, KIND, MLP, ON_GPU, SCALE_N, gone, infer_binary, infer_json, metric, metrics,
                           mlp_config, mlp_reference, model_workers, model_workers_alive, parse_metrics,
                           read_safetensors, scale_config, split_binary, start_serve, stop_serve, wait_for,
                           worker_pids)


def write_repository(root):
    (root / "mlp" / "1").mkdir(parents=True)
    (root / "scale" / "1").mkdir(parents=True)
    (root / "broken" / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "mlp", "--dims", ",".join(map(str, MLP)), "--seed", "5",
                    "--out", str(root / "mlp" / "1" / "model.safetensors")], check=True, capture_output=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "6",
                    "--out", str(root / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", "8", "--seed", "6",
                    "--out", str(root / "broken" / "1" / "model.safetensors")], check=True, capture_output=True)
    (root / "mlp" / "config.yaml").write_text(mlp_config(count=4))
    (root / "scale" / "config.yaml").write_text(scale_config(count=2))
    # One worker that waits up to 300 ms to fill batches of 8.
    (root / "batched" / "1").mkdir(parents=True)
    (root / "batched" / "1" / "model.safetensors").write_bytes((root / "mlp" / "1" / "model.safetensors").read_bytes())
    (root / "batched" / "config.yaml").write_text(mlp_config(count=1, extra="""dynamic_batching:
  max_queue_delay_microseconds: 300000
  preferred_batch_size: [8]
"""))
    # Fault injection: workers that crash (segv, abort) or hang on an input of 12345.
    faults = [("faulty", "segv", 2), ("aborting", "abort", 1), ("hanging", "hang", 1), ("queued", "hang", 1)]
    if ON_GPU:
        faults.append(("gpufault", "cuda_illegal_address", 2))
    for name, kind, count in faults:
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.safetensors").write_bytes((root / "scale" / "1" / "model.safetensors").read_bytes())
        queue = "dynamic_batching: {max_queue_size: 2}\n" if name == "queued" else ""
        (root / name / "config.yaml").write_text(scale_config(count=count, extra=queue + f"""parameters:
  fault_injection: {{on_value: 12345.0, kind: {kind}}}
"""))
    # dims disagree with the checkpoint (8): not served, the rest is.
    (root / "broken" / "config.yaml").write_text("""backend: scale
max_batch_size: 4
input:
  - {name: x, data_type: TYPE_FP32, dims: [9]}
output:
  - {name: y, data_type: TYPE_FP32, dims: [1]}
""")


@pytest.fixture(scope="module")
def server():
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-serve-test-"))
    write_repository(tmp / "repo")
    # A descriptor the server inherits without close-on-exec, as it may from
    # whoever starts it: its workers must not get it. The exec timeout is what
    # the hang tests wait for; long enough that a batch on a loaded 2-core
    # machine is never taken for a hang (a request retried after 3 of those
    # would be failed as poison).
    stray = os.open("/dev/null", os.O_RDONLY)
    try:
        state = start_serve(tmp, tmp / "repo", ["--exec-timeout-ms", "4000", "--max-body-bytes", str(1 << 20)],
                            pass_fds=(stray,))
    finally:
        os.close(stray)
    state["stray_fd"] = stray
    state["weights"] = {
        "mlp": read_safetensors(tmp / "repo" / "mlp" / "1" / "model.safetensors"),
        "scale": read_safetensors(tmp / "repo" / "scale" / "1" / "model.safetensors"),
    }
    state["batched_requests"] = 0  # successful requests to the batched model, by the tests
    yield state
    proc = state["proc"]
    code, text = stop_serve(state)
    if os.environ.get("HEARTH_TEST_LOG_DIR"):  # keep the server's log (the GPU check collects it)
        shutil.copy(state["log"], pathlib.Path(os.environ["HEARTH_TEST_LOG_DIR"]) / "serve-test-server.log")
    shutil.rmtree(tmp, ignore_errors=True)
    # SIGTERM: requests finished, workers stopped, sockets removed, exit 0.
    assert code == 0, text[-2000:]
    assert not pathlib.Path(state["run_dir"]).exists(), "run directory left behind"
    assert not model_workers_alive(state["run_dir"]), f"workers of server {proc.pid} outlived it"
    # The batching tests' one-row requests ran in batches of several, not one by one.
    if state["batched_requests"]:
        m = re.search(r"model batched: (\d+) requests in (\d+) batches", text)
        assert m, "no batch summary for the batched model"
        assert int(m.group(1)) == state["batched_requests"], m.group(0)
        assert int(m.group(2)) <= state["batched_requests"] // 4, m.group(0)


def test_health_and_metadata(server):
    url = server["url"]
    assert requests.get(f"{url}/v2/health/live").status_code == 200
    # Strict readiness (Triton's): the repository's "broken" model is not served.
    assert requests.get(f"{url}/v2/health/ready").status_code == 503
    meta = requests.get(f"{url}/v2").json()
    assert meta["name"] == "hearth" and "binary_tensor_data" in meta["extensions"]
    m = requests.get(f"{url}/v2/models/mlp").json()
    assert m["name"] == "mlp" and m["versions"] == ["1"]
    assert m["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, MLP[0]]}]
    assert {o["name"] for o in m["outputs"]} == {"logits", "argmax"}
    assert requests.get(f"{url}/v2/models/mlp/versions/1").status_code == 200
    assert requests.get(f"{url}/v2/models/mlp/ready").status_code == 200
    assert requests.get(f"{url}/v2/models/mlp/versions/1/ready").status_code == 200
    assert requests.get(f"{url}/v2/models/nope/ready").status_code == 404
    assert requests.get(f"{url}/v2/models/mlp/versions/7").status_code == 404


def test_broken_model_is_not_served_and_the_log_says_why(server):
    r = requests.get(f"{server['url']}/v2/models/broken/ready")
    assert r.status_code == 503
    log = server["log"].read_text()
    assert "broken" in log and "config.yaml" in log and "dims" in log


def test_mlp_json_matches_numpy_and_echoes_id(server):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, MLP[0])).astype(np.float32)
    r = infer_json(server["url"], "mlp", [{"name": "input", "datatype": "FP32", "shape": [5, MLP[0]],
                                           "data": x.tolist()}], id="req-42")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "req-42" and body["model_name"] == "mlp"
    out = {o["name"]: o for o in body["outputs"]}
    ref_logits, ref_argmax = mlp_reference(server["weights"]["mlp"], x)
    logits = np.array(out["logits"]["data"], dtype=np.float64).reshape(out["logits"]["shape"])
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert out["argmax"]["datatype"] == "INT64"
    assert out["argmax"]["shape"] == [5, 1]
    assert np.array(out["argmax"]["data"]).ravel().tolist() == ref_argmax.tolist()


def test_json_and_binary_agree(server):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, MLP[0])).astype(np.float32)
    j = infer_json(server["url"], "mlp", [{"name": "input", "datatype": "FP32", "shape": [3, MLP[0]],
                                           "data": x.ravel().tolist()}]).json()
    r = infer_binary(server["url"], "mlp", "input", x, outputs=["logits", "argmax"])
    assert r.status_code == 200, r.text
    header, parts = split_binary(r)
    jl = np.array([o for o in j["outputs"] if o["name"] == "logits"][0]["data"], dtype=np.float32)
    bl = np.frombuffer(parts["logits"], dtype="<f4")
    np.testing.assert_array_equal(jl, bl)
    ba = np.frombuffer(parts["argmax"], dtype="<i8")
    ja = np.array([o for o in j["outputs"] if o["name"] == "argmax"][0]["data"]).ravel()
    assert ba.tolist() == ja.tolist()


def test_concurrent_json_and_binary_answers_are_each_their_own(server):
    """Binary inputs reach the worker's slot as views into the HTTP body, and
    outputs leave it as views valid only while the answer is encoded: 64
    concurrent requests of 1 to 3 rows, half answered in JSON and half in
    binary, must each carry the result of their own input."""
    url = server["url"]
    w = server["weights"]["mlp"]
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((1 + i % 3, MLP[0])).astype(np.float32) for i in range(64)]

    def one(i):
        x = xs[i]
        if i % 2:
            r = infer_binary(url, "mlp", "input", x, outputs=["logits"])
            assert r.status_code == 200, r.text
            _, parts = split_binary(r)
            return np.frombuffer(parts["logits"], dtype="<f4").reshape(x.shape[0], MLP[2])
        r = infer_json(url, "mlp", [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                     "data": x.tolist()}], outputs=[{"name": "logits"}])
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        return np.array(out["data"], dtype=np.float32).reshape(out["shape"])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(64)))
    for x, got in zip(xs, results):
        np.testing.assert_allclose(got, mlp_reference(w, x)[0], rtol=1e-4, atol=1e-4)


def test_scale_matches_numpy(server):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, SCALE_N)).astype(np.float32)
    r = infer_binary(server["url"], "scale", "x", x, outputs=["y"])
    assert r.status_code == 200, r.text
    _, parts = split_binary(r)
    y = np.frombuffer(parts["y"], dtype="<f4")
    ref = x.astype(np.float64) @ server["weights"]["scale"]["weight"].astype(np.float64)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-3)


def test_unknown_models_are_worded_as_tritons(server):
    # Triton's clients match these words.
    r = infer_json(server["url"], "nope", [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}])
    assert r.status_code == 404 and r.json()["error"] == "Request for unknown model: 'nope' is not found"
    r = requests.get(f"{server['url']}/v2/models/mlp/versions/9", timeout=10)
    assert r.status_code == 404
    assert r.json()["error"].startswith("Request for unknown model: 'mlp' version 9 is not found"), r.text


@pytest.mark.parametrize("case", [
    ("malformed json", lambda u: requests.post(f"{u}/v2/models/mlp/infer", data=b"{not json", timeout=10), 400),
    ("unknown input", lambda u: infer_json(u, "mlp", [{"name": "nope", "datatype": "FP32", "shape": [1, MLP[0]], "data": [0.0] * MLP[0]}]), 400),
    ("wrong datatype", lambda u: infer_json(u, "mlp", [{"name": "input", "datatype": "INT32", "shape": [1, MLP[0]], "data": [0] * MLP[0]}]), 400),
    ("shape vs config", lambda u: infer_json(u, "mlp", [{"name": "input", "datatype": "FP32", "shape": [1, MLP[0] + 1], "data": [0.0] * (MLP[0] + 1)}]), 400),
    ("shape vs data", lambda u: infer_json(u, "mlp", [{"name": "input", "datatype": "FP32", "shape": [2, MLP[0]], "data": [0.0] * MLP[0]}]), 400),
    ("batch over max", lambda u: infer_json(u, "mlp", [{"name": "input", "datatype": "FP32", "shape": [9, MLP[0]], "data": [0.0] * (9 * MLP[0])}]), 400),
    ("binary sizes", lambda u: requests.post(f"{u}/v2/models/mlp/infer",
                                             data=json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, MLP[0]], "parameters": {"binary_data_size": 4 * MLP[0]}}]}).encode() + b"\0" * 7,
                                             headers={"Inference-Header-Content-Length": str(len(json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, MLP[0]], "parameters": {"binary_data_size": 4 * MLP[0]}}]})))}, timeout=10), 400),
    ("unknown model", lambda u: infer_json(u, "nope", [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]), 404),
    ("unknown version", lambda u: requests.post(f"{u}/v2/models/mlp/versions/9/infer", json={"inputs": []}, timeout=10), 404),
    ("body too large", lambda u: requests.post(f"{u}/v2/models/mlp/infer", data=b" " * (2 << 20), timeout=10), 413),
], ids=lambda c: c[0])
def test_errors_name_the_problem_and_change_nothing(server, case):
    name, send, code = case
    r = send(server["url"])
    assert r.status_code == code, f"{name}: {r.status_code} {r.text[:200]}"
    assert "error" in r.json() and r.json()["error"]
    test_mlp_json_matches_numpy_and_echoes_id(server)


def test_four_workers_share_the_stores_single_memfd(server):
    if ON_GPU:
        pytest.skip("host-memory test: on a GPU the workers map a CUDA allocation (device memory is measured by bench/serve/serve_bench.py)")
    pids = model_workers(server["proc"].pid, "mlp")
    assert len(pids) == 4
    inodes = set()
    for p in pids:
        lines = [l for l in pathlib.Path(f"/proc/{p}/maps").read_text().splitlines() if "memfd:hearth-arena" in l]
        assert len(lines) == 1, f"worker {p} maps {len(lines)} arenas"
        fields = lines[0].split()
        assert fields[1].startswith("r") and "w" not in fields[1], "the weights must be mapped read-only"
        inodes.add(fields[4])
    assert len(inodes) == 1, "all workers must map the same memfd"


def test_single_requests_are_batched_and_split_back(server):
    """16 concurrent one-row requests to a model with one worker that waits up
    to 300 ms for batches of 8: answered in 2 batches, each answer its own."""
    url = server["url"]
    w = server["weights"]["mlp"]
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((1, MLP[0])).astype(np.float32) for _ in range(16)]

    def one(x):
        r = infer_binary(url, "batched", "input", x, outputs=["logits"])
        assert r.status_code == 200, r.text
        _, parts = split_binary(r)
        return np.frombuffer(parts["logits"], dtype="<f4").reshape(1, MLP[2])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, xs))
    for x, got in zip(xs, results):
        np.testing.assert_allclose(got, mlp_reference(w, x)[0], rtol=1e-4, atol=1e-4)
    # The server's summary, checked when the fixture stops it, must show these
    # 16 requests in a few batches.
    server["batched_requests"] += 16


def test_request_timeout_answers_504_without_running(server):
    x = np.zeros((1, MLP[0]), dtype=np.float32)
    r = infer_json(server["url"], "batched", [{"name": "input", "datatype": "FP32", "shape": [1, MLP[0]],
                                               "data": x.ravel().tolist()}], parameters={"timeout": 50000})
    assert r.status_code == 504, r.text
    assert "timed out" in r.json()["error"]
    test_mlp_json_matches_numpy_and_echoes_id(server)


def test_killing_workers_under_load_fails_no_request(server):
    url = server["url"]
    w = server["weights"]["mlp"]
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((1 + i % 8, MLP[0])).astype(np.float32) for i in range(200)]
    before = set(model_workers(server["proc"].pid, "mlp"))

    def one(x):
        r = infer_binary(url, "mlp", "input", x, outputs=["logits"])
        assert r.status_code == 200, r.text
        _, parts = split_binary(r)
        got = np.frombuffer(parts["logits"], dtype="<f4").reshape(x.shape[0], MLP[2])
        np.testing.assert_allclose(got, mlp_reference(w, x)[0], rtol=1e-4, atol=1e-4)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, x) for x in xs]
        # Each kill once another 20 requests have been answered: under load
        # by construction, however fast or slow the machine is.
        for k, victim in enumerate(list(before)[:3]):
            wait_for(lambda: sum(f.done() for f in futures) >= 20 * (k + 1), f"{20 * (k + 1)} answers")
            os.kill(victim, signal.SIGKILL)
        for f in futures:
            f.result()
    now = set()

    def replaced():
        now.clear()
        now.update(model_workers(server["proc"].pid, "mlp"))
        return len(now) == 4 and len(now - before) >= 3
    wait_for(replaced, lambda: f"the killed workers' replacements: {before} -> {now}", timeout=20)
    assert requests.get(f"{url}/v2/models/mlp/ready").status_code == 200


def test_two_thousand_requests_while_a_worker_is_killed_every_100ms(server):
    """8 clients, 2,000 requests, a random mlp worker SIGKILLed every 100 ms:
    none fails, none is lost, every answer is right."""
    import random
    import threading
    url = server["url"]
    w = server["weights"]["mlp"]
    rng = np.random.default_rng(21)
    xs = [rng.standard_normal((1 + i % 4, MLP[0])).astype(np.float32) for i in range(2000)]
    refs = [mlp_reference(w, x)[0] for x in xs]
    stop = threading.Event()
    kills = []

    def age_s(pid):
        """Seconds since the process started (/proc/PID/stat field 22)."""
        try:
            start = int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
            uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            return 0.0
        return uptime - start / os.sysconf("SC_CLK_TCK")

    def killer():
        while not stop.wait(0.1):
            # Workers that have had a second to start: killing workers while
            # they start, again and again, is what an OOM loop looks like,
            # and the server rightly backs off from those (up to 5 s), which
            # would stall this model rather than test its retries.
            pids = [p for p in model_workers(server["proc"].pid, "mlp") if age_s(p) > 1.0]
            if pids:
                victim = random.choice(pids)
                try:
                    os.kill(victim, signal.SIGKILL)
                    kills.append(victim)
                except ProcessLookupError:
                    pass

    def one(i):
        r = infer_binary(url, "mlp", "input", xs[i], outputs=["logits"])
        assert r.status_code == 200, f"request {i}: {r.status_code} {r.text}"
        _, parts = split_binary(r)
        got = np.frombuffer(parts["logits"], dtype="<f4").reshape(xs[i].shape[0], MLP[2])
        np.testing.assert_allclose(got, refs[i], rtol=1e-4, atol=1e-4)
        return i

    t = threading.Thread(target=killer)
    t.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            done = sorted(pool.map(one, range(len(xs))))
            # However fast the requests went, they go on until workers were
            # killed under them a few times.
            deadline = time.time() + 120
            more = 0
            while len(kills) < 5 and time.time() < deadline:
                assert sorted(pool.map(one, range(64))) == list(range(64))
                more += 64
    finally:
        stop.set()
        t.join()
    assert done == list(range(2000)), "a request was lost"
    assert len(kills) >= 5, f"only {len(kills)} workers were killed in {2000 + more} requests"
    wait_for(lambda: len(model_workers(server["proc"].pid, "mlp")) == 4, "4 mlp workers again", timeout=20)


def scale_request(url, model, x):
    return infer_json(url, model, [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}])


@pytest.mark.parametrize("model", ["faulty", "aborting", "hanging", "gpufault"])
def test_poison_request_fails_alone_and_the_workers_stop_dying(server, model):
    if model == "gpufault" and not ON_GPU:
        pytest.skip("cuda_illegal_address needs a GPU worker (HEARTH_TEST_DEVICE=cuda)")
    url = server["url"]
    w = server["weights"]["scale"]["weight"].astype(np.float64)
    rng = np.random.default_rng(12)
    good = [rng.standard_normal((1, SCALE_N)).astype(np.float32) for _ in range(12)]
    bad = rng.standard_normal((1, SCALE_N)).astype(np.float32)
    bad[0, 7] = 12345.0
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        poison = pool.submit(scale_request, url, model, bad)
        answers = list(pool.map(lambda x: scale_request(url, model, x), good))
        r = poison.result()
    assert r.status_code == 500, r.text
    assert "poison" in r.json()["error"] and "3 workers" in r.json()["error"]
    for x, a in zip(good, answers):
        assert a.status_code == 200, f"an innocent request failed: {a.text}"
        np.testing.assert_allclose(a.json()["outputs"][0]["data"], x.astype(np.float64) @ w, rtol=1e-4, atol=1e-3)
    wait_for(lambda: requests.get(f"{url}/v2/models/{model}/ready").status_code == 200, f"{model} to be ready again")
    after = scale_request(url, model, good[0])
    assert after.status_code == 200, after.text


def test_full_queue_answers_503_with_retry_after(server):
    """One worker, held by a request that hangs it, and room for 2 requests in
    the queue: the third waiting request is refused at once with 503 and
    Retry-After; the queued ones are answered once the worker is replaced."""
    url = server["url"]
    w = server["weights"]["scale"]["weight"].astype(np.float64)
    rng = np.random.default_rng(13)
    bad = rng.standard_normal((1, SCALE_N)).astype(np.float32)
    bad[0, 3] = 12345.0
    good = [rng.standard_normal((1, SCALE_N)).astype(np.float32) for _ in range(2)]
    hangs = lambda: server["log"].read_text().count("fault injection: hang")
    before = hangs()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        hung = pool.submit(scale_request, url, "queued", bad)
        # The worker prints this just before it hangs on the bad request.
        wait_for(lambda: hangs() > before, "the worker to take the bad request")
        queued = [pool.submit(scale_request, url, "queued", x) for x in good]
        wait_for(lambda: metric(url, "hearth_inference_queued_request_count", "queued") >= 2,
                 "both good requests to be queued")
        refused = scale_request(url, "queued", good[0])
        assert refused.status_code == 503, refused.text
        assert refused.headers.get("Retry-After") == "1"
        assert "queue" in refused.json()["error"] and "full" in refused.json()["error"], refused.text
        for x, f in zip(good, queued):
            r = f.result()
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["outputs"][0]["data"], x.astype(np.float64) @ w, rtol=1e-4, atol=1e-3)
        assert hung.result().status_code == 500  # a poison batch after 3 hung workers


def test_metrics_count_this_tests_own_traffic(server):
    """The counters move by exactly what this test sends, whatever ran before."""
    url = server["url"]
    r = requests.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/plain")
    for family in ["hearth_inference_request_success", "hearth_inference_request_failure", "hearth_inference_count",
                   "hearth_inference_exec_count", "hearth_inference_request_duration_us",
                   "hearth_inference_queue_duration_us", "hearth_inference_compute_input_duration_us",
                   "hearth_inference_compute_infer_duration_us", "hearth_inference_compute_output_duration_us",
                   "hearth_inference_pending_request_count", "hearth_inference_queued_request_count",
                   "hearth_worker_restarts", "hearth_worker_ready",
                   "hearth_shared_weights_bytes", "hearth_device_memory_accounted_bytes"]:
        assert f"# TYPE {family} " in r.text, family
    before = parse_metrics(r.text)
    b = 'model="batched"'
    m = 'model="mlp"'
    s = 'model="scale"'

    # 16 one-row requests to the batched model, and one that times out there
    # (it would wait 300 ms for a batch of 8, its timeout is 50 ms).
    rng = np.random.default_rng(31)
    xs = [rng.standard_normal((1, MLP[0])).astype(np.float32) for _ in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda x: infer_binary(url, "batched", "input", x).status_code, xs))
    assert codes == [200] * 16
    server["batched_requests"] += 16
    late = infer_json(url, "batched", [{"name": "input", "datatype": "FP32", "shape": [1, MLP[0]],
                                        "data": [0.0] * MLP[0]}], parameters={"timeout": 50000})
    assert late.status_code == 504, late.text
    # Scale: 3 requests of 1, 2 and 3 rows.
    for rows in (1, 2, 3):
        assert scale_request(url, "scale", np.ones((rows, SCALE_N), np.float32)).status_code == 200
    # One mlp worker replaced.
    mlp_before = set(model_workers(server["proc"].pid, "mlp"))
    os.kill(sorted(mlp_before)[0], signal.SIGKILL)

    def replaced():
        now = set(model_workers(server["proc"].pid, "mlp"))
        return (len(now) == 4 and now - mlp_before
                and sum(val for k, val in metrics(url).items() if k.startswith("hearth_worker_ready{" + m)) == 4)
    wait_for(replaced, "the killed mlp worker's replacement to be ready")

    v = metrics(url)
    delta = lambda key: v.get(key, 0.0) - before.get(key, 0.0)
    assert delta(f"hearth_inference_request_success{{{b}}}") == 16
    assert delta(f"hearth_inference_request_failure{{{b}}}") == 1
    assert delta(f"hearth_inference_count{{{b}}}") == 16
    executed = delta(f"hearth_inference_exec_count{{{b}}}")
    assert 1 <= executed <= 16
    assert delta(f'hearth_inference_batch_size_bucket{{{b},le="+Inf"}}') == executed
    assert delta(f'hearth_inference_batch_size_bucket{{{b},le="8"}}') == executed
    assert delta(f"hearth_inference_batch_size_sum{{{b}}}") == 16
    assert v[f"hearth_inference_pending_request_count{{{b}}}"] == 0
    assert v[f"hearth_inference_queued_request_count{{{b}}}"] == 0
    assert delta(f"hearth_inference_request_success{{{s}}}") == 3
    assert delta(f"hearth_inference_count{{{s}}}") == 6
    assert delta(f"hearth_inference_exec_count{{{s}}}") == 3
    assert delta(f"hearth_inference_compute_infer_duration_us{{{s}}}") > 0
    assert delta(f"hearth_inference_request_duration_us{{{s}}}") > 0
    restarts = sum(val - before.get(k, 0.0) for k, val in v.items() if k.startswith("hearth_worker_restarts{" + m))
    assert restarts == 1, "one mlp worker was killed"
    weights = [val for k, val in v.items() if k.startswith("hearth_shared_weights_bytes{" + m)]
    assert weights and weights[0] >= 4 * (MLP[0] * MLP[1] + MLP[1] + MLP[1] * MLP[2] + MLP[2])


def test_huge_timeouts_mean_no_deadline(server):
    """2^63 us and more do not fit a signed deadline: they must saturate to
    "no deadline", not wrap into the past (which answered 504 at once)."""
    x = np.zeros((1, MLP[0]), dtype=np.float32)
    for timeout in (2 ** 63, 2 ** 64 - 1):
        r = infer_json(server["url"], "mlp", [{"name": "input", "datatype": "FP32", "shape": [1, MLP[0]],
                                               "data": x.ravel().tolist()}], parameters={"timeout": timeout})
        assert r.status_code == 200, f"timeout {timeout}: {r.status_code} {r.text}"


def fd_targets(pid):
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            pass
    return out


def test_a_worker_holds_exactly_its_descriptors(tmp_path):
    """A live worker exec'd by the server holds its stdio (the server's), its
    control socket at 3 and its own connection to the store, nothing else:
    the slot (4) it has closed once mapped, the arena once mapped, and the
    parameters came as a message, not as a descriptor. None of its sockets
    is a copy of one of the server's and it lacks the descriptor the server
    inherited without close-on-exec (nothing leaked through exec), and every
    descriptor the server opened itself is close-on-exec.

    Its own server, on the CPU with a KIND_CPU model, on every machine: a
    GPU worker holds the driver's descriptors and maps no memfd arena, and a
    server that has touched CUDA holds the driver's descriptors too."""
    scale_demo_repository(tmp_path / "repo", kind="KIND_CPU")
    # A descriptor the server inherits without close-on-exec, as it may from
    # whoever starts it: its workers must not get it. The exec timeout is what
    # the hang tests wait for; long enough that a batch on a loaded 2-core
    # machine is never taken for a hang (a request retried after 3 of those
    # would be failed as poison).
    stray = os.open("/dev/null", os.O_RDONLY)
    try:
        state = start_serve(tmp_path, tmp_path / "repo", device="cpu", name="descriptors", pass_fds=(stray,))
    finally:
        os.close(stray)
    try:
        check_worker_descriptors(state, stray)
    finally:
        code, text = stop_serve(state)
    assert code == 0, text[-2000:]


def check_worker_descriptors(state, stray_fd):
    serve_pid = state["proc"].pid
    wait_for(lambda: requests.get(f"{state['url']}/v2/models/scale/ready").status_code == 200, "scale ready")
    server_fds = fd_targets(serve_pid)
    server_sockets = {t for t in server_fds.values() if t.startswith("socket:")}
    workers = model_workers(serve_pid, "scale")
    assert len(workers) == 2
    for pid in workers:
        fds = fd_targets(pid)
        # 0-2, control (3), the slot (4, kept to map it again when it grows)
        # and the worker's own connection to the store.
        assert sorted(fds)[:5] == [0, 1, 2, 3, 4] and len(fds) == 6, f"worker {pid} holds {fds}"
        for std in (0, 1, 2):
            assert fds[std] == server_fds[std], f"worker {pid} fd {std}: {fds[std]} vs the server's {server_fds[std]}"
        assert fds[4] == "/memfd:hearth-slot-scale (deleted)", f"worker {pid} fd 4 is {fds[4]}"
        extra = [fd for fd in fds if fd > 4]
        for fd in [3] + extra:
            assert fds[fd].startswith("socket:"), f"worker {pid} fd {fd} is {fds[fd]}"
            assert fds[fd] not in server_sockets, f"worker {pid} fd {fd} is a socket the server also holds"
        maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
        # The slot is mapped by the first batch; the weights at attach.
        assert "memfd:hearth-arena" in maps
        assert b"--param" not in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    # The server's own descriptors: 0-2 and the stray one come from this
    # test; the rest it opened.
    assert stray_fd in server_fds
    for fd in server_fds:
        if fd <= 2 or fd == stray_fd:
            continue
        try:
            flags = pathlib.Path(f"/proc/{serve_pid}/fdinfo/{fd}").read_text().split("flags:")[1].split()[0]
        except FileNotFoundError:
            continue
        assert int(flags, 8) & 0o2000000, f"server fd {fd} ({server_fds[fd]}) is not close-on-exec"


# ---- a second, unprivileged user -------------------------------------------

ATTACKER_UID = 54321  # setpriv needs no user entry for it


def as_attacker(code):
    return subprocess.run(["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_UID}", "--clear-groups",
                           "/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=60)


def scale_demo_repository(root, count=2, extra="", kind=KIND):
    """The README's demo scale model: 500 weights of seed 1; ones give y = 34.695457."""
    (root / "scale" / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", "500", "--seed", "1",
                    "--out", str(root / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    (root / "scale" / "config.yaml").write_text(scale_config(count=count, extra=extra, kind=kind))


def assert_demo_answer(url, model="scale"):
    r = scale_request(url, model, np.ones((1, SCALE_N), np.float32))
    assert r.status_code == 200, r.text
    y = r.json()["outputs"][0]["data"][0]
    assert abs(y - 34.695457) < 1e-3, f"{model} answered y = {y}: not the demo weights"


def test_run_directory_is_private_when_another_user_squats_the_old_paths(tmp_path):
    """As root, with another local user who has created the server's old
    predictable run directories /tmp/hearth-serve-<pid> (and symlinks there)
    and an $XDG_RUNTIME_DIR of their own: the server makes its own private
    directory, the other user cannot rename its socket away, and a worker
    restart still maps the real weights."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as a second, unprivileged user with setpriv")
    if not shutil.which("setpriv"):
        pytest.skip("needs setpriv (util-linux)")
    attacker = pathlib.Path(tempfile.mkdtemp(prefix="hearth-attacker-"))
    os.chown(attacker, ATTACKER_UID, ATTACKER_UID)
    os.chmod(attacker, 0o777)
    last = int(pathlib.Path("/proc/sys/kernel/ns_last_pid").read_text())
    squatted = [f"/tmp/hearth-serve-{p}" for p in range(last + 1, last + 400)]
    probe = as_attacker("import os, sys\n"
                        f"xdg = {str(attacker / 'xdg')!r}\n"
                        "os.makedirs(xdg + '/hearth', 0o777, exist_ok=True)\n"
                        "os.chmod(xdg, 0o777); os.chmod(xdg + '/hearth', 0o777)\n"
                        f"for i, p in enumerate({squatted!r}):\n"
                        "    try:\n"
                        f"        os.symlink({str(attacker)!r}, p) if i % 2 else (os.mkdir(p), os.chmod(p, 0o777))\n"
                        "    except FileExistsError:\n"
                        "        pass\n")
    if probe.returncode != 0 and "setresuid" in probe.stderr + probe.stdout:
        shutil.rmtree(attacker, ignore_errors=True)
        pytest.skip(f"setpriv cannot switch uid here: {probe.stderr.strip()}")
    state = None
    try:
        assert probe.returncode == 0, probe.stderr
        scale_demo_repository(tmp_path / "repo")
        env = dict(os.environ, XDG_RUNTIME_DIR=str(attacker / "xdg"))
        state = start_serve(tmp_path, tmp_path / "repo", env=env)
        run_dir = state["run_dir"]
        st = os.lstat(run_dir)
        assert stat.S_ISDIR(st.st_mode), f"{run_dir} is not a directory"
        assert st.st_uid == 0, f"{run_dir} is owned by uid {st.st_uid}"
        assert stat.S_IMODE(st.st_mode) == 0o700, f"{run_dir} has mode {oct(st.st_mode)}"
        assert os.path.realpath(run_dir) == run_dir
        assert run_dir.startswith("/tmp/serve-"), f"{run_dir}: not a fresh directory in /tmp"
        assert run_dir not in squatted
        if f"/tmp/hearth-serve-{state['proc'].pid}" in squatted:
            # The old code would have used this one (owned by the attacker).
            assert os.lstat(f"/tmp/hearth-serve-{state['proc'].pid}").st_uid == ATTACKER_UID
        sockets = list(pathlib.Path(run_dir).glob("*.sock"))
        assert sockets, f"no store socket in {run_dir}"
        sock = str(sockets[0])
        for attempt in (f"os.rename({sock!r}, {sock + '.gone'!r})", f"os.listdir({run_dir!r})",
                        f"os.mkdir({run_dir + '/x'!r})"):
            r = as_attacker("import os\n" + attempt)
            assert r.returncode != 0 and "PermissionError" in r.stderr, f"the other user could: {attempt}"
        assert pathlib.Path(sock).exists()
        # A worker restart attaches again, through the same private socket.
        before = set(model_workers(state["proc"].pid, "scale"))
        assert len(before) == 2
        os.kill(sorted(before)[0], signal.SIGKILL)

        def replaced():
            now = set(model_workers(state["proc"].pid, "scale"))
            return (len(now) == 2 and now - before
                    and sum(v for k, v in metrics(state["url"]).items()
                            if k.startswith('hearth_worker_ready{model="scale"')) == 2)
        wait_for(replaced, "the killed worker's replacement to be ready")
        for _ in range(4):  # both workers, whichever takes each request
            assert_demo_answer(state["url"])
    finally:
        if state is not None:
            code, text = stop_serve(state)
        for p in squatted:
            if os.path.islink(p):
                os.unlink(p)
            elif os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(attacker, ignore_errors=True)
    assert code == 0, text[-2000:]
    assert not os.path.exists(state["run_dir"]), "run directory left behind"


# ---- a repository built to hurt the server ----------------------------------

BAD_MODELS = {
    # name: what its ready answer must say
    "bigversion": "bigversion/99999999999999999999999: version directory name",
    "badkey": "badkey/config.yaml:9: (top level): keys must be single values",
    "dirconfig": "dirconfig/config.yaml: is a directory",
    "modelloop": "modelloop/config.yaml: a loop of symbolic links",
    "versionloop": "versionloop/1: a loop of symbolic links",
    "fifo": "fifo/1/model.safetensors: is a FIFO",
    "hugeparam": "bytes, over the limit of 1048576 bytes for a config",
    "overparams": "the limit of 65536 bytes",
    "negative": "'-1' is not a valid value",
    "manystandbys": "parameters.standby_workers: must be from 0 to 8",
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    repo = tmp / "repo"
    scale_demo_repository(repo)
    checkpoint = (repo / "scale" / "1" / "model.safetensors").read_bytes()
    good_config = (repo / "scale" / "config.yaml").read_text()

    def model(name, config=good_config, version="1", with_checkpoint=True):
        (repo / name / version).mkdir(parents=True)
        if with_checkpoint:
            (repo / name / version / "model.safetensors").write_bytes(checkpoint)
        if config is not None:
            (repo / name / "config.yaml").write_text(config)

    model("bigversion", version="99999999999999999999999")
    model("badkey", config=good_config + "? [a, b]\n: 1\n")
    model("dirconfig", config=None)
    (repo / "dirconfig" / "config.yaml").mkdir()
    (repo / "modelloop").symlink_to("modelloop")
    (repo / "versionloop").mkdir()
    (repo / "versionloop" / "config.yaml").write_text(good_config)
    (repo / "versionloop" / "1").symlink_to("1")
    model("fifo", with_checkpoint=False)
    os.mkfifo(repo / "fifo" / "1" / "model.safetensors")  # no writer: open() would block for good
    # 100 MiB in one string parameter: too large for any argv, and for a config.
    model("hugeparam", config=None)
    with open(repo / "hugeparam" / "config.yaml", "w") as f:
        f.write(good_config + "parameters:\n  blob: ")
        chunk = "x" * (1 << 20)
        for _ in range(100):
            f.write(chunk)
        f.write("\n")
    model("overparams", config=good_config + "parameters:\n  blob: " + "y" * (100 << 10) + "\n")
    model("negative", config=good_config + "dynamic_batching: {max_queue_size: -1}\n")
    model("manystandbys", config=good_config + "parameters: {standby_workers: '9'}\n")
    # 60 KiB of parameters: fits the limit, and reaches the workers through
    # their control channel instead of argv.
    model("bigparam", config=good_config + "parameters:\n  blob: " + "z" * (60 << 10) + "\n")
    state = start_serve(tmp, repo, name="hostile")
    state["repo"] = repo
    state["checkpoint"] = checkpoint
    state["good_config"] = good_config
    yield state
    code, text = stop_serve(state)
    (repo / "hugeparam" / "config.yaml").unlink()  # 100 MiB: do not leave it in pytest's kept temp dirs
    assert code == 0, text[-3000:]
    assert not pathlib.Path(state["run_dir"]).exists(), "run directory left behind"


def test_hostile_repository_still_serves_the_good_models(hostile):
    url = hostile["url"]
    assert requests.get(f"{url}/v2/health/live").status_code == 200
    for name in ("scale", "bigparam"):
        assert requests.get(f"{url}/v2/models/{name}/ready").status_code == 200, name
        assert_demo_answer(url, name)


@pytest.mark.parametrize("name", sorted(BAD_MODELS))
def test_each_bad_model_answers_503_naming_its_path_and_reason(hostile, name):
    r = requests.get(f"{hostile['url']}/v2/models/{name}/ready", timeout=10)
    assert r.status_code == 503, f"{name}: {r.status_code} {r.text[:300]}"
    error = r.json()["error"]
    assert BAD_MODELS[name] in error, error
    assert "is not served" in error
    assert BAD_MODELS[name] in hostile["log"].read_text(), f"the log does not say why {name} is not served"
    infer = scale_request(hostile["url"], name, np.ones((1, SCALE_N), np.float32))
    assert infer.status_code == 503 and BAD_MODELS[name] in infer.json()["error"], infer.text[:300]
    assert_demo_answer(hostile["url"])  # and the good model is not hurt


def test_parameters_reach_workers_through_the_control_channel(hostile):
    pids = []
    for task in pathlib.Path(f"/proc/{hostile['proc'].pid}/task").iterdir():
        pids += (task / "children").read_text().split()
    cmdlines = [pathlib.Path(f"/proc/{p}/cmdline").read_bytes() for p in pids]
    bigparam = [c for c in cmdlines if b"\0bigparam\0" in c]
    assert bigparam, "no worker of bigparam"
    for c in bigparam:
        assert b"zzzz" not in c and b"--param" not in c, "a parameter travelled in argv"


def test_fixing_a_broken_model_brings_it_up_without_a_restart(hostile):
    repo, url = hostile["repo"], hostile["url"]
    fifo = repo / "fifo" / "1" / "model.safetensors"
    tmp = fifo.with_name("model.safetensors.tmp")
    tmp.write_bytes(hostile["checkpoint"])
    os.replace(tmp, fifo)
    shutil.rmtree(repo / "dirconfig" / "config.yaml")
    (repo / "dirconfig" / "config.yaml").write_text(hostile["good_config"])
    for name in ("fifo", "dirconfig"):
        wait_for(lambda: requests.get(f"{url}/v2/models/{name}/ready").status_code == 200,
                 f"{name} to be served once fixed")
        assert_demo_answer(url, name)
    # Each failure was logged once, not at every retry.
    log = hostile["log"].read_text()
    assert log.count("model fifo is not served") == 1, log[-3000:]


def test_workers_that_cannot_start_fail_their_model_until_fixed(tmp_path, serve):
    """A hearth-worker that exits at once: Start() does not wait out the
    ready timeout, the model answers 503 with the reason, it is retried with
    back-off (its failure logged once), and a working worker brings it up."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(CLI, bin_dir / "hearth")
    starts = tmp_path / "starts"
    broken = bin_dir / "hearth-worker.broken"
    broken.write_text(f"#!/bin/sh\necho start >> {starts}\necho 'test worker: refusing to start' >&2\nexit 3\n")
    broken.chmod(0o755)
    os.replace(broken, bin_dir / "hearth-worker")
    scale_demo_repository(tmp_path / "repo")
    # A version directory still empty (a copy not begun): passed over, said once.
    (tmp_path / "repo" / "scale" / "2").mkdir()
    passed_over = ("model scale: version directory 2 holds no model.safetensors or "
                   "model.safetensors.index.json: version 1 is loaded")
    state = serve(tmp_path / "repo", cli=str(bin_dir / "hearth"), name="noworker")
    url = state["url"]
    r = requests.get(f"{url}/v2/models/scale/ready", timeout=10)
    assert r.status_code == 503, r.text
    assert "no worker could start" in r.json()["error"] and "exited with status 3" in r.json()["error"], r.text
    # Two attempts of both workers, at least: it is being retried.
    wait_for(lambda: starts.exists() and starts.read_text().count("start") >= 4, "a second attempt")
    assert state["log"].read_text().count("model scale is not served") == 1
    assert state["log"].read_text().count(passed_over) == 1
    real = pathlib.Path(CLI).resolve().parent / "hearth-worker"
    link = bin_dir / "hearth-worker.new"
    link.symlink_to(real)
    os.replace(link, bin_dir / "hearth-worker")
    wait_for(lambda: requests.get(f"{url}/v2/models/scale/ready").status_code == 200,
             "scale to be served by working workers")
    assert_demo_answer(url)
    assert state["log"].read_text().count(passed_over) == 1


def cli_with_worker(tmp_path, script):
    """A copy of the CLI whose hearth-worker is the shell `script`; returns
    (the CLI's path, a function that puts the real worker in its place)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(CLI, bin_dir / "hearth")
    fake = bin_dir / "hearth-worker.fake"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    os.replace(fake, bin_dir / "hearth-worker")

    def use_real_worker():
        link = bin_dir / "hearth-worker.new"
        link.symlink_to(pathlib.Path(CLI).resolve().parent / "hearth-worker")
        os.replace(link, bin_dir / "hearth-worker")
    return str(bin_dir / "hearth"), use_real_worker


def test_workers_sigkilled_while_starting_fail_their_model_instead_of_respawning(tmp_path, serve):
    """A worker SIGKILLed at every start (as the OOM killer does to one whose
    max_batch_size does not fit): one kill is retried at once, a second in a
    row is a failure, so Start() does not wait out the ready timeout, the
    model answers 503 saying why, it is retried with back-off, and a working
    worker brings it up."""
    starts = tmp_path / "starts"
    cli, use_real_worker = cli_with_worker(tmp_path, f"echo start >> {starts}\nkill -KILL $$\n")
    scale_demo_repository(tmp_path / "repo", count=1)
    state = serve(tmp_path / "repo", cli=cli, name="oom")
    url = state["url"]
    r = requests.get(f"{url}/v2/models/scale/ready", timeout=10)
    assert r.status_code == 503, r.text
    assert "killed by SIGKILL while starting (out of memory?)" in r.json()["error"], r.text
    wait_for(lambda: starts.read_text().count("start") >= 4, "a later attempt")
    assert state["log"].read_text().count("model scale is not served") == 1
    use_real_worker()
    wait_for(lambda: requests.get(f"{url}/v2/models/scale/ready").status_code == 200,
             "scale to be served by a working worker")
    assert_demo_answer(url)


def test_a_lone_request_waits_for_a_batch_no_longer_than_its_timeout(tmp_path, serve):
    """With a batch delay of 60 s (the most a config may ask), a request with
    a 100 ms timeout that no other joins is answered 504 at its deadline,
    not after the delay; a config asking for more than 60 s is refused."""
    scale_demo_repository(tmp_path / "repo", count=1, extra="""dynamic_batching:
  max_queue_delay_microseconds: 60000000
  preferred_batch_size: [4]
""")
    (tmp_path / "repo" / "toolong" / "1").mkdir(parents=True)
    shutil.copy(tmp_path / "repo" / "scale" / "1" / "model.safetensors", tmp_path / "repo" / "toolong" / "1")
    (tmp_path / "repo" / "toolong" / "config.yaml").write_text(scale_config(count=1, extra="""dynamic_batching:
  max_queue_delay_microseconds: 9223372036854775807
"""))
    state = serve(tmp_path / "repo", name="delay")
    url = state["url"]
    x = np.ones((1, SCALE_N), np.float32)
    r = infer_json(url, "scale", [{"name": "x", "datatype": "FP32", "shape": [1, SCALE_N],
                                   "data": x.ravel().tolist()}], parameters={"timeout": 100000})
    assert r.status_code == 504, f"{r.status_code} {r.text}"
    r = requests.get(f"{url}/v2/models/toolong/ready", timeout=10)
    assert r.status_code == 503
    assert "dynamic_batching.max_queue_delay_microseconds: must be at most 60000000" in r.json()["error"], r.text


def test_a_long_xdg_runtime_dir_does_not_make_socket_paths_too_long(tmp_path, serve):
    """$XDG_RUNTIME_DIR so long that <it>/hearth/serve-XXXXXX/store-cpu.sock
    would not fit sun_path: the run directory goes to /tmp and models serve."""
    xdg = tmp_path / ("x" * 50) / ("y" * 50)
    xdg.mkdir(parents=True, mode=0o700)
    scale_demo_repository(tmp_path / "repo", count=1)
    state = serve(tmp_path / "repo", env=dict(os.environ, XDG_RUNTIME_DIR=str(xdg)), name="xdg")
    assert state["run_dir"].startswith("/tmp/serve-"), state["run_dir"]
    assert requests.get(f"{state['url']}/v2/models/scale/ready", timeout=10).status_code == 200
    assert_demo_answer(state["url"])


def test_sigterm_during_start_up_stops_the_server(tmp_path):
    """A worker that never says ready holds Start() (up to the ready
    timeout); SIGTERM then still stops the server, cleanly: exit 0, its
    workers gone, its run directory removed."""
    started = tmp_path / "started"
    cli, _ = cli_with_worker(tmp_path, f"echo $$ >> {started}\nexec sleep 600\n")
    scale_demo_repository(tmp_path / "repo", count=1)
    log_path = tmp_path / "start-up.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli, "serve", "--model-repository", str(tmp_path / "repo"), "--http-port", "0",
                                 "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: started.exists() and started.read_text().strip(), "the worker to start")
            assert "ready on http" not in log_path.read_text()
            run_dir = re.search(r"run directory (\S+)", log_path.read_text())
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert "during start-up: stopping" in text, text[-3000:]
    worker = int(started.read_text().split()[0])
    wait_for(lambda: gone(worker), "the worker to be gone")
    if run_dir:
        assert not os.path.exists(run_dir.group(1)), f"{run_dir.group(1)} was left behind"


def test_sigterm_does_not_wait_for_a_loader_blocked_in_the_kernel(tmp_path):
    """A model whose builder is blocked in a read() that never returns
    (HEARTH_TEST_BLOCK_BUILD: as on a hung network filesystem) does not hold
    SIGTERM: the server waits 1 s for it, names it, stops the other model's
    workers and exits 0."""
    scale_demo_repository(tmp_path / "repo", count=1)
    shutil.copytree(tmp_path / "repo" / "scale", tmp_path / "repo" / "stuck")
    log_path = tmp_path / "blocked.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([CLI, "serve", "--model-repository", str(tmp_path / "repo"), "--http-port", "0",
                                 "--grpc-port", "-1", "--device", "cpu"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, HEARTH_TEST_BLOCK_BUILD="stuck"))
        try:
            wait_for(lambda: "its builder is blocked by HEARTH_TEST_BLOCK_BUILD" in log_path.read_text()
                     and re.search(r"scale worker 0 ready: pid \d+", log_path.read_text()),
                     "the blocked builder and the other model's worker")
            worker = int(re.search(r"scale worker 0 ready: pid (\d+)", log_path.read_text()).group(1))
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert "model stuck: its loader did not return within 1000 ms of the stop" in text, text[-3000:]
    assert "stopped, without the model loaders named above" in text, text[-3000:]
    wait_for(lambda: gone(worker), "the other model's worker to be gone")


def hold_a_request(state, pool):
    """Stops the scale model's worker (SIGSTOP) and sends it a request, which
    it then holds; returns the worker's pid and the request's future."""
    worker = int(re.findall(r"scale worker 0 ready: pid (\d+)", state["log"].read_text())[-1])
    os.kill(worker, signal.SIGSTOP)
    x = np.ones((1, SCALE_N), np.float32)
    held = pool.submit(infer_json, state["url"], "scale",
                       [{"name": "x", "datatype": "FP32", "shape": [1, SCALE_N], "data": x.ravel().tolist()}])
    wait_for(lambda: metric(state["url"], "hearth_inference_pending_request_count", "scale") == 1,
             "the request to arrive")
    return worker, held


def test_a_second_sigterm_exits_at_once_while_the_first_drains(tmp_path):
    """A request held by a worker that does not answer (SIGSTOPped) keeps the
    first SIGTERM's drain waiting (--drain-timeout-ms 600000); a second
    SIGTERM exits at once, 143, saying so, and the stopped worker dies with
    the server."""
    scale_demo_repository(tmp_path / "repo", count=1)
    state = start_serve(tmp_path, tmp_path / "repo", ["--drain-timeout-ms", "600000"], name="again")
    proc = state["proc"]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        worker, held = hold_a_request(state, pool)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "shutting down" in state["log"].read_text(), "the drain to begin")
        assert proc.poll() is None, "the first SIGTERM did not wait for the held request"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        text = state["log"].read_text()
        assert code == 128 + signal.SIGTERM, text[-3000:]
        assert "Terminated again while shutting down: exiting now" in text, text[-3000:]
        with pytest.raises(requests.exceptions.ConnectionError):
            held.result(timeout=30)
        wait_for(lambda: gone(worker), "the worker to be gone")
    finally:
        pool.shutdown(wait=False)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        state["log_file"].close()


def test_a_request_held_past_the_drain_deadline_does_not_hold_sigterm(tmp_path):
    """A request held by a worker that does not answer (SIGSTOPped) outlasts
    the drain (--drain-timeout-ms 500): the workers are then stopped under
    it, which answers it, and the server exits 0, its run directory removed."""
    scale_demo_repository(tmp_path / "repo", count=1)
    state = start_serve(tmp_path, tmp_path / "repo", ["--drain-timeout-ms", "500"], name="held")
    proc = state["proc"]
    run_dir = re.search(r"run directory (\S+)", state["log"].read_text())
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        worker, held = hold_a_request(state, pool)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        text = state["log"].read_text()
        assert code == 0, text[-3000:]
        assert "requests are still running" in text, text[-3000:]
        try:
            held.result(timeout=30)  # answered with an error, or its connection closed
        except requests.exceptions.ConnectionError:
            pass
        wait_for(lambda: gone(worker), "the worker to be gone")
        if run_dir:
            assert not os.path.exists(run_dir.group(1)), f"{run_dir.group(1)} was left behind"
    finally:
        pool.shutdown(wait=False)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        state["log_file"].close()


def test_a_standby_worker_takes_over_from_a_worker_that_dies(tmp_path):
    """parameters.standby_workers: 1 keeps one started worker process that
    holds no weights; a SIGKILLed worker's replacement is that process, and
    another standby follows. A standby that died while it waited is not used:
    the next replacement is started afresh. Nothing is left at shutdown."""
    scale_demo_repository(tmp_path / "repo", count=1, extra="parameters: {standby_workers: '1'}\n")
    state = start_serve(tmp_path, tmp_path / "repo")
    seen = set()
    try:
        def ready_pids():
            return [int(p) for p in re.findall(r"scale worker 0 ready: pid (\d+)", state["log"].read_text())]

        def standby():
            waiting = [p for p in worker_pids(state["proc"].pid)
                       if b"--standby" in pathlib.Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
                       and p not in ready_pids() and p not in seen]
            return waiting[0] if waiting else None

        worker = ready_pids()[-1]
        first = wait_for(standby, "a standby worker")
        seen.update({worker, first})
        wait_for(lambda: metric(state["url"], "hearth_standby_workers", "scale") == 1, "the standby in /metrics")
        maps = pathlib.Path(f"/proc/{first}/maps").read_text()
        assert "hearth-arena" not in maps, "a standby maps the weights"
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: ready_pids()[-1] == first, "the standby to take over")
        assert re.search(rf"ready: pid {first} on .*a standby, loaded \d+ ms before", state["log"].read_text())
        assert_demo_answer(state["url"])
        second = wait_for(standby, "a second standby worker")
        seen.add(second)
        # A standby that dies while it waits: the next replacement is fresh.
        # (Dead first, its socket closed, before the worker dies: the server,
        # told of that death at once, would otherwise reach a standby still
        # exiting, and take it as one that died starting.)
        os.kill(second, signal.SIGKILL)
        wait_for(lambda: gone(second), "the standby to die")
        os.kill(first, signal.SIGKILL)
        fresh = wait_for(lambda: ready_pids()[-1] not in seen and ready_pids()[-1], "a fresh replacement")
        seen.add(fresh)
        assert f"the standby worker (pid {second}) could not take over" in state["log"].read_text()
        assert_demo_answer(state["url"])
        seen.add(wait_for(standby, "a standby after the fresh start"))
    finally:
        code, text = stop_serve(state)
    assert code == 0, text[-3000:]
    for pid in seen:
        wait_for(lambda: gone(pid), f"worker {pid} to be gone")


def test_serving_as_pid_1_in_a_container(tmp_path):
    """In a container without an init process `hearth serve` is PID 1: its
    workers must start and serve all the same."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a PID namespace")
    repo = tmp_path / "repo"
    (repo / "scale" / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "6",
                    "--out", str(repo / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    (repo / "scale" / "config.yaml").write_text(scale_config(count=1, kind="KIND_CPU"))
    log_path = tmp_path / "pid1.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", CLI, "serve", "--model-repository",
                                 str(repo), "--http-port", "0", "--device", "cpu"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            port = wait_for(lambda: (re.findall(r"ready on http://127\.0\.0\.1:(\d+)", log_path.read_text())
                                     or [None])[0], "the server in its PID namespace", timeout=60)
            url = f"http://127.0.0.1:{port}"
            assert requests.get(f"{url}/v2/models/scale/ready").status_code == 200, log_path.read_text()[-2000:]
            x = np.ones((1, SCALE_N), dtype=np.float32)
            assert scale_request(url, "scale", x).status_code == 200
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def test_readiness_is_strict_unless_relaxed(tmp_path):
    """A repository with a model that cannot be served: not ready (Triton's
    strict readiness) until --strict-readiness false; the good model serves
    either way."""
    repo = tmp_path / "repo"
    for name, dims in (("good", 8), ("bad", 8)):
        (repo / name / "1").mkdir(parents=True)
        subprocess.run([CLI, "make-model", "scale", "--dims", str(dims), "--seed", "2",
                        "--out", str(repo / name / "1" / "model.safetensors")], check=True, capture_output=True)
    (repo / "good" / "config.yaml").write_text(scale_config(count=1).replace(f"[{SCALE_N}]", "[8]"))
    (repo / "bad" / "config.yaml").write_text("backend: scale\nmax_batch_size: 4\nno_such_field: 1\n")
    for flag, want in ((), 503), (("--strict-readiness", "false"), 200):
        state = start_serve(tmp_path, repo, extra_args=flag, name=f"serve-{want}")
        try:
            assert requests.get(f"{state['url']}/v2/health/ready").status_code == want, flag
            assert requests.get(f"{state['url']}/v2/models/good/ready").status_code == 200
        finally:
            code, log = stop_serve(state)
        assert code == 0, log[-2000:]


def alias_bomb_config():
    """A config.yaml that is a YAML alias bomb ("billion laughs"): ten levels
    of nine aliases each, 3.5e9 scalars once expanded, in under 400 bytes."""
    lines = ["backend: scale", "parameters:", "  a: &a [x, x, x, x, x, x, x, x, x]"]
    for level in "bcdefghij":
        previous = chr(ord(level) - 1)
        lines.append(f"  {level}: &{level} [" + ", ".join([f"*{previous}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_fails_its_model_alone(tmp_path):
    """An alias bomb in one model's config.yaml beside a good model: the
    server listens and serves the good model, the bomb's model is not served
    and says why (its readiness, the repository index, the log), and SIGTERM
    stops the server."""
    repo = tmp_path / "repo"
    scale_demo_repository(repo, count=1)
    (repo / "bomb" / "1").mkdir(parents=True)
    shutil.copy(repo / "scale" / "1" / "model.safetensors", repo / "bomb" / "1" / "model.safetensors")
    (repo / "bomb" / "config.yaml").write_text(alias_bomb_config())
    reason = "bomb/config.yaml:4: *a: aliases are not supported in model configs"
    state = start_serve(tmp_path, repo, name="bomb")
    try:
        url = state["url"]
        assert requests.get(f"{url}/v2/models/scale/ready", timeout=10).status_code == 200
        assert_demo_answer(url)
        r = requests.get(f"{url}/v2/models/bomb/ready", timeout=10)
        assert r.status_code == 503 and reason in r.json()["error"], r.text[:500]
        index = requests.post(f"{url}/v2/repository/index", json={}, timeout=10)
        assert index.status_code == 200, index.text[:500]
        bomb = [m for m in index.json() if m["name"] == "bomb"]
        assert bomb and bomb[0]["state"] == "UNAVAILABLE" and reason in bomb[0]["reason"], index.text[:1000]
        assert reason in state["log"].read_text(), "the log does not say why the bomb's model is not served"
    finally:
        # A generous deadline, no timing asserted: the server must exit of itself.
        code, text = stop_serve(state, timeout=120)
    assert code == 0, text[-3000:]


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_a_port_in_use_fails_the_start_before_any_model_loads(tmp_path, which):
    """With the HTTP or the gRPC port taken, `hearth serve` exits non-zero
    naming the address, and no model began to load (both ports are bound
    first)."""
    repo = tmp_path / "repo"
    scale_demo_repository(repo, count=1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = ["--http-port", str(port), "--grpc-port", "-1"] if which == "http" else \
            ["--http-port", "0", "--grpc-port", str(port)]
        out = subprocess.run([CLI, "serve", "--model-repository", str(repo), *ports],
                             capture_output=True, text=True, timeout=120)
    if which == "grpc" and "built without gRPC" in out.stderr:
        pytest.skip("this hearth was built without gRPC")
    assert out.returncode != 0, out.stdout[-2000:]
    said = f"cannot bind 127.0.0.1:{port}" if which == "http" else f"cannot listen for gRPC on 127.0.0.1:{port}"
    assert said in out.stderr, out.stderr[-2000:]
    assert "loading scale" not in out.stdout + out.stderr, out.stdout[-2000:]
