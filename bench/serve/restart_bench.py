"""SIGKILL of an idle worker to its replacement's ready line (or, for a hot
spare, to the log line saying it took over), in each way hearth can start
a worker.

    python3 bench/serve/restart_bench.py --build build --device cpu --kills 5

Models: `tiny` (examples/generate/tiny_decoder: backend: python, torch),
`llama` (examples/generate/llama: backend: python through hearth.transformers,
a small random Llama checkpoint; needs torch >= 2 and transformers) and
`scale` (the built-in backend). Modes (--modes):

    exec     an exec'd worker (parameters.zygote false for Python models)
    standby  exec'd, with a cold standby (standby_workers 1, zygote false)
    zygote   forked from the model's zygote (Python models only; the default)
    hot      a hot spare (standby_workers 1, standby_mode hot)

For each model and mode: one worker, killed --kills times one after the
other (each replacement answers a request before the next kill, and the
standby or spare that follows it has had --settle seconds to start); the
median and every time, and the mean of each start phase from /metrics.
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from generate_bench import stop, wait_port  # noqa: E402


MODES = {
    "exec": {"zygote": "false"},
    "standby": {"zygote": "false", "standby_workers": "1"},
    "zygote": {},
    "hot": {"standby_workers": "1", "standby_mode": "hot"},
}


def write_repo(build, repo, model, parameters, kind):
    extra = [f"--parameter={k}={v}" for k, v in parameters.items()]
    if model in ("llama", "tiny"):
        script = "llama/make_repository.py" if model == "llama" else "tiny_decoder/make_repository.py"
        subprocess.run([sys.executable, str(ROOT / "examples/generate" / script), str(repo),
                        "--name", model, "--workers", "1", "--kind", kind, *extra], check=True, capture_output=True)
        return
    (repo / "scale" / "1").mkdir(parents=True)
    subprocess.run([f"{build}/bin/hearth", "make-model", "scale", "--dims", "500", "--seed", "1", "--out",
                    str(repo / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    entries = ", ".join(f"{k}: '{v}'" for k, v in parameters.items() if k != "zygote")
    (repo / "scale" / "config.yaml").write_text(
        "backend: scale\nmax_batch_size: 4\ninstance_group:\n"
        f"  - {{count: 1, kind: {kind}}}\nparameters: {{{entries}}}\n")


def ask(port, model):
    """One request that must succeed (generate for tiny, infer for scale)."""
    if model in ("tiny", "llama"):
        body = {"text_input": "hi", "parameters": {"max_tokens": 2}}
        url = f"http://127.0.0.1:{port}/v2/models/{model}/generate"
    else:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 500], "data": [1.0] * 500}]}
        url = f"http://127.0.0.1:{port}/v2/models/scale/infer"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def measure(a, model, mode):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-restart-bench-"))
    kind = "KIND_GPU" if a.device.startswith("cuda") else "KIND_CPU"
    write_repo(a.build, tmp / "repo", model, MODES[mode], kind)
    log = tmp / "serve.log"
    proc = subprocess.Popen([f"{a.build}/bin/hearth", "serve", "--model-repository", str(tmp / "repo"),
                             "--http-port", "0", "--grpc-port", "-1", "--device", a.device],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, HEARTH_PYTHON=sys.executable))
    # A started worker's ready line, or a hot spare's takeover: either way the
    # worker that serves next.
    ready = rf"{model} worker 0 ready: pid (\d+) on (.*) in (\d+) ms"
    took_over = rf"{model} worker 0: the hot spare \(pid (\d+)\) takes over()()"
    pattern = f"(?:{ready})|(?:{took_over})"

    def serving():
        return [(m[0] or m[3], m[1] or "a hot spare took over") for m in re.findall(pattern, log.read_text())]

    times, lines = [], []
    try:
        port = int(wait_port(log, r"ready on http://127\.0\.0\.1:(\d+)", proc, timeout=300).group(1))
        ask(port, model)
        for _ in range(a.kills):
            time.sleep(a.settle)  # the standby or spare that follows a start starts meanwhile
            before = serving()
            killed = time.time()
            os.kill(int(before[-1][0]), signal.SIGKILL)
            while len(serving()) == len(before):
                if time.time() - killed > 120:
                    raise SystemExit("no replacement in 120 s:\n" + log.read_text()[-3000:])
                time.sleep(0.001)
            times.append(time.time() - killed)
            lines.append(serving()[-1][1])
            ask(port, model)
        phases = start_phases(port, model)
        # The device memory the last spare takes, context included, as the
        # driver counts it (nvidia-smi), beside the serving worker's.
        driver_memory = {}
        spares = re.findall(rf"{model}: hot spare ready on \S+: pid (\d+)", log.read_text())
        if spares and shutil.which("nvidia-smi"):
            wait_port(log, rf"{model}: hot spare ready on \S+: pid {spares[-1]}", proc, timeout=120)
            listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                     "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            used = {int(p): int(m) for p, m in re.findall(r"(\d+),\s*(\d+)", listed)}
            driver_memory = {"hot_spare_mib": used.get(int(spares[-1])),
                             "serving_worker_mib": used.get(int(serving()[-1][0]))}
        spare_memory = re.findall(rf'^hearth_hot_spare_device_memory_bytes{{model="{model}"}} (\S+)$',
                                  metrics_text(port), re.M)
    finally:
        stop(proc)
    out = {"model": model, "mode": mode, "device": a.device,
           "median_s": round(statistics.median(times), 4), "all_s": [round(t, 4) for t in times],
           "start_phases_mean_s": phases, "ready_text": lines[-1]}
    if spare_memory:
        out["hot_spare_device_memory_bytes"] = int(float(spare_memory[0]))
    if driver_memory:
        out["nvidia_smi_used_memory"] = driver_memory
    zygote = re.findall(rf"{model}: zygote ready: pid \d+ in (\d+) ms \(([^)]*)\)", log.read_text())
    if zygote:
        out["zygote_ready_ms"], out["zygote_phases"] = int(zygote[-1][0]), zygote[-1][1]
    return out


def metrics_text(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


def start_phases(port, model):
    """The mean time of each phase of the model's worker starts, from /metrics
    (hearth_worker_start_phase_duration_us and _count), in seconds."""
    text = metrics_text(port)
    totals = {}
    for name, phase, value in re.findall(
            rf'^hearth_worker_start_phase_(duration_us|count){{model="{model}",phase="([^"]+)"}} (\S+)$',
            text, re.M):
        totals.setdefault(phase, {})[name] = float(value)
    return {phase: round(t["duration_us"] / t["count"] / 1e6, 4)
            for phase, t in totals.items() if t.get("count")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between a replacement and the next kill")
    ap.add_argument("--models", default="tiny,scale")
    ap.add_argument("--modes", default="exec,standby,zygote,hot", help="of " + ", ".join(MODES))
    a = ap.parse_args()
    modes = a.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            ap.error(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
    for model in a.models.split(","):
        for mode in modes:
            if mode == "zygote" and model == "scale":
                continue  # a zygote is backend: python's
            print(json.dumps(measure(a, model, mode)), flush=True)


if __name__ == "__main__":
    main()
