"""hearth serve on the GPU next to the torch.multiprocessing baseline.

    python3 bench/serve/serve_bench.py --build build-gpu --baseline .gpu/baselines/torch_ipc_workers.py

Serves the seed's MLP (16384 -> 16384 -> 12800, fp32) with 1, 4, 8 and 24
workers and measures: time until the workers are ready, device memory per
worker, and batches of 16 per second through HTTP with binary tensor data
(the argmax output, as the baseline returns). Then runs the baseline with
the same worker counts. Prints a table.
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


def used_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return float(out.split()[0])


def settled_used_mib():
    last = used_mib()
    for _ in range(100):
        time.sleep(0.1)
        now = used_mib()
        if abs(now - last) < 2:
            return now
        last = now
    return last


def serve(build, repo, workers, log_path):
    log = open(log_path, "w")
    proc = subprocess.Popen([f"{build}/bin/hearth", "serve", "--model-repository", repo, "--http-port", "0",
                             "--device", "cuda", "--workers", str(workers)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    t0 = time.time()
    while time.time() - t0 < 300:
        text = pathlib.Path(log_path).read_text()
        m = re.search(r"ready on http://127\.0\.0\.1:(\d+)", text)
        if m:
            # "model mlp: R of N workers ready T s after start-up began": T counts when all N are.
            ready = re.search(r"model mlp: (\d+) of (\d+) workers ready ([0-9.]+) s", text)
            ok = ready and ready.group(1) == ready.group(2)
            return proc, int(m.group(1)), float(ready.group(3)) if ok else float("nan")
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("serve did not start:\n" + pathlib.Path(log_path).read_text()[-3000:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-gpu")
    ap.add_argument("--baseline", default=".gpu/baselines/torch_ipc_workers.py")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seconds", type=float, default=8)
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-serve-bench-"))
    repo = tmp / "repo"
    (repo / "mlp" / "1").mkdir(parents=True)
    subprocess.run([f"{a.build}/bin/hearth", "make-model", "mlp", "--dims", "16384,16384,12800", "--seed", "1",
                    "--out", str(repo / "mlp" / "1" / "model.safetensors")], check=True)
    (repo / "mlp" / "config.yaml").write_text("""backend: mlp
max_batch_size: 16
input:
  - {name: input, data_type: TYPE_FP32, dims: [16384]}
output:
  - {name: logits, data_type: TYPE_FP32, dims: [12800]}
  - {name: argmax, data_type: TYPE_INT64, dims: [1]}
instance_group:
  - {count: 1, kind: KIND_GPU, gpus: [0]}
""")
    rows = []
    for workers in (1, 4, 8, 24):
        before = settled_used_mib()
        proc, port, ready_s = serve(a.build, str(repo), workers, tmp / f"serve-{workers}.log")
        after = settled_used_mib()
        arena_mib = 1.0 * os.path.getsize(repo / "mlp" / "1" / "model.safetensors") / 2**20
        # The serve process holds the store: one context (524 MiB bare) plus the arena.
        per_worker = (after - before - arena_mib - 524) / workers
        row = {"workers": workers, "ready_s": ready_s, "device_mib": after - before, "per_worker_mib": per_worker}
        if workers in (1, 4, 8):
            load = subprocess.run([f"{a.build}/bin/hearth", "bench", "--url", f"http://127.0.0.1:{port}",
                                   "--model", "mlp", "--output", "argmax", "--batch", "16",
                                   "--concurrency", str(2 * workers), "--seconds", str(a.seconds), "--json"],
                                  capture_output=True, text=True)
            print(load.stdout.strip(), load.stderr.strip()[-500:], flush=True)
            try:
                r = json.loads(load.stdout.strip().splitlines()[-1])
                row.update(batches_per_s=r["requests_per_s"], p50_ms=r["latency_ms"]["p50"],
                           p99_ms=r["latency_ms"]["p99"])
            except (IndexError, ValueError, KeyError):
                pass
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        print("hearth", row, flush=True)
        rows.append(row)
        subprocess.run(["cp", str(tmp / f"serve-{workers}.log"), a.out])

    base = []
    for workers in (1, 4, 8, 24):
        r = subprocess.run([sys.executable, a.baseline, "--workers", str(workers), "--batches", "512"],
                           capture_output=True, text=True, timeout=600)
        line = [l for l in r.stdout.splitlines() if "workers=" in l]
        print("baseline", line[-1] if line else r.stderr[-2000:], flush=True)
        kv = dict(re.findall(r"(\w+)=([0-9.]+)", line[-1])) if line else {}
        base.append(kv)

    print()
    print("| workers | hearth ready s | baseline ready s | hearth MiB/worker | baseline MiB/worker | hearth batches/s | baseline batches/s | ratio | hearth p50/p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row, b in zip(rows, base):
        hb = row.get("batches_per_s")
        bb = float(b.get("batches_per_s", "nan"))
        print(f"| {row['workers']} | {row['ready_s']:.3f} | {b.get('workers_ready_s', '?')} | {row['per_worker_mib']:.0f} | "
              f"{b.get('per_worker_mb', '?')} | {hb if hb is not None else '-'} | {bb if hb is not None else '-'} | "
              f"{(hb / bb) if hb and bb == bb else '-'} | "
              f"{row.get('p50_ms', '-')}/{row.get('p99_ms', '-')} |")


if __name__ == "__main__":
    main()
