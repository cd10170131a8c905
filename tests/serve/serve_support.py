"""What the tests of `hearth serve` share: the build's paths and the device
they run on, the test models' configs and weights, starting and stopping a
server, waiting on a condition with a deadline, the server's worker
processes, its REST inference and its /metrics.

pytest puts this directory on sys.path for the tests in it, so they import
this module by name; a script elsewhere adds tests/serve to sys.path first.

Paths: $HEARTH_CLI (default build/bin/hearth). With HEARTH_TEST_DEVICE=cuda
the models are KIND_GPU and servers run with --device cuda (the GPU run).
"""

import json
import os
import pathlib
import re
import resource
import signal
import struct
import subprocess
import time

import numpy as np
import pytest
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI = os.environ.get("HEARTH_CLI") or str(ROOT / "build" / "bin" / "hearth")
MLP = (32, 64, 10)  # in, hidden, out
SCALE_N = 500
DEVICE = os.environ.get("HEARTH_TEST_DEVICE", "cpu")
ON_GPU = DEVICE.startswith("cuda")
KIND = "KIND_GPU" if ON_GPU else "KIND_CPU"


# ---- waiting -----------------------------------------------------------------

def wait_for(condition, what, timeout=30):
    """Polls `condition` until it returns something true, and returns that;
    fails the test once `timeout` seconds have passed without it. `what`
    names what is awaited, or is a function that does (called on a timeout,
    so that it can say what was seen last)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")
        time.sleep(0.05)


# ---- models --------------------------------------------------------------------

def read_safetensors(path):
    blob = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        out[name] = np.frombuffer(data[b:end], dtype="<f4").reshape(e["shape"])
    return out


def mlp_config(count, extra=""):
    return f"""backend: mlp
max_batch_size: 8
input:
  - {{name: input, data_type: TYPE_FP32, dims: [{MLP[0]}]}}
output:
  - {{name: logits, data_type: TYPE_FP32, dims: [{MLP[2]}]}}
  - {{name: argmax, data_type: TYPE_INT64, dims: [1]}}
instance_group:
  - {{count: {count}, kind: {KIND}}}
""" + extra


def scale_config(count, extra="", kind=KIND, dims=SCALE_N):
    return f"""backend: scale
max_batch_size: 4
input:
  - {{name: x, data_type: TYPE_FP32, dims: [{dims}]}}
output:
  - {{name: y, data_type: TYPE_FP32, dims: [1]}}
instance_group:
  - {{count: {count}, kind: {kind}}}
""" + extra


def write_model(root, name, config, code=None, dims=SCALE_N, seed=1, weights=True):
    """A model directory under `root`: its config.yaml, and a version 1 with
    a scale checkpoint of `dims` weights of `seed` (unless not `weights`) and
    `code` as its model.py (when given). Returns the version directory."""
    version = root / name / "1"
    version.mkdir(parents=True)
    if weights:
        subprocess.run([CLI, "make-model", "scale", "--dims", str(dims), "--seed", str(seed),
                        "--out", str(version / "model.safetensors")], check=True, capture_output=True)
    (root / name / "config.yaml").write_text(config)
    if code is not None:
        (version / "model.py").write_text(code)
    return version


def mlp_reference(w, x):
    h = np.maximum(x.astype(np.float64) @ w["encoder.weight"].T.astype(np.float64) + w["encoder.bias"], 0)
    logits = h @ w["head.weight"].T.astype(np.float64) + w["head.bias"]
    return logits, np.argmax(logits, axis=1)


# ---- a server ------------------------------------------------------------------

READY = re.compile(r"ready on http://127\.0\.0\.1:(\d+)")


def start_serve(tmp, repo, extra_args=(), env=None, cli=CLI, name="serve", pass_fds=(), device=None,
                nofile=None):
    """Starts `hearth serve` on `repo` (with RLIMIT_NOFILE `nofile` if given)
    and waits (polling its log, with a deadline) for its ready line. Returns
    its url, process, log path and the run directory it logged."""
    log_path = tmp / f"{name}.log"
    log = open(log_path, "w+")

    def limit_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen([cli, "serve", "--model-repository", str(repo), "--http-port", "0",
                             "--device", device or ("cuda" if ON_GPU else "cpu"), *extra_args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                            pass_fds=pass_fds, preexec_fn=limit_descriptors if nofile is not None else None)
    ready = None
    try:
        # Its ready line, or its end without one.
        ready = wait_for(lambda: READY.search(log_path.read_text()) or proc.poll() is not None,
                         "hearth serve's ready line", timeout=60)
    except pytest.fail.Exception:
        pass  # failed below, with the log
    if not isinstance(ready, re.Match):
        proc.kill()
        proc.wait()
        log.close()
        pytest.fail("hearth serve did not become ready:\n" + log_path.read_text()[-4000:])
    run_dir = re.search(r"run directory (\S+)", log_path.read_text())
    assert run_dir, "the server did not log its run directory"
    return {"url": f"http://127.0.0.1:{ready.group(1)}", "proc": proc, "log": log_path, "log_file": log,
            "run_dir": run_dir.group(1)}


def stop_serve(state, timeout=30):
    """SIGTERM; returns (exit code or a note that it had to be killed, log text)."""
    proc = state["proc"]
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = f"killed after {timeout} s"
    state["log_file"].close()
    return code, state["log"].read_text()


WIDE_N = 65536  # 256 KiB a row: bodies past the front-end's 1 MiB chunk at 4 rows


def write_scale_repository(root, workers=2):
    """Two scale models on the CPU, `scale` (SCALE_N weights) and `wide`
    (WIDE_N); returns their weights, {name: tuple of floats}."""
    weights = {}
    for name, n in (("scale", SCALE_N), ("wide", WIDE_N)):
        (root / name / "1").mkdir(parents=True)
        path = root / name / "1" / "model.safetensors"
        subprocess.run([CLI, "make-model", "scale", "--dims", str(n), "--seed", "6", "--out", str(path)],
                       check=True, capture_output=True)
        (root / name / "config.yaml").write_text(scale_config(workers, kind="KIND_CPU", dims=n))
        blob = path.read_bytes()
        (header_size,) = struct.unpack("<Q", blob[:8])
        begin, end = json.loads(blob[8:8 + header_size])["weight"]["data_offsets"]
        data = blob[8 + header_size + begin:8 + header_size + end]
        weights[name] = struct.unpack(f"<{len(data) // 4}f", data)
    return weights


class Server:
    """A `hearth serve` process on the CPU, on a free port, serving
    write_scale_repository's models; its repository and log in `tmp`. For
    the tests whose clients are the standard library's own sockets."""

    def __init__(self, tmp, args=(), nofile=None, workers=2):
        self.tmp = tmp
        self.weights = write_scale_repository(tmp / "repo", workers)
        state = start_serve(tmp, tmp / "repo", args, device="cpu", nofile=nofile)
        self.log_path, self.log, self.proc = state["log"], state["log_file"], state["proc"]
        self.port = int(state["url"].rsplit(":", 1)[1])

    @property
    def pid(self):
        return self.proc.pid

    def text(self):
        return self.log_path.read_text()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def stop(self, timeout=60):
        """SIGTERM; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()


# ---- processes -------------------------------------------------------------------

def memory_fields(pid, *keys):
    """Fields of /proc/PID/status given in kB (VmRSS, VmHWM, VmSize...), in bytes."""
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            fields[key] = int(value.split()[0]) * 1024
    return [fields[k] for k in keys]


def gone(pid):
    """Process `pid` has exited (no longer there, or a zombie not yet reaped)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


