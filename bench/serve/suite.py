"""The throughput and resilience suite on the GPU, beside the torch.multiprocessing baseline.

    python3 bench/serve/suite.py --build build-gpu --baseline .gpu/baselines/torch_ipc_workers.py [--seconds 5]

Serves the seed's MLP (16384 -> 16384 -> 12800) and the scale model (N=500) with hearth serve and
drives them with `hearth bench` (binary tensor data, the argmax output as the baseline returns):

  1. batches of 16 per second, 4 workers: max_batch_size 16 (each request runs alone), 64 and
     128 (the server merges up to 4 or 8 requests into one forward); bf16 weights too;
  2. single-sample requests from 64 concurrent clients, dynamically batched up to 64;
  3. device memory with 24 workers;
  4. time from a worker's SIGKILL to its replacement answering (1 worker: the request sent right
     after the kill waits for the replacement);
  5. the scale model, on GPU workers and on CPU workers, at concurrency 1, 16 and 64: requests/s,
     client p50/p99, and the mean time inside the server and by stage (from /metrics).

Then runs the baseline with 4 and 24 workers. Prints one JSON line per measurement and a table.
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
import urllib.request

from generate_bench import wait_port
from serve_bench import settled_used_mib

SEED_DIMS = "16384,16384,12800"
SCALE_CONFIG = """backend: scale
max_batch_size: 64
input:
  - {{name: x, data_type: TYPE_FP32, dims: [500]}}
output:
  - {{name: y, data_type: TYPE_FP32, dims: [1]}}
instance_group:
  - {{count: 1, kind: {kind}}}
dynamic_batching:
  max_queue_delay_microseconds: 0
"""
# Where a request's time inside the server goes (/metrics counters, microseconds).
DURATIONS = ["request", "queue", "compute_input", "compute_infer", "compute_output"]


def mlp_config(max_batch, dims_in=16384, dims_out=12800, queue_delay_us=0):
    batching = ""
    if max_batch > 16:
        batching = f"""dynamic_batching:
  max_queue_delay_microseconds: {queue_delay_us}
  preferred_batch_size: [{max_batch}]
"""
    return f"""backend: mlp
max_batch_size: {max_batch}
input:
  - {{name: input, data_type: TYPE_FP32, dims: [{dims_in}]}}
output:
  - {{name: logits, data_type: TYPE_FP32, dims: [{dims_out}]}}
  - {{name: argmax, data_type: TYPE_INT64, dims: [1]}}
instance_group:
  - {{count: 1, kind: KIND_GPU, gpus: [0]}}
""" + batching


def make_repo(build, root, models):
    """models: name -> (kind, dims, dtype, config text)."""
    for name, (kind, dims, dtype, config) in models.items():
        (root / name / "1").mkdir(parents=True)
        cmd = [f"{build}/bin/hearth", "make-model", kind, "--dims", dims, "--seed", "1",
               "--out", str(root / name / "1" / "model.safetensors")]
        if dtype:
            cmd += ["--dtype", dtype]
        subprocess.run(cmd, check=True, capture_output=True)
        (root / name / "config.yaml").write_text(config)


class Server:
    def __init__(self, build, repo, workers, log_path):
        self.log_path = log_path
        log = open(log_path, "w")
        self.proc = subprocess.Popen([f"{build}/bin/hearth", "serve", "--model-repository", str(repo),
                                      "--http-port", "0", "--device", "cuda", "--workers", str(workers)],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            m = wait_port(log_path, r"ready on http://127\.0\.0\.1:(\d+)", self.proc, timeout=300)
        except SystemExit:
            self.proc.kill()
            raise
        self.url = f"http://127.0.0.1:{m.group(1)}"

    def ready_seconds(self, model):
        m = re.search(rf"model {model}: (\d+) of (\d+) workers ready ([0-9.]+) s", pathlib.Path(self.log_path).read_text())
        return float(m.group(3)) if m and m.group(1) == m.group(2) else float("nan")

    def workers(self):
        """Worker pids: the serve process's hearth-worker children."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "hearth-worker"], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def metric(self, name, model):
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=30).read().decode()
        m = re.search(rf'^{name}{{model="{model}"}} ([0-9.e+]+)$', text, re.M)
        return float(m.group(1)) if m else float("nan")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def bench(build, url, model, batch, concurrency, seconds, output="argmax"):
    cmd = [f"{build}/bin/hearth", "bench", "--url", url, "--model", model, "--batch", str(batch),
           "--concurrency", str(concurrency), "--seconds", str(seconds), "--warmup", "2", "--json"]
    if output:
        cmd += ["--output", output]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"hearth bench failed: {r.stdout[-1000:]} {r.stderr[-2000:]}")


