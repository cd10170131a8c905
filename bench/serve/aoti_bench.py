"""backend: aoti on the GPU: seed 004's AOTI mode rebuilt without Python in
the workers, beside the built-in mlp backend, in one run.

    python3 bench/serve/aoti_bench.py --build build-gpu

The seed's MLP (16384 -> 16384 -> 12800, fp32) exported by `python3 -m
hearth.aoti export` with a dynamic batch of 1..64:
- 4 aoti workers: batches of 16 per second over HTTP (binary data, the
  argmax output), against the built-in mlp backend with 4 workers;
- 24 aoti workers: device memory against one copy plus the server's context
  plus 24 workers, and per worker;
- the time from SIGKILL of an idle aoti worker to its replacement being
  ready (the package loaded again), from the server's log;
- the torch.multiprocessing baseline (seed 004's pytorch mode) with 4 workers;
- torchvision's resnet50, fp32 and bf16, exported the same way: batches of
  16 images per second through 1 aoti worker against PyTorch eager in one
  process (no HTTP), and the largest difference of their logits.
"""
import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from python_backend_bench import bench, gpu_processes, serve, stop  # noqa: E402
from serve_bench import settled_used_mib  # noqa: E402

MODEL = '''
import torch


class SharedWeightInferenceEngine(torch.nn.Module):
    def __init__(self, in_features=16384, hidden_dim=16384, out_features=12800):
        super().__init__()
        self.encoder = torch.nn.Linear(in_features, hidden_dim)
        self.head = torch.nn.Linear(hidden_dim, out_features)

    def forward(self, x):
        logits = self.head(torch.relu(self.encoder(x)))
        return logits, torch.argmax(logits, dim=-1, keepdim=True)


def build():
    torch.manual_seed(1)
    return SharedWeightInferenceEngine()
'''


