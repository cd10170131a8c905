"""SIGKILL of an idle worker to its replacement's ready line, with and
without standby workers (parameters.standby_workers).

    python3 bench/serve/restart_bench.py --build build --device cpu --kills 5

Models: `tiny` (examples/generate/tiny_decoder: backend: python, torch),
`llama` (examples/generate/llama: backend: python through hearth.transformers,
a small random Llama checkpoint; needs torch >= 2 and transformers) and
`scale` (the built-in backend). For each and for standby_workers 0 and 1:
one worker, killed --kills times one after the other (each replacement
answers a request before the next kill, and the standby that follows it has
had --settle seconds to load); the median and every time, from the kill to
the ready line in the server's log.
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
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from generate_bench import stop, wait_port  # noqa: E402


def write_repo(build, repo, model, standby, kind):
    if model == "llama":
        subprocess.run([sys.executable, str(ROOT / "examples/generate/llama/make_repository.py"), str(repo),
                        "--name", "llama", "--workers", "1", "--kind", kind,
                        "--parameter", f"standby_workers={standby}"], check=True, capture_output=True)
        return
    if model == "tiny":
        subprocess.run([sys.executable, str(ROOT / "examples/generate/tiny_decoder/make_repository.py"), str(repo),
                        "--name", "tiny", "--workers", "1", "--kind", kind,
                        "--parameter", f"standby_workers={standby}"], check=True, capture_output=True)
        return
    (repo / "scale" / "1").mkdir(parents=True)
    subprocess.run([f"{build}/bin/hearth", "make-model", "scale", "--dims", "500", "--seed", "1", "--out",
                    str(repo / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    (repo / "scale" / "config.yaml").write_text(
        "backend: scale\nmax_batch_size: 4\ninstance_group:\n"
        f"  - {{count: 1, kind: {kind}}}\nparameters: {{standby_workers: '{standby}'}}\n")


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


def measure(a, model, standby):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-restart-bench-"))
    kind = "KIND_GPU" if a.device.startswith("cuda") else "KIND_CPU"
    write_repo(a.build, tmp / "repo", model, standby, kind)
    log = tmp / "serve.log"
    proc = subprocess.Popen([f"{a.build}/bin/hearth", "serve", "--model-repository", str(tmp / "repo"),
                             "--http-port", "0", "--grpc-port", "-1", "--device", a.device],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, HEARTH_PYTHON=sys.executable))
    pattern = rf"{model} worker 0 ready: pid (\d+) on (.*) in (\d+) ms"
    times, lines = [], []
    try:
        port = int(wait_port(log, r"ready on http://127\.0\.0\.1:(\d+)", proc, timeout=300).group(1))
        ask(port, model)
        for _ in range(a.kills):
            time.sleep(a.settle)  # the standby that follows a start loads meanwhile
            before = re.findall(pattern, log.read_text())
            killed = time.time()
            os.kill(int(before[-1][0]), signal.SIGKILL)
            while len(re.findall(pattern, log.read_text())) == len(before):
                if time.time() - killed > 120:
                    raise SystemExit("no replacement in 120 s:\n" + log.read_text()[-3000:])
                time.sleep(0.005)
            times.append(time.time() - killed)
            lines.append(re.findall(pattern, log.read_text())[-1][1])
            ask(port, model)
        phases = start_phases(port, model)
    finally:
        stop(proc)
    return {"model": model, "standby_workers": standby, "device": a.device,
            "median_s": statistics.median(times), "all_s": [round(t, 3) for t in times],
            "start_phases_mean_s": phases, "ready_text": lines[-1]}


def start_phases(port, model):
    """The mean time of each phase of the model's worker starts, from /metrics
    (hearth_worker_start_phase_duration_us and _count), in seconds."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
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
    a = ap.parse_args()
    for model in a.models.split(","):
        for standby in (0, 1):
            print(json.dumps(measure(a, model, standby)), flush=True)


if __name__ == "__main__":
    main()
