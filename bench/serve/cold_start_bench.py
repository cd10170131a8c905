"""N `backend: python` workers of seed 004's MLP (examples/python_backend's
mlp_model.py) ready from a cold start, forked from the model's zygote and
exec'd, beside what the driver alone takes to create N CUDA contexts at
once (N processes forked from one that imported torch, each making its
context with its first tensor: the driver creates contexts one after
another).

    python3 bench/serve/cold_start_bench.py --build build-gpu --workers 24

Each line is JSON: for the server, the seconds from its start to the
weights loaded, to the zygote ready, and to the last worker ready (its log's
"N of N workers ready"); for the contexts, the seconds from the forks to the
last context made, and one context alone; for each of --orders, N processes
forked before `import torch` making their context before or after importing
it (or through the driver alone).
"""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from generate_bench import stop, wait_port  # noqa: E402


# What each of the processes forked at once does in contexts_in_order().
# "imported": forked from a Python that has imported torch, its first tensor
# (what the driver alone takes to create N contexts, the goal's measure).
# Forked before `import torch`: "driver": its primary context through libcuda
# alone; "import-first": import
# torch, then its first tensor; "context-first": the primary context through
# libcuda, then import torch, whose runtime takes that context, then its
# first tensor; "overlap": the primary context through libcuda on a thread
# while the main thread imports torch, then its first tensor. context-first
# and overlap against import-first say whether a worker that makes its
# context while it imports (instead of after a zygote has imported) can be
# ready sooner. "mixed-K": K processes do "overlap" while one more imports
# torch and then forks the other N - K, each making its context with its
# first tensor (a cold start that execs K workers while the zygote imports).
ORDERS = ("driver", "import-first", "context-first", "overlap", "mixed-K")


def mixed_count(order):
    """K of a "mixed-K" order, else 0."""
    k = re.fullmatch(r"mixed-(\d+)", order)
    return int(k.group(1)) if k else 0


def valid_order(order, n):
    return order in ORDERS[:-1] or 0 < mixed_count(order) < n


def contexts_in_order(n, device, order, env=None):
    """Seconds for n processes forked at once to each be done with `order`
    ("imported" or one of ORDERS)."""
    index = int(device.split(":")[1]) if ":" in device else 0
    exec_count = mixed_count(order)
    code = f"""
import ctypes, os, sys, threading, time
def context():
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), {index})),
                       ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev)),
                       ("cuCtxSetCurrent", (ctx,))):
        rc = getattr(cuda, call)(*args)
        if rc != 0:
            sys.exit(f"{{call}}: CUresult {{rc}}")
def tensor():
    import torch
    torch.empty(1, device="cuda:{index}")
    torch.cuda.synchronize()
order = {order!r}
if order == "imported":
    import torch
began = time.monotonic()
pids = []
def wait(pids):
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            sys.exit(f"a process failed: status {{status}}")
mixed = {exec_count}
if mixed:
    pid = os.fork()
    if pid == 0:
        import torch
        forked = []
        for _ in range({n} - mixed):
            child = os.fork()
            if child == 0:
                tensor()
                os._exit(0)
            forked.append(child)
        wait(forked)
        os._exit(0)
    pids.append(pid)
for _ in range(mixed or {n}):
    pid = os.fork()
    if pid == 0:
        if order in ("driver", "context-first"):
            context()
        if order == "overlap" or mixed:
            made = threading.Thread(target=context)
            made.start()
            import torch
            made.join()
        if order != "driver":
            tensor()
        os._exit(0)
    pids.append(pid)
wait(pids)
print(time.monotonic() - began)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"{order}: {out.stderr.strip()[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def serve(a, zygote):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-cold-start-"))
    repo = tmp / "repo"
    (repo / "mlp" / "1").mkdir(parents=True)
    subprocess.run([f"{a.build}/bin/hearth", "make-model", "mlp", "--dims", a.dims, "--seed", "0",
                    "--out", str(repo / "mlp" / "1" / "model.safetensors")], check=True, capture_output=True)
    (repo / "mlp" / "1" / "model.py").write_text((ROOT / "examples/python_backend/mlp_model.py").read_text())
    d_in, _, d_out = a.dims.split(",")
    kind = "KIND_GPU" if a.device.startswith("cuda") else "KIND_CPU"
    (repo / "mlp" / "config.yaml").write_text(f"""backend: python