def bare_context_mib():
    """What one process costs the device once libtorch has made its CUDA
    context and one small tensor: the least an aoti worker can cost."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, torch; torch.zeros(1, device='cuda'); "
                             "torch.cuda.synchronize(); print('ok', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
        time.sleep(0.5)
        return gpu_processes().get(proc.pid, float("nan"))
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def split_processes(arena_mib):
    """nvidia-smi's processes: the store's (the one that holds the arena) and
    the workers'."""
    procs = sorted(gpu_processes().values())
    store = procs[-1] if procs and procs[-1] >= arena_mib else float("nan")
    return store, procs[:-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-gpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--baseline", default=".gpu/baselines/torch_ipc_workers.py")
    ap.add_argument("--skip-resnet", action="store_true")
    ap.add_argument("--only-resnet", action="store_true")
    ap.add_argument("--kills", type=int, default=1,
                    help="SIGKILL an idle worker this many times, one after the other")
    ap.add_argument("--only-restart", action="store_true",
                    help="export, 4 workers, the SIGKILL measurement; nothing else")
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-aoti-bench-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if a.only_resnet:
        results = {}
        for dtype in ("float32", "bfloat16"):
            results[f"resnet50_{dtype}"] = resnet(a, tmp, env, dtype)
            print(f"resnet50 {dtype}", results[f"resnet50_{dtype}"], flush=True)
            (pathlib.Path(a.out) / "aoti-resnet.json").write_text(json.dumps(results, indent=1))
        return
    (tmp / "seed_mlp.py").write_text(MODEL)
    repo = tmp / "repo"
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "hearth.aoti", "export", f"{tmp / 'seed_mlp.py'}:build",
                        "--example-input-shape", "16,16384", "--dynamic-batch", "1..64", "--device", "cuda",
                        "--output-names", "logits,argmax", "--input-names", "input", "--workers", "4",
                        "--out", str(repo / "aoti_mlp" / "1")], capture_output=True, text=True, env=env)
    print(r.stderr[-3000:], flush=True)
    if r.returncode != 0:
        raise SystemExit("export failed")
    export_s = time.time() - t0
    pt2 = os.path.getsize(repo / "aoti_mlp" / "1" / "model.pt2") / 2**20
    arena_mib = os.path.getsize(repo / "aoti_mlp" / "1" / "model.safetensors") / 2**20
    print(f"exported in {export_s:.0f} s: model.pt2 {pt2:.1f} MiB, model.safetensors {arena_mib:.0f} MiB",
          flush=True)
    results = {"export_s": export_s, "pt2_mib": pt2, "weights_mib": arena_mib,
               "bare_torch_context_mib": bare_context_mib()}
    print("bare libtorch CUDA context", results["bare_torch_context_mib"], "MiB", flush=True)

    before = settled_used_mib()
    proc, port, ready = serve(a.build, str(repo), tmp / "serve-aoti-4.log", ["aoti_mlp"])
    try:
        after = settled_used_mib()
        load = bench(a.build, port, "aoti_mlp", 16, 8, a.seconds, "argmax")
        results["aoti_4"] = {"ready_s": ready["aoti_mlp"], "device_mib": after - before,
                             "per_worker_mib": sum(split_processes(arena_mib)[1]) / 4,
                             "batches_per_s": load["requests_per_s"], "p50_ms": load["latency_ms"]["p50"],
                             "p99_ms": load["latency_ms"]["p99"], "gpu_processes_mib": sorted(gpu_processes().values())}
        # SIGKILL an idle worker; the log says when its replacement is ready.
        log = tmp / "serve-aoti-4.log"
        ready_s, start_ms = [], []
        for _ in range(a.kills):
            pids = re.findall(r"aoti_mlp worker 0 ready: pid (\d+) on .* in (\d+) ms", log.read_text())
            killed_at = time.time()
            os.kill(int(pids[-1][0]), signal.SIGKILL)
            deadline = time.time() + 60
            while time.time() < deadline:
                again = re.findall(r"aoti_mlp worker 0 ready: pid (\d+) on .* in (\d+) ms", log.read_text())
                if len(again) > len(pids):
                    ready_s.append(time.time() - killed_at)
                    start_ms.append(int(again[-1][1]))
                    break
                time.sleep(0.01)
            # An answer between kills: the replacement serves before the next one dies.
            bench(a.build, port, "aoti_mlp", 16, 1, 1, "argmax")
        if ready_s:
            results["aoti_4"]["replacement_ready_s"] = statistics.median(ready_s)
            results["aoti_4"]["replacement_ready_s_all"] = [round(x, 3) for x in ready_s]
            results["aoti_4"]["replacement_start_ms"] = statistics.median(start_ms)
        check = bench(a.build, port, "aoti_mlp", 16, 8, 1, "argmax")
        results["aoti_4"]["errors_after_kill"] = check.get("errors")
    finally:
        stop(proc)
    print("aoti 4 workers", results["aoti_4"], flush=True)
    subprocess.run(["cp", str(tmp / "serve-aoti-4.log"), a.out])
    if a.only_restart:
        (pathlib.Path(a.out) / "aoti-restart.json").write_text(json.dumps(results, indent=1))
        return

    before = settled_used_mib()
    log24 = tmp / "serve-aoti-24.log"
    lf = open(log24, "w")
    p24 = subprocess.Popen([f"{a.build}/bin/hearth", "serve", "--model-repository", str(repo), "--http-port", "0",
                            "--device", "cuda", "--workers", "24"], stdout=lf, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and "ready on http" not in log24.read_text():
            time.sleep(0.1)
        m = re.search(r"model aoti_mlp: (\d+) of (\d+) workers ready ([0-9.]+) s", log24.read_text())
        after = settled_used_mib()
        store, workers = split_processes(arena_mib)
        ctx = results["bare_torch_context_mib"]
        # The goal: one copy (the store's process: its context and the arena)
        # plus 24 bare libtorch contexts, within 5 %.
        one_copy_plus_contexts = store + 24 * ctx
        results["aoti_24"] = {"ready": m.group(0) if m else None, "device_mib": after - before,
                              "store_process_mib": store, "workers": len(workers),
                              "per_worker_mib": sum(workers) / max(len(workers), 1),
                              "one_copy_plus_24_contexts_mib": one_copy_plus_contexts,
                              "ratio_vs_one_copy_plus_contexts": (after - before) / one_copy_plus_contexts,
                              "gpu_processes_mib": sorted(gpu_processes().values())}
    finally:
        stop(p24)
    print("aoti 24 workers", results["aoti_24"], flush=True)

    # The built-in mlp backend on the same weights, 4 workers.
    brepo = tmp / "builtin"
    (brepo / "mlp" / "1").mkdir(parents=True)
    os.link(repo / "aoti_mlp" / "1" / "model.safetensors", brepo / "mlp" / "1" / "model.safetensors")
    (brepo / "mlp" / "config.yaml").write_text("backend: mlp\nmax_batch_size: 64\ninstance_group:\n"
                                               "  - {count: 4, kind: KIND_GPU, gpus: [0]}\n")
    proc, port, ready = serve(a.build, str(brepo), tmp / "serve-builtin.log", ["mlp"])
    try:
        load = bench(a.build, port, "mlp", 16, 8, a.seconds, "argmax")
        results["builtin_4"] = {"batches_per_s": load["requests_per_s"], "p50_ms": load["latency_ms"]["p50"]}
    finally:
        stop(proc)
    print("builtin 4 workers", results["builtin_4"], flush=True)

    r = subprocess.run([sys.executable, a.baseline, "--workers", "4", "--batches", "512"],
                       capture_output=True, text=True, timeout=600)
    line = [l for l in r.stdout.splitlines() if "workers=" in l]
    results["baseline_4"] = dict(re.findall(r"(\w+)=([0-9.]+)", line[-1])) if line else {"error": r.stderr[-500:]}
    print("baseline 4 workers", results["baseline_4"], flush=True)
    r = subprocess.run([sys.executable, a.baseline, "--workers", "24", "--batches", "96"],
                       capture_output=True, text=True, timeout=600)
    line = [l for l in r.stdout.splitlines() if "workers=" in l]
    results["baseline_24"] = dict(re.findall(r"(\w+)=([0-9.]+)", line[-1])) if line else {"error": r.stderr[-500:]}
    print("baseline 24 workers", results["baseline_24"], flush=True)
    (pathlib.Path(a.out) / "aoti.json").write_text(json.dumps(results, indent=1))

    if not a.skip_resnet:
        for dtype in ("float32", "bfloat16"):
            results[f"resnet50_{dtype}"] = resnet(a, tmp, env, dtype)
            print(f"resnet50 {dtype}", results[f"resnet50_{dtype}"], flush=True)
            (pathlib.Path(a.out) / "aoti.json").write_text(json.dumps(results, indent=1))


RESNET = '''
import torch
import torchvision


def build():
    torch.manual_seed(0)
    return torchvision.models.resnet50(weights=None).eval()
'''


def resnet(a, tmp, env, dtype):
    """resnet50 exported with a dynamic batch, 1 aoti worker, against eager."""
    import numpy as np
    import torch
    (tmp / "resnet_model.py").write_text(RESNET)
    repo = tmp / f"repo-resnet-{dtype}"
    out = repo / "resnet50" / "1"
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "hearth.aoti", "export", f"{tmp / 'resnet_model.py'}:build",
                        "--example-input-shape", "16,3,224,224", "--dynamic-batch", "1..64", "--device", "cuda",
                        "--dtype", dtype, "--weights-dtype", dtype, "--input-names", "image",
                        "--output-names", "logits", "--out", str(out)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return {"error": r.stderr[-1500:]}
    result = {"export_s": time.time() - t0}
    # Eager in this process, the same module and weights.
    namespace = {}
    exec(RESNET, namespace)
    model = namespace["build"]().to("cuda", getattr(torch, dtype))
    x = torch.randn(16, 3, 224, 224, device="cuda", dtype=getattr(torch, dtype))
    with torch.no_grad():
        for _ in range(5):
            model(x)
        torch.cuda.synchronize()
        n, t1 = 0, time.time()
        while time.time() - t1 < a.seconds:
            model(x)
            n += 1
        torch.cuda.synchronize()
        result["eager_batches_per_s"] = n / (time.time() - t1)
        want = model(x).float().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    proc, port, ready = serve(a.build, str(repo), tmp / f"serve-resnet-{dtype}.log", ["resnet50"])
    try:
        datatype = "FP32" if dtype == "float32" else "BF16"
        payload = x.cpu().contiguous()
        raw = payload.view(torch.int16).numpy().tobytes() if dtype == "bfloat16" else payload.numpy().tobytes()
        header = json.dumps({"inputs": [{"name": "image", "datatype": datatype, "shape": [16, 3, 224, 224],
                                         "parameters": {"binary_data_size": len(raw)}}],
                             "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
        import urllib.request
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/resnet50/infer", data=header + raw,
                                     headers={"Inference-Header-Content-Length": str(len(header)),
                                              "Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            hl = int(resp.headers["Inference-Header-Content-Length"])
            body = resp.read()
        got = np.frombuffer(body[hl:], dtype="<f4" if dtype == "float32" else "<u2")
        if dtype == "bfloat16":
            got = (got.astype(np.uint32) << 16).view(np.float32)
        result["max_abs_diff_vs_eager"] = float(np.abs(got.reshape(16, 1000) - want).max())
        # The same batch over HTTP with binary data: hearth bench sends random images.
        load = bench(a.build, port, "resnet50", 16, 2, a.seconds, "logits")
        result.update(aoti_batches_per_s=load["requests_per_s"], p50_ms=load["latency_ms"]["p50"],
                      ready_s=ready["resnet50"])
        result["ratio_vs_eager"] = result["aoti_batches_per_s"] / result["eager_batches_per_s"]
    finally:
        stop(proc)
    return result


if __name__ == "__main__":
    main()