# ---- its workers -----------------------------------------------------------------

def worker_pids(serve_pid):
    """Children of the server that run hearth-worker."""
    pids = []
    for task in pathlib.Path(f"/proc/{serve_pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended while the list was read
        for c in children:
            try:
                cmd = pathlib.Path(f"/proc/{c}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"hearth-worker" in cmd:
                pids.append(int(c))
    return pids


def model_workers(serve_pid, model):
    out = []
    for p in worker_pids(serve_pid):
        try:
            argv = pathlib.Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"--model" not in argv:
            continue  # exited (a zombie's cmdline is empty) since it was listed
        if model.encode() in argv[argv.index(b"--model") + 1:argv.index(b"--model") + 2]:
            out.append(p)
    return out


def python_workers(serve_pid, model):
    """Pids of the server's Python workers of `model`: exec'd (hearth-worker
    execs python in its place) or forked from the model's zygote, whose
    command line they keep; the zygote itself (named hearth-zygote) is none."""
    out = []
    for task in pathlib.Path(f"/proc/{serve_pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for c in children:
            try:
                argv = pathlib.Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")
                name = pathlib.Path(f"/proc/{c}/comm").read_text().strip()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if b"hearth.backend_worker" in argv and b"--model" in argv and name != "hearth-zygote" and \
                    argv[argv.index(b"--model") + 1] == model.encode():
                out.append(int(c))
    return out


def model_workers_alive(run_dir):
    """Any hearth-worker still attached to a store in `run_dir`."""
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if b"hearth-worker" in cmd and run_dir.encode() in cmd:
            return True
    return False


# ---- REST ------------------------------------------------------------------------

def infer_json(url, model, inputs, **extra):
    body = {"inputs": inputs, **extra}
    return requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=30)


def infer_binary(url, model, name, x, outputs=None):
    header = {"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                          "parameters": {"binary_data_size": x.nbytes}}]}
    if outputs:
        header["outputs"] = [{"name": o, "parameters": {"binary_data": True}} for o in outputs]
    hj = json.dumps(header).encode()
    r = requests.post(f"{url}/v2/models/{model}/infer", data=hj + x.astype("<f4").tobytes(),
                      headers={"Inference-Header-Content-Length": str(len(hj)),
                               "Content-Type": "application/octet-stream"}, timeout=30)
    return r


def split_binary(r):
    n = int(r.headers.get("Inference-Header-Content-Length", len(r.content)))
    header = json.loads(r.content[:n])
    rest = r.content[n:]
    parts = {}
    for o in header["outputs"]:
        size = o.get("parameters", {}).get("binary_data_size")
        if size is not None:
            parts[o["name"]] = rest[:size]
            rest = rest[size:]
    return header, parts


def parse_metrics(text):
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    return values


def metrics(url):
    r = requests.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    return parse_metrics(r.text)


def metric(url, name, model):
    return metrics(url).get(f'{name}{{model="{model}"}}', 0.0)


def metric_sum(url, name, model):
    """The sum of `name` over every sample of `model` (per worker, per device, ...)."""
    prefix, label = name + "{", f'model="{model}"'
    return sum(v for k, v in metrics(url).items()
               if k.startswith(prefix) and label in k[len(prefix):-1].split(","))


def events(response):
    """The payloads of a server-sent event stream, as they arrive."""
    data = []
    for line in response.iter_lines(decode_unicode=False):
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" ").decode())
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)