max_batch_size: 64
input:
  - {{name: input, data_type: TYPE_FP32, dims: [{d_in}]}}
output:
  - {{name: logits, data_type: TYPE_FP32, dims: [{d_out}]}}
  - {{name: argmax, data_type: TYPE_INT64, dims: [1]}}
instance_group:
  - {{count: {a.workers}, kind: {kind}}}
parameters: {{python: {sys.executable}, zygote: '{str(zygote).lower()}'}}
""")
    log = tmp / "serve.log"
    began = time.monotonic()
    proc = subprocess.Popen([f"{a.build}/bin/hearth", "serve", "--model-repository", str(repo), "--http-port", "0",
                             "--grpc-port", "-1", "--device", a.device],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=a.environment)
    try:
        done = wait_port(log, r"model mlp: (\d+) of (\d+) workers ready ([\d.]+) s after start-up began", proc,
                         timeout=600)
        text = log.read_text()
    finally:
        stop(proc)
    out = {"mode": "zygote" if zygote else "exec", "workers": a.workers, "dims": a.dims, "device": a.device,
           "ready_workers": int(done.group(1)), "all_ready_s": float(done.group(3)),
           "wall_s": round(time.monotonic() - began, 3)}
    loaded = re.search(r"model mlp: weights loaded on \S+ in ([\d.]+) s", text)
    if loaded:
        out["weights_loaded_s"] = float(loaded.group(1))
    z = re.search(r"mlp: zygote ready: pid \d+ in (\d+) ms \(([^)]*)\)", text)
    if z:
        out["zygote_ready_ms"], out["zygote_phases"] = int(z.group(1)), z.group(2)
    refused = re.search(r"mlp: its workers are exec'd, not forked from a zygote: (.*)", text)
    if refused:
        out["zygote_off"] = refused.group(1)
    starts = [int(ms) for ms in re.findall(r"mlp worker \d+ ready: pid \d+ on .* in (\d+) ms", text)]
    if starts:
        out["worker_start_ms"] = {"min": min(starts), "max": max(starts)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workers", type=int, default=24)
    ap.add_argument("--dims", default="16384,16384,12800", help="the MLP's in,hidden,out (default the seed's)")
    ap.add_argument("--modes", default="zygote,exec", help="hearth serve runs: zygote, exec; empty: none")
    ap.add_argument("--orders", default=",".join(ORDERS[:-1]),
                    help="on a GPU, N processes forked before `import torch`, each timed doing: driver (its "
                         "context through libcuda alone), import-first (import torch, then a tensor), "
                         "context-first (the context through libcuda, then import torch and a tensor), "
                         "overlap (the context through libcuda on a thread while importing torch, then a "
                         "tensor), mixed-K (0 < K < N: K processes overlap while one imports torch and "
                         "forks the other N - K, each then making a tensor); empty: none")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set for every process the bench starts, the server's workers included "
                         "(e.g. CUDA_DEVICE_MAX_CONNECTIONS=1); repeatable")
    a = ap.parse_args()
    a.environment = dict(os.environ)
    for item in a.env:
        name, eq, value = item.partition("=")
        if not eq or not name:
            ap.error(f"--env {item!r}: not NAME=VALUE")
        a.environment[name] = value
    unknown = [o for o in (a.orders.split(",") if a.orders else []) if not valid_order(o, a.workers)]
    if unknown:
        ap.error(f"--orders: {', '.join(unknown)} is none of {', '.join(ORDERS)} "
                 "(mixed-K with 0 < K < --workers)")
    if a.device.startswith("cuda"):
        for n in (1, a.workers):
            seconds = contexts_in_order(n, a.device, "imported", a.environment)
            print(json.dumps({"contexts": n, "seconds": round(seconds, 3)}), flush=True)
        for order in a.orders.split(",") if a.orders else []:
            seconds = contexts_in_order(a.workers, a.device, order, a.environment)
            print(json.dumps({"processes": a.workers, "order": order, "seconds": round(seconds, 3)}), flush=True)
    for mode in a.modes.split(",") if a.modes else []:
        print(json.dumps(serve(a, mode == "zygote")), flush=True)


if __name__ == "__main__":
    main()
