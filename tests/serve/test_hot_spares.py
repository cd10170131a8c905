"""Hot spares (`parameters: {standby_workers: N, standby_mode: hot}`) under
`hearth serve`: worker processes started, attached and warmed up with one
batch of zeros ahead of need; a SIGKILLed worker's place is taken by one at
once while requests keep coming, none of them fails, and another spare
follows. /metrics counts them, GET /v2/hearth/workers and `hearth status
--url` list them; bad standby_mode values are refused naming the fields.

The built-in scale backend (C++) and a `backend: python` model.py (NumPy)
that marks each execute() in a file, so that the warm-up batch is seen to
run in the spare's own process, and one that fails on zeros (the spare is
kept); a decoupled one whose warm-up stream is cancelled at its first
response; spares that die or hang in their warm-up, replaced after a
growing back-off.
"""

import concurrent.futures
import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading

import pytest
import requests

from serve_support import (CLI, KIND, ON_GPU, SCALE_N, gone, metric, metrics, scale_config, wait_for,
                           write_model)

HOT = "parameters: {standby_workers: '1', standby_mode: hot}\n"
DEMO_Y = 34.695457  # the demo weights (seed 1) on a row of ones

COUNTING_PY = """
import os

import numpy as np


class Model:
    def initialize(self, args):
        self.dir = args["model_repository"]
        self.w = np.asarray(args["weights"]["weight"])

    def execute(self, inputs):
        x = np.asarray(inputs["x"])
        with open(os.path.join(self.dir, f"executed-{os.getpid()}"), "a") as f:
            f.write(f"{x.shape[0]} {float(np.abs(x).sum())}\\n")
        return {"y": (x * self.w).sum(axis=1, keepdims=True).astype(np.float32)}
"""

# Pieces without end, one every 20 ms, unless cancelled: a closed generator
# leaves closed-<pid> in the version directory, with the prompt it had.
ENDLESS_PY = """
import os
import time

import numpy as np


class Model:
    def initialize(self, args):
        self.dir = args["model_repository"]

    def execute(self, inputs, parameters):
        prompt = inputs["text_input"][0]
        try:
            for i in range(int(parameters.get("pieces", 1000000))):
                yield {"text_output": np.array([b"%d " % i], dtype=object)}
                time.sleep(0.02)
        except GeneratorExit:
            with open(os.path.join(self.dir, f"closed-{os.getpid()}"), "wb") as f:
                f.write(prompt)
            raise
"""


def python_config(extra):
    # On the host wherever the tests run: model.py reads its weights with NumPy.
    return scale_config(1, kind="KIND_CPU").replace("backend: scale", "backend: python") + \
        f"parameters:\n  python: {sys.executable}\n" + extra


def workers_of(url, model):
    r = requests.get(f"{url}/v2/hearth/workers", timeout=10)
    assert r.status_code == 200, r.text
    for m in r.json()["models"]:
        if m["name"] == model:
            return m
    return None


def spare_pids(url, model):
    m = workers_of(url, model)
    return [s["pid"] for p in (m["placements"] if m else []) for s in p["hot_spares"]]


def serving_pid(url, model):
    m = workers_of(url, model)
    pids = [w["pid"] for p in m["placements"] for w in p["workers"] if w["ready"]]
    return pids[0] if pids else None


def hearth_status(url):
    return subprocess.run([CLI, "status", "--url", url], capture_output=True, text=True, timeout=60)