def infer_once(url, model, n):
    """One binary request of one zero sample; returns the HTTP status."""
    header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, n],
                                     "parameters": {"binary_data_size": 4 * n}}],
                         "outputs": [{"name": "argmax", "parameters": {"binary_data": True}}]}).encode()
    body = header + bytes(4 * n)
    req = urllib.request.Request(f"{url}/v2/models/{model}/infer", data=body, method="POST",
                                 headers={"Inference-Header-Content-Length": str(len(header)),
                                          "Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
        return r.status


def emit(record, results):
    results.append(record)
    print(json.dumps(record), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-gpu")
    ap.add_argument("--baseline", default=".gpu/baselines/torch_ipc_workers.py")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--kills", type=int, default=5)
    a = ap.parse_args()
    results = []
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-suite-"))

    # 1, 2, 5: four workers per model.
    repo = tmp / "repo"
    make_repo(a.build, repo, {
        "mlp": ("mlp", SEED_DIMS, None, mlp_config(16)),
        "mlp_b64": ("mlp", SEED_DIMS, None, mlp_config(64)),
        "mlp_bf16": ("mlp", SEED_DIMS, "bf16", mlp_config(16)),
        "mlp_bf16_b64": ("mlp", SEED_DIMS, "bf16", mlp_config(64)),
        "mlp_b128": ("mlp", SEED_DIMS, None, mlp_config(128)),
        "scale": ("scale", "500", None, SCALE_CONFIG.format(kind="KIND_GPU")),
        "scale_cpu": ("scale", "500", None, SCALE_CONFIG.format(kind="KIND_CPU")),
    })
    server = Server(a.build, repo, 4, tmp / "serve-4.log")
    for model, batch, conc, label in [("mlp", 16, 8, "batch16_fp32_max16"),
                                      ("mlp_b64", 16, 32, "batch16_fp32_max64"),
                                      ("mlp_b128", 16, 64, "batch16_fp32_max128"),
                                      ("mlp_bf16", 16, 8, "batch16_bf16_max16"),
                                      ("mlp_bf16_b64", 16, 32, "batch16_bf16_max64"),
                                      ("mlp_b64", 1, 64, "single_fp32_64clients"),
                                      ("mlp_bf16_b64", 1, 64, "single_bf16_64clients")]:
        before = {d: server.metric(f"hearth_inference_{d}_duration_us", model) for d in DURATIONS}
        before_n = server.metric("hearth_inference_request_success", model)
        before_batches = server.metric("hearth_inference_exec_count", model)
        before_rows = server.metric("hearth_inference_count", model)
        r = bench(a.build, server.url, model, batch, conc, a.seconds)
        after = {d: server.metric(f"hearth_inference_{d}_duration_us", model) for d in DURATIONS}
        n = max(server.metric("hearth_inference_request_success", model) - before_n, 1)
        batches = server.metric("hearth_inference_exec_count", model) - before_batches
        rows = server.metric("hearth_inference_count", model) - before_rows
        emit({"test": label, "workers": 4, "model": model, "batch": batch, "concurrency": conc,
              "requests_per_s": r["requests_per_s"], "inferences_per_s": r["inferences_per_s"],
              "p50_ms": r["latency_ms"]["p50"], "p99_ms": r["latency_ms"]["p99"], "errors": r["errors"],
              "mean_forward_rows": rows / batches if batches else None,
              "server_mean_us": (after["request"] - before["request"]) / n,
              "server_mean_us_by_stage": {d: round((after[d] - before[d]) / n, 1) for d in DURATIONS[1:]}},
             results)
    for model in ("scale", "scale_cpu"):
        for conc in (1, 16, 64):
            before = {d: server.metric(f"hearth_inference_{d}_duration_us", model) for d in DURATIONS}
            before_n = server.metric("hearth_inference_request_success", model)
            r = bench(a.build, server.url, model, 1, conc, a.seconds, output=None)
            after = {d: server.metric(f"hearth_inference_{d}_duration_us", model) for d in DURATIONS}
            n = max(server.metric("hearth_inference_request_success", model) - before_n, 1)
            emit({"test": f"{model}_c{conc}", "workers": 4, "requests_per_s": r["requests_per_s"],
                  "p50_ms": r["latency_ms"]["p50"], "p99_ms": r["latency_ms"]["p99"], "errors": r["errors"],
                  "server_mean_us": (after["request"] - before["request"]) / n,
                  "server_mean_us_by_stage": {d: round((after[d] - before[d]) / n, 1) for d in DURATIONS[1:]}},
                 results)
    server.stop()
    subprocess.run(["cp", str(tmp / "serve-4.log"), a.out])

    # 3 and 4: the seed's MLP alone.
    repo1 = tmp / "repo1"
    make_repo(a.build, repo1, {"mlp": ("mlp", SEED_DIMS, None, mlp_config(16))})
    before = settled_used_mib()
    server = Server(a.build, repo1, 24, tmp / "serve-24.log")
    after = settled_used_mib()
    emit({"test": "memory_24_workers", "device_mib": after - before, "ready_s": server.ready_seconds("mlp")}, results)
    server.stop()

    server = Server(a.build, repo1, 1, tmp / "serve-1.log")
    infer_once(server.url, "mlp", 16384)
    times = []
    for _ in range(a.kills):
        pids = server.workers()
        if len(pids) != 1:
            raise SystemExit(f"expected one worker, found {pids}")
        t = time.perf_counter()
        os.kill(pids[0], signal.SIGKILL)
        status = infer_once(server.url, "mlp", 16384)
        times.append(time.perf_counter() - t)
        if status != 200:
            raise SystemExit(f"request after the kill answered {status}")
        time.sleep(0.5)
    times.sort()
    emit({"test": "kill_to_serving", "workers": 1, "kills": len(times), "median_s": times[len(times) // 2],
          "max_s": times[-1], "all_s": [round(x, 3) for x in times]}, results)
    server.stop()
    subprocess.run(["cp", str(tmp / "serve-1.log"), a.out])

    # The baseline.
    base = {}
    for workers in (1, 4, 24):
        r = subprocess.run([sys.executable, a.baseline, "--workers", str(workers), "--batches", "512"],
                           capture_output=True, text=True, timeout=600)
        line = [l for l in r.stdout.splitlines() if "workers=" in l]
        kv = {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", line[-1])} if line else {}
        base[workers] = kv
        emit({"test": "baseline", "workers": workers, **kv} if kv else
             {"test": "baseline", "workers": workers, "error": r.stderr[-1500:]}, results)

    by = {r["test"]: r for r in results}
    b4 = base.get(4, {}).get("batches_per_s", float("nan"))
    # Everything on the device in both cases: hearth's store (context + arena) and workers, the
    # baseline's owner process (context + model) and workers.
    b24 = base.get(24, {}).get("device_mb_with_workers", float("nan"))
    print()
    print("| measurement | hearth | baseline | ratio |")
    print("|---|---|---|---|")
    for label in ("batch16_fp32_max16", "batch16_fp32_max64", "batch16_fp32_max128", "batch16_bf16_max16",
                  "batch16_bf16_max64"):
        r = by.get(label, {})
        print(f"| {label}: batches of 16/s, 4 workers (mean rows per forward {r.get('mean_forward_rows', 0):.1f}) | "
              f"{r.get('requests_per_s', 0):.0f} | {b4:.0f} (fp32) | {r.get('requests_per_s', 0) / b4:.2f} |")
    for label in ("single_fp32_64clients", "single_bf16_64clients"):
        r = by.get(label, {})
        print(f"| {label}: samples/s (mean rows per forward {r.get('mean_forward_rows', 0):.1f}) | "
              f"{r.get('inferences_per_s', 0):.0f} | {16 * b4:.0f} (fp32, in batches of 16) | "
              f"{r.get('inferences_per_s', 0) / (16 * b4):.2f} |")
    m = by.get("memory_24_workers", {})
    print(f"| device MiB with 24 workers (all processes) | {m.get('device_mib', 0):.0f} | {b24:.0f} | "
          f"{m.get('device_mib', 0) / b24:.2f} |")
    print(f"| 24 workers ready, s | {m.get('ready_s', 0):.2f} | {base.get(24, {}).get('workers_ready_s', 0):.2f} | "
          f"{m.get('ready_s', 0) / max(base.get(24, {}).get('workers_ready_s', 1), 1e-9):.2f} |")
    k = by.get("kill_to_serving", {})
    b1 = base.get(1, {}).get("workers_ready_s", float("nan"))
    print(f"| SIGKILL to replacement answering, s (median/max of {k.get('kills')}) | "
          f"{k.get('median_s', 0):.3f}/{k.get('max_s', 0):.3f} | {b1:.2f} (a spawned torch worker ready) | "
          f"{k.get('median_s', 0) / b1:.3f} |")
    for model in ("scale", "scale_cpu"):
        for conc in (1, 16, 64):
            r = by.get(f"{model}_c{conc}", {})
            print(f"| {model} N=500, concurrency {conc}: req/s, p50/p99 ms, mean in-server us | "
                  f"{r.get('requests_per_s', 0):.0f}, {r.get('p50_ms', 0):.3f}/{r.get('p99_ms', 0):.3f}, "
                  f"{r.get('server_mean_us', 0):.0f} {r.get('server_mean_us_by_stage', '')} | - | - |")


if __name__ == "__main__":
    main()
