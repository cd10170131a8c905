"""The protocol's cost: `hearth bench` against `hearth serve` over REST and
gRPC, each with the tensors in the request body and in system shared memory.

    python3 bench/serve/protocol_bench.py --build build --device cpu --seconds 5

Models (made with `hearth make-model`, random weights):
- scale: 500 FP32 in, 1 out (dynamic batching up to 64, no queue delay): the
  protocol and the scheduler, almost no compute;
- mlp: 1024 -> 4096 -> 1024 FP32 (batch 1 requests, up to 64 merged): 4 KiB in, 4 KiB out per request
  plus real compute.
For each model, transport (rest; grpc where this hearth has it) and shared
memory (none, system; with --device cuda[:N] also cuda: the bench's regions in
device memory of GPU N, registered by their CUDA IPC handles, so inputs and
outputs go device to device), concurrency 1, 8 and 64: requests/s, p50 and p99
(ms), errors; and, from the model's statistics (/v2/models/M/stats) before and
after each run, the mean batch (requests per execution) and the server's time
per execution (compute_input + compute_infer + compute_output) and per
request in the queue. One JSON line per run, a table at the end. gRPC runs are
skipped, saying why, when the server was built without gRPC.
"""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from generate_bench import stop, wait_port  # noqa: E402

MODELS = {
    "scale": ("scale", "500", """backend: scale
max_batch_size: 64
input:
  - {{name: x, data_type: TYPE_FP32, dims: [500]}}
output:
  - {{name: y, data_type: TYPE_FP32, dims: [1]}}
instance_group:
  - {{count: {workers}, kind: {kind}}}
dynamic_batching:
  max_queue_delay_microseconds: 0
""", "y"),
    "mlp": ("mlp", "1024,4096,1024", """backend: mlp
max_batch_size: 64
input:
  - {{name: input, data_type: TYPE_FP32, dims: [1024]}}
output:
  - {{name: logits, data_type: TYPE_FP32, dims: [1024]}}
  - {{name: argmax, data_type: TYPE_INT64, dims: [1]}}
instance_group:
  - {{count: {workers}, kind: {kind}}}
dynamic_batching:
  max_queue_delay_microseconds: 0
""", "logits"),
}


def model_stats(http, name):
    """The counters of `name`'s statistics that the table reads."""
    with urllib.request.urlopen(f"{http}/v2/models/{name}/stats", timeout=30) as r:
        stats = json.loads(r.read())["model_stats"][0]
    out = {"requests": stats["inference_count"], "executions": stats["execution_count"]}
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        out[key] = stats["inference_stats"][key]["ns"]
    return out


def server_side(before, after):
    """Mean batch, µs per execution in the worker's exchange, µs per request queued."""
    d = {k: after[k] - before[k] for k in after}
    if d["executions"] <= 0 or d["requests"] <= 0:
        return {}
    busy = d["compute_input"] + d["compute_infer"] + d["compute_output"]
    return {"batch_mean": round(d["requests"] / d["executions"], 2),
            "us_per_execution": round(busy / d["executions"] / 1e3, 1),
            "queue_us_per_request": round(d["queue"] / d["requests"] / 1e3, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--models", default="scale,mlp")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    cli = f"{a.build}/bin/hearth"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-protocol-bench-"))
    repo = tmp / "repo"
    on_gpu = a.device.startswith("cuda")
    kind = "KIND_GPU" if on_gpu else "KIND_CPU"
    # The GPU the server's workers use holds the bench's CUDA regions too.
    gpu = a.device.split(":", 1)[1] if ":" in a.device else "0"
    shared_memory = ["none", "system"] + (["cuda"] if on_gpu else [])
    models = a.models.split(",")
    for name in models:
        make, dims, config, _ = MODELS[name]
        (repo / name / "1").mkdir(parents=True)
        subprocess.run([cli, "make-model", make, "--dims", dims, "--seed", "1", "--out",
                        str(repo / name / "1" / "model.safetensors")], check=True, capture_output=True)
        (repo / name / "config.yaml").write_text(config.format(workers=a.workers, kind=kind))
    log = tmp / "serve.log"
    proc = subprocess.Popen([cli, "serve", "--model-repository", str(repo), "--http-port", "0", "--device",
                             a.device], stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    results = []
    try:
        http = int(wait_port(log, r"ready on http://127\.0\.0\.1:(\d+)", proc, timeout=120).group(1))
        text = log.read_text()
        grpc = re.search(r"KServe v2 gRPC on [^:]+:(\d+)", text)
        transports = [("rest", f"http://127.0.0.1:{http}")]
        if grpc:
            transports.append(("grpc", f"127.0.0.1:{grpc.group(1)}"))
        else:
            print("grpc: skipped: this hearth serve has no gRPC front-end (built without grpc++)", flush=True)
        for name in models:
            output = MODELS[name][3]
            for transport, url in transports:
                for shm in shared_memory:
                    device = ["--shared-memory-device", gpu] if shm == "cuda" else []
                    for c in [int(x) for x in a.concurrency.split(",")]:
                        before = model_stats(transports[0][1], name)
                        r = subprocess.run([cli, "bench", "--url", url, "--model", name, "--transport", transport,
                                            "--shared-memory", shm, *device, "--output", output,
                                            "--concurrency", str(c), "--seconds", str(a.seconds), "--warmup", "1",
                                            "--json"],
                                           capture_output=True, text=True)
                        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "{}"
                        try:
                            got = json.loads(line)
                        except json.JSONDecodeError:
                            got = {}
                        row = {"model": name, "transport": transport, "shared_memory": shm, "concurrency": c,
                               "requests_per_s": got.get("requests_per_s"),
                               "p50_ms": got.get("latency_ms", {}).get("p50"),
                               "p99_ms": got.get("latency_ms", {}).get("p99"),
                               "errors": got.get("errors"), "exit": r.returncode,
                               **server_side(before, model_stats(transports[0][1], name))}
                        if r.returncode != 0:
                            row["stderr"] = r.stderr.strip()[-300:]
                        print(json.dumps(row), flush=True)
                        results.append(row)
    finally:
        stop(proc)
    (pathlib.Path(a.out) / f"protocol-{a.device.split(':')[0]}.json").write_text(json.dumps(results, indent=1))
    print(f"{'model':6} {'transport':9} {'shm':6} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'batch':>6} {'us/exec':>8} {'queue us':>8} errors")
    for r in results:
        fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"  # noqa: E731
        print(f"{r['model']:6} {r['transport']:9} {r['shared_memory']:6} {r['concurrency']:>4} "
              f"{fmt(r['requests_per_s'], '9.0f')} {fmt(r['p50_ms'], '8.3f')} {fmt(r['p99_ms'], '8.3f')} "
              f"{fmt(r.get('batch_mean'), '6.1f')} {fmt(r.get('us_per_execution'), '8.1f')} "
              f"{fmt(r.get('queue_us_per_request'), '8.1f')} {r['errors']}")


if __name__ == "__main__":
    sys.exit(main())