def nvidia_smi_memory():
    """pid -> MiB of device memory, summed over the GPUs, as nvidia-smi lists
    its compute processes; None where there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    used = {}
    for line in out.stdout.splitlines():
        pid, mib = (field.strip() for field in line.split(","))
        used[int(pid)] = used.get(int(pid), 0) + int(mib)
    return used


def memory_text(nbytes):
    """As `hearth status` prints a byte count."""
    return f"{nbytes} B" if nbytes < 1 << 20 else f"{nbytes / (1 << 20):.1f} MiB"


def check_driver_memory(url, model, spare):
    """The spare's device memory as the driver accounts it: in
    /v2/hearth/workers (null where unknown), in `hearth status --url`, and in
    hearth_hot_spare_device_memory_bytes, whose HELP says which figure it is.
    On the CPU there is none; on a GPU it is what nvidia-smi lists for the
    pid, where nvidia-smi lists it (not in a container with its own PID
    namespace), CUDA context included."""
    r = requests.get(f"{url}/metrics", timeout=10)
    help_line = next(line for line in r.text.splitlines()
                     if line.startswith("# HELP hearth_hot_spare_device_memory_bytes "))
    def spare_entry():
        m = workers_of(url, model)
        for p in m["placements"]:
            for w in p["workers"] + p["hot_spares"]:
                assert "driver_device_memory_bytes" in w, w
        [entry] = [s for p in m["placements"] for s in p["hot_spares"] if s["pid"] == spare]
        return entry

    # nvidia-smi first: the server keeps the driver's list for up to a second,
    # so a list it read before the spare made its context may still be served
    # at once; one read after nvidia-smi's, a second on, lists the spare.
    smi = nvidia_smi_memory() if ON_GPU else None
    entry = spare_entry()
    if smi is not None and spare in smi:
        entry = wait_for(lambda: (e := spare_entry())["driver_device_memory_bytes"] is not None and e,
                         f"hearth to list the spare's driver memory (nvidia-smi: pid {spare}, {smi[spare]} MiB)")
    driver = entry["driver_device_memory_bytes"]
    if not ON_GPU:
        assert driver is None, entry
        assert "reported it when ready" in help_line and "contexts not included" in help_line, help_line
        want = entry["device_memory_bytes"]
    elif smi is not None and spare in smi:
        assert driver is not None, f"nvidia-smi lists the spare (pid {spare}, {smi[spare]} MiB); hearth does not"
        assert abs(driver / (1 << 20) - smi[spare]) <= 2, (driver, smi[spare])
        assert driver > entry["device_memory_bytes"], "the driver's figure includes the CUDA context"
        assert "as the NVIDIA driver accounts it" in help_line, help_line
        want = driver
    else:
        # The driver's pids are not ours (or there is no nvidia-smi to say).
        want = driver if driver is not None else entry["device_memory_bytes"]
    assert metric(url, "hearth_hot_spare_device_memory_bytes", model) == want
    status = hearth_status(url)
    assert status.returncode == 0, status.stderr
    assert "GPU MEMORY (DRIVER)" in status.stdout.splitlines()[0], status.stdout
    driver_text = "-" if driver is None else re.escape(memory_text(driver))
    assert re.search(rf"hot spare\s+{spare}\s+-\s+-\s+{re.escape(memory_text(entry['device_memory_bytes']))}"
                     rf"\s+{driver_text}\s+[\d.]+ ms", status.stdout), status.stdout


def under_load(url, model, act):
    """Sends requests of ones to `model` from 4 threads while `act()` runs
    (and until 20 more have been answered after it): every answer must be
    200 with the demo weights' y. Returns how many were answered."""
    stop = threading.Event()
    answered = []
    lock = threading.Lock()
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, SCALE_N],
                        "data": [1.0] * SCALE_N}]}

    def client():
        with requests.Session() as session:
            while not stop.is_set():
                r = session.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)
                with lock:
                    answered.append((r.status_code, r.text if r.status_code != 200 else
                                     r.json()["outputs"][0]["data"][0]))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client) for _ in range(4)]
        try:
            wait_for(lambda: len(answered) >= 20, "requests answered before the kill")
            act()
            after = len(answered)
            wait_for(lambda: len(answered) >= after + 20, "requests answered after the takeover", timeout=60)
        finally:
            stop.set()
            for c in clients:
                c.result(timeout=90)
    failed = [(code, y) for code, y in answered if code != 200 or abs(y - DEMO_Y) > 1e-3]
    assert not failed, f"{len(failed)} of {len(answered)} requests failed: {failed[:3]}"
    return len(answered)


