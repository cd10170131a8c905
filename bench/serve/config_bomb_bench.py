#!/usr/bin/python3
"""How long `hearth serve` takes to listen and to say ready with a YAML alias
bomb ("billion laughs") in one model's config.yaml beside a good model, and
without it; and how long it takes to exit after SIGTERM while a model is
still being built (a worker that never says ready, or the bomb's config).

    bench/serve/config_bomb_bench.py [--cli build/bin/hearth] [--runs 3] [--give-up-s 60]

Prints a table. Times are from the process's start (or from SIGTERM) to the
log line or exit, polling the log every 10 ms. A run that passes
--give-up-s is killed and reported as "> N s".
"""
import argparse
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def bomb_config():
    lines = ["backend: scale", "parameters:", "  a: &a [x, x, x, x, x, x, x, x, x]"]
    for level in "bcdefghij":
        previous = chr(ord(level) - 1)
        lines.append(f"  {level}: &{level} [" + ", ".join([f"*{previous}"] * 9) + "]")
    return "\n".join(lines) + "\n"


SCALE_CONFIG = """backend: scale
max_batch_size: 8
input:
  - {name: x, data_type: TYPE_FP32, dims: [500]}
output:
  - {name: y, data_type: TYPE_FP32, dims: [1]}
instance_group:
  - {count: 1, kind: KIND_CPU}
"""


def repository(root, cli, bomb):
    (root / "scale" / "1").mkdir(parents=True)
    subprocess.run([cli, "make-model", "scale", "--dims", "500", "--seed", "1",
                    "--out", str(root / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    (root / "scale" / "config.yaml").write_text(SCALE_CONFIG)
    if bomb:
        (root / "bomb" / "1").mkdir(parents=True)
        shutil.copy(root / "scale" / "1" / "model.safetensors", root / "bomb" / "1" / "model.safetensors")
        (root / "bomb" / "config.yaml").write_text(bomb_config())


def wait_line(log, pattern, proc, start, give_up):
    while time.monotonic() - start < give_up:
        if re.search(pattern, log.read_text()):
            return time.monotonic() - start
        if proc.poll() is not None:
            return None
        time.sleep(0.01)
    return None


def serve(cli, repo, log):
    return subprocess.Popen([cli, "serve", "--model-repository", str(repo), "--http-port", "0",
                             "--grpc-port", "-1", "--device", "cpu"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc, give_up):
    """SIGTERM; seconds to exit, or None if it had to be killed."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=give_up)
        return time.monotonic() - sent
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def fmt(values, give_up):
    if not values:
        return "-"
    if any(v is None for v in values):
        return f"> {give_up:.0f} s"
    return f"{statistics.median(values) * 1000:.0f} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", default=str(ROOT / "build" / "bin" / "hearth"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--give-up-s", type=float, default=60)
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-bomb-bench-"))
    rows = []
    try:
        for bomb in (False, True):
            repo = tmp / ("repo-bomb" if bomb else "repo")
            repository(repo, args.cli, bomb)
            listen, ready, exits = [], [], []
            for run in range(args.runs):
                log = tmp / f"serve-{bomb}-{run}.log"
                start = time.monotonic()
                proc = serve(args.cli, repo, log)
                # Before the models loaded in the background, HTTP opened just before the ready line.
                listen.append(wait_line(log, r"listening on http|ready on http", proc, start, args.give_up_s))
                ready.append(wait_line(log, r"ready on http", proc, start, args.give_up_s))
                exits.append(stop(proc, args.give_up_s))
                if bomb and ready[-1] is not None:
                    assert "aliases are not supported" in log.read_text(), "the bomb's reason is not logged"
            rows.append((f"start-up, {'good model + bomb' if bomb else 'good model alone'}",
                         fmt(listen, args.give_up_s), fmt(ready, args.give_up_s), fmt(exits, args.give_up_s)))
        # SIGTERM 1 s after start while the bomb's model (or a worker that never
        # says ready) is being built.
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        shutil.copy(args.cli, bin_dir / "hearth")
        (bin_dir / "hearth-worker").write_text("#!/bin/sh\nexec sleep 600\n")
        (bin_dir / "hearth-worker").chmod(0o755)
        for what, cli, repo in (("SIGTERM 1 s after start, bomb in the repository", args.cli, tmp / "repo-bomb"),
                                ("SIGTERM 1 s after start, a worker never says ready", str(bin_dir / "hearth"),
                                 tmp / "repo")):
            exits = []
            for run in range(args.runs):
                proc = serve(cli, repo, tmp / f"sigterm-{run}.log")
                time.sleep(1)
                exits.append(stop(proc, args.give_up_s))
            rows.append((what, "", "", fmt(exits, args.give_up_s)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"hearth serve, {args.runs} runs each (median), {args.cli}")
    print(f"| {'case':<52} | {'listening':>10} | {'ready line':>10} | {'SIGTERM to exit':>15} |")
    print(f"|{'-' * 54}|{'-' * 11}:|{'-' * 11}:|{'-' * 16}:|")
    for case, a, b, c in rows:
        print(f"| {case:<52} | {a:>10} | {b:>10} | {c:>15} |")


if __name__ == "__main__":
    main()
