"""Text generation on the GPU: seed 003's workload on hearth serve against
seed 003's own pattern, in one run.

    python3 bench/serve/generate_bench.py --build build-gpu --webroot .gpu/webroot/usr/lib/python3/dist-packages

A Llama-architecture checkpoint of about 1 B parameters in bf16 (random
weights, made offline: hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192) served by 4 workers:
- hearth: examples/generate/llama (backend: python, decoupled) under
  `hearth serve`, one copy of the weights in the store;
- baseline: bench/serve/generate_baseline_app.py under uvicorn --workers 4,
  each worker loading its own copy (seed 003), the same decoding loop.
For each: device memory; output tokens per second and time to first token
with 1, 4 and 16 concurrent streams (POST /v1/completions, stream: true,
greedy, max_tokens 128); and for hearth the time from a worker's SIGKILL to
its replacement streaming again.
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from serve_bench import settled_used_mib  # noqa: E402

PROMPT = "one copy of the weights, many worker processes, and"


def stream(port, max_tokens=128, timeout=120):
    """One streamed completion: (seconds to the first text, seconds in all, completion tokens)."""
    body = json.dumps({"model": "llama", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    first, tokens = None, None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if first is None and chunk["choices"][0].get("text"):
                first = time.time() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, time.time() - t0, tokens


def load(port, concurrency, seconds):
    stop = time.time() + seconds
    results = []
    lock = threading.Lock()

    def client():
        while time.time() < stop:
            r = stream(port)
            with lock:
                results.append(r)

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    wall = time.time() - t0
    ttft = sorted(r[0] for r in results if r[0] is not None)
    return {"concurrency": concurrency, "streams": len(results),
            "tokens_per_s": sum(r[2] or 0 for r in results) / wall,
            "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else None,
            "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None}


def warm(port, workers):
    """Twice as many short streams at once as there are workers, so that every
    worker has run once (its first run loads kernels) before anything is timed."""
    with concurrent.futures.ThreadPoolExecutor(2 * workers) as pool:
        for f in [pool.submit(stream, port, 4) for _ in range(2 * workers)]:
            f.result()


def wait_port(log, pattern, proc, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(pattern, pathlib.Path(log).read_text())
        if m:
            return m
        if proc.poll() is not None:
            raise SystemExit(f"{log}: exited\n" + pathlib.Path(log).read_text()[-3000:])
        time.sleep(0.1)
    raise SystemExit(f"{log}: not ready in {timeout} s")


def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-gpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--webroot", default=".gpu/webroot/usr/lib/python3/dist-packages")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--workers", type=int, default=4)
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-generate-bench-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), a.webroot,
                                                       os.environ.get("PYTHONPATH", "")]))
    repo = tmp / "repo"
    t0 = time.time()
    subprocess.run([sys.executable, str(ROOT / "examples/generate/llama/make_repository.py"), str(repo),
                    "--workers", str(a.workers), "--", "--hidden", "2048", "--intermediate", "8192",
                    "--layers", "16", "--heads", "32", "--kv-heads", "8"], check=True, env=env)
    checkpoint = repo / "llama" / "1"
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / 2**20
    results = {"checkpoint_mib": size, "made_s": time.time() - t0, "workers": a.workers}
    print("checkpoint", results, flush=True)

    # hearth serve
    before = settled_used_mib()
    log = tmp / "serve.log"
    proc = subprocess.Popen([f"{a.build}/bin/hearth", "serve", "--model-repository", str(repo),
                             "--http-port", "0", "--grpc-port", "-1", "--device", "cuda"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(env, HEARTH_PYTHON=sys.executable))
    try:
        port = int(wait_port(log, r"ready on http://127\.0\.0\.1:(\d+)", proc).group(1))
        warm(port, a.workers)
        results["hearth_device_mib"] = settled_used_mib() - before
        results["hearth"] = [load(port, c, a.seconds) for c in (1, 4, 16)]
        print("hearth", results["hearth"], results["hearth_device_mib"], flush=True)
        pids = [int(p) for p in re.findall(r"llama worker 0 ready: pid (\d+)", log.read_text())]
        killed = time.time()
        os.kill(pids[-1], signal.SIGKILL)
        while len(re.findall(r"llama worker 0 ready: pid (\d+)", log.read_text())) < 2:
            if time.time() - killed > 120:
                break
            time.sleep(0.01)
        results["hearth_replacement_ready_s"] = time.time() - killed
        first, _, _ = stream(port, 8)
        results["hearth_streaming_again_s"] = time.time() - killed
        print("hearth kill", results["hearth_replacement_ready_s"], results["hearth_streaming_again_s"],
              flush=True)
    finally:
        stop(proc)
    subprocess.run(["cp", str(log), a.out])
    (pathlib.Path(a.out) / "generate.json").write_text(json.dumps(results, indent=1))

    # the baseline: 4 processes, each its own copy
    before = settled_used_mib()
    blog = tmp / "baseline.log"
    bproc = subprocess.Popen([sys.executable, "-m", "uvicorn", "generate_baseline_app:app", "--workers",
                              str(a.workers), "--port", "9137", "--app-dir", str(HERE)],
                             stdout=open(blog, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                             env=dict(env, HEARTH_BASELINE_CHECKPOINT=str(checkpoint)))
    try:
        deadline = time.time() + 600
        while blog.read_text().count("Application startup complete") < a.workers:
            if time.time() > deadline or bproc.poll() is not None:
                raise SystemExit("baseline did not start:\n" + blog.read_text()[-3000:])
            time.sleep(0.2)
        warm(9137, a.workers)
        results["baseline_device_mib"] = settled_used_mib() - before
        results["baseline"] = [load(9137, c, a.seconds) for c in (1, 4, 16)]
        print("baseline", results["baseline"], results["baseline_device_mib"], flush=True)
    finally:
        stop(bproc)
    (pathlib.Path(a.out) / "generate.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
