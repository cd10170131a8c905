"""One model on two GPUs against one GPU: load time, device memory per GPU, merged-batch throughput.

    python3 bench/serve/multigpu_bench.py --build build-gpu [--workers-per-gpu 4] [--seconds 8]
    python3 bench/serve/multigpu_bench.py --build build --smoke    # no GPU: host memory stands in

Serves the seed's MLP (16384 -> 16384 -> 12800, fp32; `hearth make-model mlp`) twice with
`hearth serve`: placed on GPU 0 alone (instance_group {count: W, gpus: [0]}), then on GPUs 0 and
1 ({count: W, gpus: [0, 1]}: W workers on each, one copy of the weights on each). For each it
measures:

  - load: the time the server took to load the weights into every GPU's store (its log line
    "weights loaded on ... in S s"; the GPUs' loads run at once, each from its own staging), at
    start-up (the loader pins its staging buffers then) and again through the repository API
    once the staging is pinned (the checkpoint's mtime moved on so that it is read again);
    goal: both GPUs within 1.2x of one;
  - device memory per GPU (nvidia-smi, settled, against before the server started), beside the
    one copy the server reports (hearth_shared_weights_bytes): one copy + the server's context +
    W worker contexts is what should be there;
  - merged-batch throughput: `hearth bench` with requests of 16 rows, max_batch_size 64 (the
    server merges up to 4 requests into one forward), 2 requests in flight per worker; batches
    of 16 per second, and how many batches each GPU's workers answered (/metrics);
    goal: two GPUs at least 1.9x one.

--smoke runs the same on a machine without GPUs: `--stand-in-gpus 2` makes host memory stand in
for the two GPUs (a store each), the MLP is small and the run short; it checks that the script
works and says so, and its numbers measure nothing about GPUs.

Prints one JSON line per configuration and a table; writes multigpu-bench.json (machine, date,
command, every measurement) into --out. It writes no figure it did not measure.
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from generate_bench import wait_port

SEED_DIMS = "16384,16384,12800"


def gpu_memory_used():
    """{GPU index: MiB used} from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    used = {}
    for line in out.splitlines():
        index, mib = (x.strip() for x in line.split(","))
        used[int(index)] = float(mib)
    return used


def settled_gpu_memory_used():
    """nvidia-smi's figures once no GPU's changes by 2 MiB in 100 ms (at most 10 s)."""
    last = gpu_memory_used()
    for _ in range(100):
        time.sleep(0.1)
        now = gpu_memory_used()
        if all(abs(now[i] - last.get(i, 0)) < 2 for i in now):
            return now
        last = now
    return last


def config(dims, workers, gpus):
    d_in, _, d_out = dims.split(",")
    return f"""backend: mlp
max_batch_size: 64
input:
  - {{name: input, data_type: TYPE_FP32, dims: [{d_in}]}}
output:
  - {{name: logits, data_type: TYPE_FP32, dims: [{d_out}]}}
  - {{name: argmax, data_type: TYPE_INT64, dims: [1]}}
instance_group:
  - {{count: {workers}, kind: KIND_GPU, gpus: [{", ".join(map(str, gpus))}]}}
dynamic_batching:
  max_queue_delay_microseconds: 0
  preferred_batch_size: [64]
"""


def metrics(url):
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def per_device(values, family, model="mlp"):
    """{device: value} of a per-placement family of /metrics."""
    out = {}
    for key, v in values.items():
        m = re.fullmatch(rf'{family}{{model="{model}",device="([^"]+)"}}', key)
        if m:
            out[m.group(1)] = v
    return out