def check_takeover(state, model, version=None):
    """The spare is ready; SIGKILL the serving worker under load; the spare
    takes over, no request fails, a new spare follows and is listed."""
    url, log = state["url"], state["log"]
    wait_for(lambda: metric(url, "hearth_hot_spares", model) == 1, "a hot spare in /metrics", timeout=120)
    assert metric(url, "hearth_standby_workers", model) == 0, "a hot spare counted as a cold standby"
    # The warm-up batch is the spare's own: no request's, and no statistic.
    assert metric(url, "hearth_inference_exec_count", model) == 0
    [spare] = spare_pids(url, model)
    assert re.search(rf"{model}: hot spare ready on \S+: pid {spare} in \d+ ms, its warm-up batch in", log.read_text())
    if version is not None:
        # Its warm-up batch ran in its own process: one row of zeros.
        assert (version / f"executed-{spare}").read_text() == "1 0.0\n"
    worker = serving_pid(url, model)
    assert worker is not None and worker != spare

    under_load(url, model, lambda: os.kill(worker, signal.SIGKILL))

    text = log.read_text()
    assert f"{model} worker 0: the hot spare (pid {spare}) takes over" in text, text[-3000:]
    assert serving_pid(url, model) == spare
    assert metric(url, "hearth_hot_spare_takeovers_total", model) >= 1
    # Another spare follows, and is listed by pid.
    fresh = wait_for(lambda: [p for p in spare_pids(url, model) if p != spare], "a new hot spare", timeout=120)[0]
    wait_for(lambda: metric(url, "hearth_hot_spares", model) == 1, "the new spare in /metrics")
    status = hearth_status(url)
    assert status.returncode == 0, status.stderr
    rows = [line.split() for line in status.stdout.splitlines()]
    assert any(row[0] == model and "spare" in row and str(fresh) in row for row in rows), status.stdout
    assert any(row[0] == model and "worker" in row and str(spare) in row for row in rows), status.stdout
    if version is not None:
        assert (version / f"executed-{fresh}").read_text() == "1 0.0\n"
    wait_for(lambda: gone(worker), "the killed worker to be reaped")
    return fresh


