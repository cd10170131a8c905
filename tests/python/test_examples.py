"""Runs the examples in examples/ for real against a `hearth store`.

The store's device is $HEARTH_TEST_DEVICE (passed as `hearth store --device`;
default "cpu", host memory; "cuda:0" runs the examples against a GPU store).

- examples/gunicorn_flask: gunicorn -w 3 --preload; the master maps nothing,
  every worker that answered maps the one arena; results equal a numpy
  reference computed from the checkpoint file.
- examples/fastapi_uvicorn: uvicorn --workers 4; every worker maps the same
  arena at startup; generated tokens equal a reference from the checkpoint.
- examples/torch_workers: demo.py with 3 spawned torch workers; outputs equal
  each other and a torch reference from the checkpoint; the printed table
  shows one copy in use.

On a GPU store: gunicorn checks results and worker pids (not memfd mappings,
which a GPU arena does not have); uvicorn is skipped (app.py computes with
numpy and refuses a GPU store); the torch demo checks that all outputs are
equal and equal a CPU reference.

Each test is skipped (saying why) when its framework is not importable. Paths
come from $HEARTH_CLI and $HEARTH_LIBRARY (set by ctest), defaulting to build/.
"""

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np

from process_group import start, stop
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CLI = os.environ.get("HEARTH_CLI") or str(ROOT / "build" / "bin" / "hearth")
LIBRARY = os.environ.get("HEARTH_LIBRARY") or str(ROOT / "build" / "src" / "capi" / "libhearth.so")
ARENA = "memfd:hearth-arena"
DEVICE = os.environ.get("HEARTH_TEST_DEVICE") or "cpu"  # the store's --device
ON_CUDA = DEVICE.startswith("cuda")

SCALE_N = 500
TINY_DIMS = (256, 64, 256)   # in, hidden, out: byte vocabulary in and out
MLP_DIMS = (256, 1024, 128)  # the torch demo's (small, host memory)
START_TIMEOUT = 60           # seconds for a server to come up
REQUEST_TIMEOUT = 60 if ON_CUDA else 20  # a worker's first GPU request imports torch


# ---- helpers --------------------------------------------------------------


def read_safetensors(path):
    """{name: numpy array} of an F32/F64/F16 checkpoint, read with the format's definition only."""
    blob = pathlib.Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + header_len])
    data = blob[8 + header_len:]
    types = {"F32": "<f4", "F64": "<f8", "F16": "<f2"}
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype=types[entry["dtype"]]).reshape(
            entry["shape"])
    return out


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(store):
    env = dict(os.environ)
    paths = [str(ROOT / "python")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), HEARTH_SOCKET=store.socket,
               HEARTH_LIBRARY=LIBRARY, PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    return env