class Server:
    def __init__(self, build, repo, log_path, extra):
        self.log_path = log_path
        log = open(log_path, "w")
        self.proc = subprocess.Popen([f"{build}/bin/hearth", "serve", "--model-repository", str(repo),
                                      "--http-port", "0", "--grpc-port", "-1", *extra],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            m = wait_port(log_path, r"ready on http://127\.0\.0\.1:(\d+)", self.proc, timeout=600)
        except SystemExit:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{m.group(1)}"

    def log(self):
        return pathlib.Path(self.log_path).read_text()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_config(a, repo, checkpoint, gpus, extra, log_path):
    """Serves `repo` (the mlp placed on `gpus`) and measures it; returns a dict."""
    before = None if a.smoke else settled_gpu_memory_used()
    server = Server(a.build, repo, log_path, extra)
    try:
        log = server.log()
        loaded = re.search(r"model mlp: weights loaded on (\S.*?) in ([0-9.]+) s", log)
        ready = re.search(r"model mlp: (\d+) of (\d+) workers ready ([0-9.]+) s", log)
        row = {"gpus": len(gpus), "workers_per_gpu": a.workers_per_gpu,
               "load_s": float(loaded.group(2)) if loaded else None,
               "loaded_on": loaded.group(1) if loaded else None,
               "ready_s": float(ready.group(3)) if ready and ready.group(1) == ready.group(2) else None}
        v = metrics(server.url)
        row["weights_bytes"] = per_device(v, "hearth_shared_weights_bytes")
        row["store_bytes"] = {re.search(r'device="([^"]+)"', k).group(1): val for k, val in v.items()
                              if k.startswith("hearth_store_arena_bytes{")}
        row["workers"] = per_device(v, "hearth_placement_workers")
        if before is not None:
            after = settled_gpu_memory_used()
            row["device_mib"] = {f"cuda:{i}": after[i] - before[i] for i in sorted(after)}
            buffers = {}
            for key, val in v.items():
                m = re.fullmatch(r'hearth_worker_device_memory_bytes\{model="mlp",worker="\d+",device="([^"]+)"\}', key)
                if m:
                    buffers[m.group(1)] = buffers.get(m.group(1), 0) + val
            row["worker_buffers_mib"] = {d: b / 2**20 for d, b in buffers.items()}
            # What is left per context once the copy and the workers' own buffers are taken
            # out: the server's context (its stores) and each worker's.
            row["mib_per_context"] = {
                d: (row["device_mib"][d] - row["weights_bytes"][d] / 2**20 - buffers.get(d, 0) / 2**20)
                / (a.workers_per_gpu + 1)
                for d in row["weights_bytes"] if d in row["device_mib"]}
        batches_before = per_device(v, "hearth_placement_batches")
        concurrency = 2 * a.workers_per_gpu * len(gpus)
        cmd = [f"{a.build}/bin/hearth", "bench", "--url", server.url, "--model", "mlp", "--batch", "16",
               "--concurrency", str(concurrency), "--seconds", str(a.seconds), "--warmup", str(a.warmup),
               "--output", "argmax", "--shared-memory", a.shared_memory, "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.seconds + a.warmup + 300)
        try:
            result = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            raise SystemExit(f"hearth bench failed: {r.stdout[-1000:]} {r.stderr[-2000:]}")
        row.update(concurrency=concurrency, batches_per_s=result["requests_per_s"],
                   rows_per_s=result["inferences_per_s"], errors=result["errors"],
                   p50_ms=result["latency_ms"]["p50"], p99_ms=result["latency_ms"]["p99"])
        after_v = metrics(server.url)
        row["batches_by_device"] = {d: n - batches_before.get(d, 0)
                                    for d, n in per_device(after_v, "hearth_placement_batches").items()}
        # Again, with the loader's pinned staging made already: the checkpoint's mtime moved on
        # (the server then takes it for changed files) and the model loaded again through the
        # repository API, its old version serving until the new one is up.
        st = os.stat(checkpoint)
        os.utime(checkpoint, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        request = urllib.request.Request(f"{server.url}/v2/repository/models/mlp/load", data=b"{}",
                                         method="POST", headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=900).read()
        again = re.findall(r"model mlp: weights loaded on \S.*? in ([0-9.]+) s", server.log())
        row["reload_s"] = float(again[1]) if len(again) > 1 else None
        return row
    finally:
        server.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build-gpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dims", default=None, help=f"the MLP's IN,HIDDEN,OUT (default {SEED_DIMS}; --smoke: 256,512,64)")
    ap.add_argument("--workers-per-gpu", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per run (default 8; --smoke: 2)")
    ap.add_argument("--warmup", type=float, default=None, help="unmeasured seconds first (default 2; --smoke: 0.5)")
    ap.add_argument("--shared-memory", default="system", choices=["none", "system"],
                    help="hearth bench's --shared-memory: system (default) keeps the 1 MiB inputs "
                         "out of the HTTP bodies, so that HTTP is not what the two GPUs wait for")
    ap.add_argument("--load-threads", type=int, default=0,
                    help="hearth serve --load-threads: reader threads of each device's load (0: automatic)")
    ap.add_argument("--smoke", action="store_true",
                    help="no GPU: host memory stands in for two GPUs (--stand-in-gpus 2)")
    a = ap.parse_args()
    a.dims = a.dims or ("256,512,64" if a.smoke else SEED_DIMS)
    a.seconds = a.seconds if a.seconds is not None else (2 if a.smoke else 8)
    a.warmup = a.warmup if a.warmup is not None else (0.5 if a.smoke else 2)
    if not a.smoke:
        visible = len(gpu_memory_used())
        if visible < 2:
            raise SystemExit(f"nvidia-smi lists {visible} GPU(s); this benchmark needs 2 (or --smoke)")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-multigpu-bench-"))
    try:
        run(a, tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the checkpoint: 1.9 GiB for the seed's MLP


def run(a, tmp, out):
    checkpoint = tmp / "mlp.safetensors"
    subprocess.run([f"{a.build}/bin/hearth", "make-model", "mlp", "--dims", a.dims, "--seed", "1",
                    "--out", str(checkpoint)], check=True, capture_output=True)
    extra = ["--stand-in-gpus", "2", "--device", "cuda:0"] if a.smoke else ["--device", "cuda:0"]
    extra += ["--load-threads", str(a.load_threads)]
    rows = []
    for gpus in ([0], [0, 1]):
        repo = tmp / f"repo-{len(gpus)}"
        (repo / "mlp" / "1").mkdir(parents=True)
        os.link(checkpoint, repo / "mlp" / "1" / "model.safetensors")
        (repo / "mlp" / "config.yaml").write_text(config(a.dims, a.workers_per_gpu, gpus))
        log_path = out / f"multigpu-serve-{len(gpus)}gpu.log"
        row = run_config(a, repo, repo / "mlp" / "1" / "model.safetensors", gpus, extra, log_path)
        print(json.dumps(row), flush=True)
        rows.append(row)

    one, two = rows
    def ratio(x, y):
        return x / y if x is not None and y else None
    load_ratio = ratio(two["load_s"], one["load_s"])
    throughput_ratio = ratio(two["batches_per_s"], one["batches_per_s"])
    fmt = lambda x, spec=".3f": "-" if x is None else format(x, spec)
    print()
    if a.smoke:
        print("SMOKE RUN: host memory standing in for the GPUs; these figures say nothing about GPUs.")
    print(f"MLP {a.dims} fp32, {a.workers_per_gpu} workers per GPU, hearth bench batch 16, "
          f"merged up to 64 rows, --shared-memory {a.shared_memory}, {a.seconds} s, "
          f"--load-threads {a.load_threads}")
    print("| measurement | 1 GPU | 2 GPUs | ratio | goal |")
    print("|---|---|---|---|---|")
    print(f"| weights loaded (s) | {fmt(one['load_s'])} | {fmt(two['load_s'])} | {fmt(load_ratio, '.2f')} | <= 1.2 |")
    print(f"| weights loaded again, staging pinned already (s) | {fmt(one['reload_s'])} | {fmt(two['reload_s'])} | "
          f"{fmt(ratio(two['reload_s'], one['reload_s']), '.2f')} | <= 1.2 |")
    print(f"| all workers ready (s) | {fmt(one['ready_s'])} | {fmt(two['ready_s'])} | | |")
    print(f"| batches of 16/s | {fmt(one['batches_per_s'], '.1f')} | {fmt(two['batches_per_s'], '.1f')} | "
          f"{fmt(throughput_ratio, '.2f')} | >= 1.9 |")
    print(f"| p50 / p99 ms | {fmt(one['p50_ms'], '.2f')} / {fmt(one['p99_ms'], '.2f')} | "
          f"{fmt(two['p50_ms'], '.2f')} / {fmt(two['p99_ms'], '.2f')} | | |")
    print(f"| batches answered per device | {one['batches_by_device']} | {two['batches_by_device']} | | |")
    print(f"| weights held per device (bytes, the stores' own count) | {one['store_bytes']} | {two['store_bytes']} | | |")
    if not a.smoke:
        print(f"| device memory used per GPU (MiB, nvidia-smi) | {one['device_mib']} | {two['device_mib']} | | |")
        print(f"| MiB per context (server's + each worker's) | "
              f"{ {d: round(x) for d, x in one['mib_per_context'].items()} } | "
              f"{ {d: round(x) for d, x in two['mib_per_context'].items()} } | | |")
    errors = one["errors"] + two["errors"]
    # Both placements must have served, and one copy per device.
    both_served = all(two["batches_by_device"].get(d, 0) > 0 for d in two["workers"])
    one_copy = all(two["store_bytes"].get(d) == two["weights_bytes"].get(d) for d in two["workers"])
    print(f"checks: errors {errors}, both GPUs served: {both_served}, one copy per GPU: {one_copy}")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.node(), "command": " ".join(shlex.quote(x) for x in sys.argv),
              "smoke": a.smoke, "dims": a.dims, "rows": rows, "load_ratio": load_ratio,
              "reload_ratio": ratio(two["reload_s"], one["reload_s"]),
              "throughput_ratio": throughput_ratio, "errors": errors, "both_served": both_served,
              "one_copy_per_gpu": one_copy}
    if not a.smoke:
        report["gpus"] = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
                                         "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    (out / "multigpu-bench.json").write_text(json.dumps(report, indent=1) + "\n")
    if errors or not both_served or not one_copy:
        sys.exit(1)


if __name__ == "__main__":
    main()