def test_a_hot_spare_of_the_scale_backend_takes_over_with_no_request_failing(tmp_path, serve):
    write_model(tmp_path / "repo", "scale", scale_config(1, HOT, kind=KIND))
    state = serve(tmp_path / "repo")
    fresh = check_takeover(state, "scale")
    assert metrics(state["url"]).get('hearth_hot_spare_device_memory_bytes{model="scale"}') is not None
    check_driver_memory(state["url"], "scale", fresh)
    # At shutdown no spare is left behind.
    proc = state["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    state["log_file"].close()
    wait_for(lambda: gone(fresh), "the spare to be gone after shutdown")


def test_a_python_hot_spare_ran_its_warm_up_batch_and_takes_over(tmp_path, serve):
    version = write_model(tmp_path / "repo", "pyscale", python_config("  standby_workers: '1'\n"
                                                                      "  standby_mode: hot\n"), COUNTING_PY)
    state = serve(tmp_path / "repo")
    fresh = check_takeover(state, "pyscale", version)
    # The Python worker's own line for its first batch: the new spare's
    # warm-up (it has served nothing).
    assert f"hearth.backend_worker: pid {fresh}: its first batch ran in" in state["log"].read_text()


ZEROS_FAIL_PY = """
import numpy as np


class Model:
    def initialize(self, args):
        self.w = np.asarray(args["weights"]["weight"])

    def execute(self, inputs):
        x = np.asarray(inputs["x"])
        if not x.any():
            raise ValueError("all zeros: nothing to scale")
        return {"y": (x * self.w).sum(axis=1, keepdims=True).astype(np.float32)}
"""


def test_a_spare_whose_warm_up_batch_fails_in_the_model_is_kept_and_takes_over(tmp_path, serve):
    """An error answer to the warm-up batch is the model's view of zeros,
    not the process's health: logged, and the spare kept."""
    write_model(tmp_path / "repo", "picky", python_config("  standby_workers: '1'\n  standby_mode: hot\n"),
                ZEROS_FAIL_PY)
    state = serve(tmp_path / "repo")
    url = state["url"]
    wait_for(lambda: metric(url, "hearth_hot_spares", "picky") == 1, "a hot spare in /metrics", timeout=120)
    [spare] = spare_pids(url, "picky")
    assert (f"picky: the warm-up batch of the hot spare (pid {spare}) on cpu failed: ValueError: all zeros: "
            "nothing to scale; it is kept") in state["log"].read_text()
    os.kill(serving_pid(url, "picky"), signal.SIGKILL)
    wait_for(lambda: serving_pid(url, "picky") == spare, "the spare to take over")
    r = requests.post(f"{url}/v2/models/picky/infer", json={"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, SCALE_N], "data": [1.0] * SCALE_N}]}, timeout=30)
    assert r.status_code == 200 and abs(r.json()["outputs"][0]["data"][0] - DEMO_Y) < 1e-3, r.text


def test_a_decoupled_hot_spare_warms_up_with_a_stream_it_cancels(tmp_path, serve):
    config = f"""backend: python
max_batch_size: 0
model_transaction_policy: {{decoupled: true}}
input:
  - {{name: text_input, data_type: TYPE_STRING, dims: [1]}}
output:
  - {{name: text_output, data_type: TYPE_STRING, dims: [1]}}
instance_group:
  - {{count: 1, kind: {KIND}}}
parameters:
  python: {sys.executable}
  standby_workers: '1'
  standby_mode: hot
"""
    version = write_model(tmp_path / "repo", "endless", config, ENDLESS_PY)
    state = serve(tmp_path / "repo")
    url = state["url"]
    wait_for(lambda: metric(url, "hearth_hot_spares", "endless") == 1, "a hot spare in /metrics", timeout=120)
    [spare] = spare_pids(url, "endless")
    # The warm-up stream was cancelled at its first response (its prompt an
    # empty BYTES element), and the spare kept.
    assert (version / f"closed-{spare}").read_bytes() == b""
    worker = serving_pid(url, "endless")
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: serving_pid(url, "endless") == spare, "the spare to take over")
    r = requests.post(f"{url}/v2/models/endless/generate",
                      json={"text_input": "hi", "parameters": {"pieces": 3}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == "0 1 2 "


def test_spares_that_die_or_hang_in_their_warm_up_are_replaced_after_a_growing_back_off(tmp_path, serve):
    """fault_injection on 0.0: every spare's warm-up batch of zeros aborts
    (or hangs past --exec-timeout-ms and is killed); each is reaped and
    logged, and the next waits longer (the back-off the log states, never a
    tight loop). The workers serve on, and stopping kills the spare being
    warmed up."""
    root = tmp_path / "repo"
    for name, kind in (("dies", "abort"), ("hangs", "hang")):
        write_model(root, name, scale_config(1, "parameters:\n  standby_workers: '1'\n  standby_mode: hot\n"
                                                f"  fault_injection: {{on_value: 0.0, kind: {kind}}}\n", kind=KIND))
    state = serve(root, ["--exec-timeout-ms", "1000"])
    url, log = state["url"], state["log"]
    for name, what in (("dies", "died in its warm-up batch"), ("hangs", "ran past --exec-timeout in its warm-up batch")):
        failure = re.compile(rf"\] {name}: the hot spare \(pid \d+\) on \S+ {re.escape(what)} "
                             r"\((?:killed by signal \d+|exited with status \d+)\); another in (\d+) ms")
        waits = wait_for(lambda: (lambda w: w if len(w) >= 3 else None)(failure.findall(log.read_text())),
                         f"three failed spares of {name}", timeout=60)
        assert [int(w) for w in waits[:3]] == [100, 200, 400], waits
        assert metric(url, "hearth_hot_spares", name) == 0
        r = requests.post(f"{url}/v2/models/{name}/infer", json={"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, SCALE_N], "data": [1.0] * SCALE_N}]}, timeout=30)
        assert r.status_code == 200 and abs(r.json()["outputs"][0]["data"][0] - DEMO_Y) < 1e-3, r.text


BAD_STANDBY_MODES = {
    # name: (parameters, what its ready answer must say)
    "lonely": ("parameters: {standby_mode: hot}\n",
               "parameters.standby_mode: hot keeps parameters.standby_workers processes started, and "
               "parameters.standby_workers is 0"),
    "zero": ("parameters: {standby_workers: '0', standby_mode: hot}\n", "parameters.standby_workers is 0"),
    "warm": ("parameters: {standby_workers: '1', standby_mode: warm}\n",
             "parameters.standby_mode: 'warm' is not cold or hot"),
}


def test_bad_standby_modes_are_refused_naming_the_fields(tmp_path, serve):
    root = tmp_path / "repo"
    for name, (parameters, _) in BAD_STANDBY_MODES.items():
        write_model(root, name, scale_config(1, parameters, kind=KIND))
    write_model(root, "cold", scale_config(1, "parameters: {standby_workers: '1', standby_mode: cold}\n", kind=KIND))
    state = serve(root)
    url = state["url"]
    for name, (_, message) in BAD_STANDBY_MODES.items():
        r = requests.get(f"{url}/v2/models/{name}/ready", timeout=10)
        assert r.status_code == 503, f"{name}: {r.status_code} {r.text[:300]}"
        assert message in r.json()["error"], r.json()["error"]
        assert f"{name}/config.yaml:" in r.json()["error"]
    # Cold is today's standby: a waiting process, no hot spare.
    assert requests.get(f"{url}/v2/models/cold/ready", timeout=10).status_code == 200
    wait_for(lambda: metric(url, "hearth_standby_workers", "cold") == 1, "the cold standby")
    assert metric(url, "hearth_hot_spares", "cold") == 0
    m = workers_of(url, "cold")
    assert m["standby_mode"] == "cold" and m["placements"][0]["hot_spares"] == []
    [standby] = m["placements"][0]["standbys"]
    status = hearth_status(url)
    assert status.returncode == 0, status.stderr
    assert any("standby" in line and str(standby["pid"]) in line for line in status.stdout.splitlines()), status.stdout


class _Answer(http.server.BaseHTTPRequestHandler):
    code, body = 200, b""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.code)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def answering(code, body):
    """An HTTP server on a free port answering every GET with `code` and `body`."""
    handler = type("Handler", (_Answer,), {"code": code, "body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("case", ["refused", "not_json", "not_found", "wrong_json", "bad_url"])
def test_hearth_status_url_errors_are_one_clear_line(case):
    server = None
    if case == "refused":
        with socket.socket() as s:  # a port nothing listens on once it is closed
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"
        want = f"cannot reach the server at {url}"
    elif case == "bad_url":
        url, want = "localhost:8000", "bad URL 'localhost:8000'"
    else:
        code, body, want = {
            "not_json": (200, b"<html>hello</html>", "the answer is not JSON"),
            "not_found": (404, b'{"error": "no such endpoint: /v2/hearth/workers"}',
                          "HTTP 404: no such endpoint: /v2/hearth/workers"),
            "wrong_json": (200, json.dumps({"models": [{"name": "m"}]}).encode(), "models[0].version: missing"),
        }[case]
        server = answering(code, body)
        url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        r = hearth_status(url)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hearth: error: ") and want in lines[0], r.stderr
    assert r.stdout == ""
