"""backend: python on the GPU, beside the built-in mlp backend and the
torch.multiprocessing baseline, in one run.

    python3 bench/serve/python_backend_bench.py --build build-gpu --baseline .gpu/baselines/torch_ipc_workers.py

1. The seed's MLP (16384 -> 16384 -> 12800, fp32), 4 workers: as the built-in
   `mlp` backend and as examples/python_backend/mlp_model.py (plain PyTorch):
   device memory (all of it, and per worker beyond the one copy and the
   server's context) and batches of 16 per second through HTTP with binary
   tensor data (the argmax output, as the baseline returns).
2. The backend's own overhead per batch: an identity model.py (1 worker) and
   the built-in `scale` backend for comparison, one request per batch at
   concurrency 1: the server's time from handing the batch over to the
   answer (hearth_inference_worker_exchange_duration_us / batches), and the
   worker's own time (compute_infer).
3. The baseline (torch.multiprocessing, CUDA IPC) with 4 workers.
"""
import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from serve_bench import settled_used_mib  # noqa: E402

IDENTITY_PY = """
class Model:
    def initialize(self, args):
        pass

    def execute(self, inputs):
        return {"y": inputs["x"]}
"""


DEVICE = "cuda"


def serve(build, repo, log_path, models):
    log = open(log_path, "w")
    proc = subprocess.Popen([f"{build}/bin/hearth", "serve", "--model-repository", repo, "--http-port", "0",
                             "--device", DEVICE], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=dict(os.environ, HEARTH_PYTHON=sys.executable))
    t0 = time.time()
    while time.time() - t0 < 300:
        text = pathlib.Path(log_path).read_text()
        m = re.search(r"ready on http://127\.0\.0\.1:(\d+)", text)
        if m:
            ready = {}
            for name in models:
                r = re.search(rf"model {name}: (\d+) of (\d+) workers ready ([0-9.]+) s", text)
                ready[name] = float(r.group(3)) if r and r.group(1) == r.group(2) else float("nan")
            return proc, int(m.group(1)), ready
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("serve did not start:\n" + pathlib.Path(log_path).read_text()[-3000:])


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def bench(build, port, model, batch, concurrency, seconds, output):
    r = subprocess.run([f"{build}/bin/hearth", "bench", "--url", f"http://127.0.0.1:{port}", "--model", model,
                        "--output", output, "--batch", str(batch), "--concurrency", str(concurrency),
                        "--seconds", str(seconds), "--json"], capture_output=True, text=True)
    print(r.stdout.strip()[-600:], r.stderr.strip()[-300:], flush=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def metrics(port):
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'(\w+)\{model="(\w+)"\} ([0-9.e+]+)$', line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def gpu_processes():
    if DEVICE == "cpu":
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return {int(p): float(m) for p, m in (l.split(",") for l in out.strip().splitlines() if l.strip())}


def write_config(path, backend, workers, inputs, outputs, max_batch=16, extra=""):
    kind = "KIND_GPU, gpus: [0]" if DEVICE == "cuda" else "KIND_CPU"
    path.write_text(f"""backend: {backend}
max_batch_size: {max_batch}
input:
{inputs}
output:
{outputs}
instance_group:
  - {{count: {workers}, kind: {kind}}}
""" + extra)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-gpu")
    ap.add_argument("--baseline", default=".gpu/baselines/torch_ipc_workers.py")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--dims", default="16384,16384,12800", help="the MLP's in,hidden,out")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to try the script without a GPU")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    used = settled_used_mib if DEVICE == "cuda" else (lambda: 0.0)
    kind = "KIND_GPU" if DEVICE == "cuda" else "KIND_CPU"
    dims = [int(d) for d in a.dims.split(",")]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-pybackend-bench-"))
    cli = f"{a.build}/bin/hearth"
    weights = tmp / "mlp.safetensors"
    subprocess.run([cli, "make-model", "mlp", "--dims", a.dims, "--seed", "1", "--out", str(weights)],
                   check=True, capture_output=True)
    arena_mib = os.path.getsize(weights) / 2**20
    mlp_io = (f"  - {{name: input, data_type: TYPE_FP32, dims: [{dims[0]}]}}",
              f"  - {{name: logits, data_type: TYPE_FP32, dims: [{dims[2]}]}}\n"
              "  - {name: argmax, data_type: TYPE_INT64, dims: [1]}")
    results = {}
    for name, backend in (("mlp", "mlp"), ("pymlp", "python")):
        repo = tmp / f"repo-{name}"
        (repo / name / "1").mkdir(parents=True)
        os.link(weights, repo / name / "1" / "model.safetensors")
        if backend == "python":
            (repo / name / "1" / "model.py").write_text(
                (ROOT / "examples" / "python_backend" / "mlp_model.py").read_text())
        write_config(repo / name / "config.yaml", backend, a.workers, *mlp_io)
        before = used()
        proc, port, ready = serve(a.build, str(repo), tmp / f"serve-{name}.log", [name])
        try:
            after = used()
            per_process = gpu_processes()
            load = bench(a.build, port, name, 16, 2 * a.workers, a.seconds, "argmax")
            m = metrics(port)
        finally:
            stop(proc)
        # The serve process holds the store: one context (524 MiB bare) plus the arena.
        results[name] = {
            "ready_s": ready[name], "device_mib": after - before,
            "per_worker_mib": (after - before - arena_mib - 524) / a.workers,
            "batches_per_s": load["requests_per_s"], "p50_ms": load["latency_ms"]["p50"],
            "p99_ms": load["latency_ms"]["p99"],
            "mean_batch_rows": m.get(("hearth_inference_count", name), 0) /
            max(1, m.get(("hearth_inference_exec_count", name), 1)),
            "gpu_processes_mib": sorted(per_process.values()),
        }
        print(name, results[name], flush=True)
        subprocess.run(["cp", str(tmp / f"serve-{name}.log"), a.out])

    # The backend's own overhead: identity (python) and scale (built in), 1 worker each.
    repo = tmp / "repo-overhead"
    (repo / "identity" / "1").mkdir(parents=True)
    (repo / "scale" / "1").mkdir(parents=True)
    for model in ("identity", "scale"):
        subprocess.run([cli, "make-model", "scale", "--dims", "16", "--seed", "2",
                        "--out", str(repo / model / "1" / "model.safetensors")], check=True, capture_output=True)
    (repo / "identity" / "1" / "model.py").write_text(IDENTITY_PY)
    write_config(repo / "identity" / "config.yaml", "python", 1,
                 "  - {name: x, data_type: TYPE_FP32, dims: [16]}", "  - {name: y, data_type: TYPE_FP32, dims: [16]}")
    write_config(repo / "scale" / "config.yaml", "scale", 1,
                 "  - {name: x, data_type: TYPE_FP32, dims: [16]}", "  - {name: y, data_type: TYPE_FP32, dims: [1]}")
    proc, port, _ = serve(a.build, str(repo), tmp / "serve-overhead.log", ["identity", "scale"])
    try:
        for model in ("identity", "scale"):
            load = bench(a.build, port, model, 1, 1, a.seconds, "y")
            m = metrics(port)
            n = m.get(("hearth_inference_exec_count", model), 0)
            results[model] = {
                "requests_per_s": load["requests_per_s"], "client_p50_ms": load["latency_ms"]["p50"],
                "exchange_us_per_batch": m[("hearth_inference_worker_exchange_duration_us", model)] / n,
                "worker_us_per_batch": m[("hearth_inference_compute_infer_duration_us", model)] / n,
                "batches": n,
            }
            print(model, results[model], flush=True)
    finally:
        stop(proc)
    subprocess.run(["cp", str(tmp / "serve-overhead.log"), a.out])

    line = []
    if DEVICE == "cuda":
        r = subprocess.run([sys.executable, a.baseline, "--workers", str(a.workers), "--batches", "512"],
                           capture_output=True, text=True, timeout=600)
        line = [l for l in r.stdout.splitlines() if "workers=" in l]
    print("baseline", line[-1] if line else "not run", flush=True)
    base = dict(re.findall(r"(\w+)=([0-9.]+)", line[-1])) if line else {}
    results["baseline"] = base
    (pathlib.Path(a.out) / "python-backend.json").write_text(json.dumps(results, indent=1))

    bb = float(base.get("batches_per_s", "nan"))
    print()
    print(f"| {a.workers} workers, seed MLP | ready s | device MiB | MiB/worker | batches/s (16 rows) | vs baseline | p50/p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for name in ("mlp", "pymlp"):
        r = results[name]
        print(f"| {name} | {r['ready_s']:.2f} | {r['device_mib']:.0f} | {r['per_worker_mib']:.0f} | "
              f"{r['batches_per_s']:.0f} | {r['batches_per_s'] / bb:.2f} | {r['p50_ms']:.2f}/{r['p99_ms']:.2f} |")
    print(f"| baseline | {base.get('workers_ready_s', '?')} | ? | {base.get('per_worker_mb', '?')} | {bb:.0f} | 1.00 | |")
    print()
    print("| overhead, 1 request per batch | exchange µs/batch (server) | worker µs/batch | client p50 ms |")
    print("|---|---|---|---|")
    for name in ("identity", "scale"):
        r = results[name]
        print(f"| {name} | {r['exchange_us_per_batch']:.1f} | {r['worker_us_per_batch']:.1f} | {r['client_p50_ms']:.3f} |")


if __name__ == "__main__":
    main()