def http(url, payload=None, timeout=REQUEST_TIMEOUT):
    """(status, JSON body) of a GET, or of a POST of `payload` as JSON."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, body.decode(errors="replace")


def log_text(path):
    try:
        return pathlib.Path(path).read_text(errors="replace")[-6000:]
    except OSError:
        return ""


def wait_until(predicate, proc, what, log_path, timeout=START_TIMEOUT):
    """Polls predicate() until true; fails if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        try:
            if predicate():
                return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        if proc.poll() is not None:
            pytest.fail(f"{what}: the server exited with {proc.returncode}:\n{log_text(log_path)}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s:\n{log_text(log_path)}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def healthy(url):
    status, _ = http(url, timeout=2)
    return status == 200


def arena_inodes(pid):
    """The memfd inode of every hearth arena mapping of `pid` (one entry per mapping)."""
    with open(f"/proc/{pid}/maps") as f:
        return [int(line.split()[4]) for line in f if ARENA in line]


def children(pid):
    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def parent_of(pid):
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def cmdline(pid):
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def post_many(url, payloads, threads=8):
    """POSTs every payload concurrently; returns [(payload, status, body)] in order."""
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        answers = list(pool.map(lambda p: http(url, p), payloads))
    return [(p, s, b) for p, (s, b) in zip(payloads, answers)]


def check_one_shared_arena(worker_pids):
    """Each pid maps exactly one hearth arena, and all map the same memfd (one copy)."""
    inodes = {pid: arena_inodes(pid) for pid in worker_pids}
    assert all(len(v) == 1 for v in inodes.values()), f"arena mappings per worker: {inodes}"
    assert len({v[0] for v in inodes.values()}) == 1, f"workers map different memfds: {inodes}"


# ---- the store ------------------------------------------------------------


class Store:
    def __init__(self, directory, socket_path, files):
        self.directory = directory
        self.socket = socket_path
        self.files = files


@pytest.fixture(scope="module")
def examples_store():
    if not os.path.exists(CLI):
        pytest.fail(f"hearth CLI not found at {CLI}; build target hearth_cli or set HEARTH_CLI")
    directory = tempfile.mkdtemp(prefix="hearth-ex-")  # short: socket paths are limited
    files = {name: os.path.join(directory, f"{name}.safetensors")
             for name in ("scale", "tiny", "mlp")}
    for args in (["scale", "--dims", str(SCALE_N), "--seed", "11", "--out", files["scale"]],
                 ["mlp", "--dims", ",".join(map(str, TINY_DIMS)), "--dtype", "f32",
                  "--seed", "12", "--out", files["tiny"]],
                 ["mlp", "--dims", ",".join(map(str, MLP_DIMS)), "--dtype", "f32",
                  "--seed", "13", "--out", files["mlp"]]):
        subprocess.run([CLI, "make-model", *args], check=True, capture_output=True, timeout=60)
    socket_path = os.path.join(directory, "store.sock")
    out_path = os.path.join(directory, "store.out")
    proc = start([CLI, "store", "--socket", socket_path, "--device", DEVICE]
                 + [f"--model={name}={path}" for name, path in files.items()],
                 directory, dict(os.environ), out_path)
    try:
        wait_until(lambda: "ready" in pathlib.Path(out_path).read_text(), proc,
                   "hearth store ready", out_path, timeout=30)
        yield Store(directory, socket_path, files)
    finally:
        stop(proc)
        shutil.rmtree(directory, ignore_errors=True)


# ---- 1. gunicorn --preload + Flask -----------------------------------------


def scale_reference(weight, number, seed=None):
    """The example's documented math, from the checkpoint's weight."""
    x = np.random.default_rng(number if seed is None else seed).random(
        (number, weight.shape[0]), dtype=np.float32)
    return float(np.dot(x.sum(axis=0, dtype=np.float64), weight.astype(np.float64)))


def test_gunicorn_preload_flask(examples_store, tmp_path):
    pytest.importorskip("flask", reason="flask is not importable")
    pytest.importorskip("gunicorn", reason="gunicorn is not importable")
    weight = read_safetensors(examples_store.files["scale"])["weight"]
    assert weight.shape == (SCALE_N,)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "gunicorn.log"
    proc = start([sys.executable, "-m", "gunicorn", "-w", "3", "--preload",
                  "-b", f"127.0.0.1:{port}", "--timeout", "60", "run_server:app"],
                 EXAMPLES / "gunicorn_flask", child_env(examples_store), log)
    try:
        master = proc.pid
        wait_until(lambda: healthy(base + "/health"), proc, "gunicorn /health", log)
        # The master imported run_server (--preload) and called attach(): mapped nothing.
        assert arena_inodes(master) == [], "the gunicorn master maps the arena"

        payloads = [{"number": n} for n in range(1, 31)]
        answers = post_many(base + "/", payloads)
        deadline = time.monotonic() + 30
        while len({b["pid"] for _, s, b in answers if s == 200}) < 2:
            if time.monotonic() > deadline:
                break
            answers += post_many(base + "/", payloads[:8])
        for payload, status, body in answers:
            assert status == 200, f"{payload}: {status} {body}"
            assert body["result"] == pytest.approx(
                scale_reference(weight, payload["number"]), rel=1e-12, abs=0), payload
        status, body = http(base + "/", {"number": 5, "seed": 123})
        assert status == 200 and body["result"] == pytest.approx(
            scale_reference(weight, 5, 123), rel=1e-12, abs=0)
        status, body = http(base + "/", {"number": "many"})
        assert status == 400 and "number" in body["error"]
        status, body = http(base + "/health")
        assert status == 200 and body["device"] == DEVICE, body

        pids = {b["pid"] for _, _, b in answers}
        assert len(pids) >= 2, f"only worker(s) {pids} answered {len(answers)} requests"
        for pid in pids:
            assert parent_of(pid) == master, f"pid {pid} is not a worker of {master}"
        assert arena_inodes(master) == [], "the gunicorn master maps the arena"
        if not ON_CUDA:
            check_one_shared_arena(pids)
        # On a GPU store there are no memfd mappings to compare: the one copy on the
        # device is measured by bench/python/gunicorn_gpu.py (nvidia-smi), not here.
    finally:
        rc = stop(proc)
    assert rc == 0, f"gunicorn exited with {rc}:\n{log_text(log)}"


# ---- 2. uvicorn --workers 4 + FastAPI --------------------------------------


def generate_reference(model, prompt, max_new_tokens):
    """The toy greedy decoder as app.py's docstring states it, recomputed from scratch."""
    w1, b1 = model["encoder.weight"], model["encoder.bias"]
    w2, b2 = model["head.weight"], model["head.bias"]
    n_in = w1.shape[1]
    context = list(prompt.encode("utf-8"))
    tokens = []
    for _ in range(max_new_tokens):
        x = np.zeros(n_in, dtype=np.float32)
        for t in context:
            x *= np.float32(0.5)
            x[t % n_in] += np.float32(1.0)
        logits = np.maximum(x @ w1.T + b1, np.float32(0)) @ w2.T + b2
        token = int(np.argmax(logits))
        context.append(token)
        tokens.append(token)
    return tokens


@pytest.mark.skipif(ON_CUDA, reason=f"examples/fastapi_uvicorn computes with numpy and refuses "
                    f"a store on a GPU (app.py raises at startup); store on {DEVICE}")
def test_uvicorn_fastapi_workers(examples_store, tmp_path):
    pytest.importorskip("fastapi", reason="fastapi is not importable")
    pytest.importorskip("uvicorn", reason="uvicorn is not importable")
    model = read_safetensors(examples_store.files["tiny"])

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "uvicorn.log"
    env = child_env(examples_store)
    env["HEARTH_MODEL"] = "tiny"
    proc = start([sys.executable, "-m", "uvicorn", "app:app", "--workers", "4",
                  "--host", "127.0.0.1", "--port", str(port)],
                 EXAMPLES / "fastapi_uvicorn", env, log)
    try:
        supervisor = proc.pid

        def workers():
            return [c for c in children(supervisor) if "spawn_main" in cmdline(c)]

        # Each worker attaches at startup: wait for all four to have mapped the arena.
        wait_until(lambda: len(workers()) == 4 and all(arena_inodes(w) for w in workers()),
                   proc, "4 uvicorn workers attached", log)
        wait_until(lambda: healthy(base + "/health"), proc, "uvicorn /health", log)
        all_workers = workers()
        check_one_shared_arena(all_workers)
        assert arena_inodes(supervisor) == [], "the uvicorn supervisor maps the arena"

        prompts = ["hello hearth", "abc", "", "The quick brown fox", "ünïcödé ✓",
                   "one copy of the weights", "x" * 300, "many workers"]
        payloads = [{"prompt": p + (str(i) if i >= len(prompts) else ""),
                     "max_new_tokens": 1 + i % 12}
                    for i, p in enumerate(prompts * 3)]
        answers = post_many(base + "/generate", payloads)
        deadline = time.monotonic() + 30
        while len({b["pid"] for _, s, b in answers if s == 200}) < 2:
            if time.monotonic() > deadline:
                break
            answers += post_many(base + "/generate", payloads[:8])
        for payload, status, body in answers:
            assert status == 200, f"{payload}: {status} {body}"
            expected = generate_reference(model, payload["prompt"], payload["max_new_tokens"])
            assert body["tokens"] == expected, payload
            assert body["text"] == bytes(t % 256 for t in expected).decode("latin-1")
        assert len({tuple(b["tokens"]) for _, _, b in answers}) > 1, "every answer is the same"
        status, _ = http(base + "/generate", {"prompt": "x", "max_new_tokens": 10**6})
        assert status == 400
        inspected = subprocess.run([CLI, "inspect", str(examples_store.files["tiny"])],
                                   check=True, capture_output=True, text=True).stdout
        checksum = next(line for line in inspected.splitlines()
                        if line.startswith("checksum:")).split()[1]
        status, body = http(base + "/health")
        assert (status, body["model"], body["checksum"]) == (200, "tiny", checksum), body

        pids = {b["pid"] for _, _, b in answers}
        assert len(pids) >= 2, f"only worker(s) {pids} answered {len(answers)} requests"
        assert pids <= set(all_workers), f"answers from {pids}, workers are {all_workers}"
        check_one_shared_arena(all_workers)
    finally:
        rc = stop(proc)
    assert rc == 0, f"uvicorn exited with {rc}:\n{log_text(log)}"


# ---- 3. torch.multiprocessing spawn workers --------------------------------


def table_bytes(out, label):
    m = re.search(re.escape(label) + r"\s*: ~[\d.]+ MiB \((\d+) bytes\)", out)
    assert m, f"no {label!r} row in the demo's output:\n{out}"
    return int(m.group(1))


def test_torch_workers_demo(examples_store, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not importable")
    workers = 3
    log = tmp_path / "demo.log"
    proc = start([sys.executable, "demo.py", "--workers", str(workers),
                  "--socket", examples_store.socket, "--timeout", "120"],
                 EXAMPLES / "torch_workers", child_env(examples_store), log)
    try:
        rc = proc.wait(timeout=240)
    finally:
        stop(proc)
    out = log_text(log)
    assert rc == 0, f"demo.py exited with {rc}:\n{out}"
    assert f"All {workers} workers' outputs equal: True" in out, out
    if not ON_CUDA:  # memfd inodes exist on host memory only
        assert "All workers map the same arena (memfd inode): True" in out, out
    assert "Every parameter points into the shared arena: True" in out, out
    assert "Parent: CUDA initialised False, arena mappings 0" in out, out
    assert "ALL PROCESSES FINISHED SUCCESSFULLY" in out, out
    assert len(re.findall(rf"attached mlp@\d+ on {re.escape(DEVICE)} ", out)) == workers, out

    # The table: N copies expected if duplicated, about one copy in use.
    model = read_safetensors(examples_store.files["mlp"])
    weight_bytes = sum(a.nbytes for a in model.values())
    assert table_bytes(out, "Weight bytes (one copy)") == weight_bytes
    assert table_bytes(out, f"Expected if duplicated ({workers} copies)") == workers * weight_bytes
    if ON_CUDA:
        # This MLP (1.5 MiB) is far below a CUDA context: the device-wide numbers cannot
        # show one copy here; bench/python/gunicorn_gpu.py measures that at 1.8 GiB.
        table_bytes(out, "Allocated by the workers' PyTorch allocators")
    else:
        in_use = table_bytes(out, "Memory in use (sum of arena PSS)")
        # One copy: page rounding, per-process kB truncation and alignment padding aside.
        assert 0.9 * weight_bytes <= in_use <= weight_bytes + 64 * 1024, out
        assert table_bytes(out, "Mapped by each worker (arena RSS, max)") >= weight_bytes, out

    # Every worker's output equals a torch forward of the checkpoint on the same input.
    t = {k: torch.from_numpy(v.copy()) for k, v in model.items()}
    x = torch.randn(16, MLP_DIMS[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = torch.nn.functional.linear(
            torch.relu(torch.nn.functional.linear(x, t["encoder.weight"], t["encoder.bias"])),
            t["head.weight"], t["head.bias"])
    preds = torch.argmax(logits, dim=-1).tolist()
    rows = re.findall(r"Worker (\d+) \| PID (\d+) \| Predictions: (\[[\d, ]*\])\.\.\. \| "
                      r"logits sum (-?[\d.]+)", out)
    assert len(rows) == workers, out
    assert len({pid for _, pid, _, _ in rows}) == workers
    for _, _, printed, total in rows:
        assert json.loads(printed) == preds[:4]
        assert float(total) == pytest.approx(float(logits.double().sum()), rel=1e-4, abs=1e-3)


# ---- 4. bench/python/gunicorn_gpu.py, on host memory ---------------------------


@pytest.mark.skipif(ON_CUDA, reason="on a GPU the benchmark is run by itself at full size "
                                     "(python3 bench/python/gunicorn_gpu.py)")
def test_gunicorn_gpu_bench_on_host_memory():
    pytest.importorskip("flask", reason="flask is not importable")
    pytest.importorskip("gunicorn", reason="gunicorn is not importable")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "python" / "gunicorn_gpu.py"), "--cli", CLI,
         "--library", LIBRARY, "--device", "cpu", "--workers", "4", "--mlp-dims", "512,512,256",
         "--concurrency", "16"],
        capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "| 4 workers, gunicorn_gpu_app:app (scale + all of mlp per request): total |" in out, out
    assert "FAIL" not in out, out
    summary = json.loads(out.split("RESULT_JSON ", 1)[1].splitlines()[0])
    assert summary["ok"] and len(summary["scale_mlp"]["pids"]) == 4
