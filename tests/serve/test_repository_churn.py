"""A client that loads and unloads a model in a loop under load must not grow
the server: each load retires the runtime it replaces (each unload the one
it clears), whose workers drain and exit; the server joins them and frees it.
500 loads and unloads while four clients keep asking; the server's threads,
descriptors and resident memory after them are measured against the same
after the first 50, once /metrics says no replaced runtime is left
(hearth_retired_runtimes 0).

Paths: $HEARTH_CLI (default build/bin/hearth).
"""

import os
import subprocess
import threading

import numpy as np
import requests

from serve_support import (CLI, SCALE_N, memory_fields, metrics, scale_config, start_serve, stop_serve,
                           wait_for)


MIB = 1 << 20
ROUNDS = 500
WARM = 50


def held(pid):
    """(threads, descriptors, resident bytes, mapped bytes) of process `pid`."""
    threads = len(os.listdir(f"/proc/{pid}/task"))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss, mapped = memory_fields(pid, "VmRSS", "VmSize")
    return threads, fds, rss, mapped


def settled(url, freed):
    """Waits until every replaced runtime is freed, and `freed` in all."""
    def done():
        m = metrics(url)
        return m.get("hearth_retired_runtimes") == 0 and m.get("hearth_retired_runtimes_freed_total") == freed
    wait_for(done, f"{freed} replaced runtimes to be freed", timeout=120)


def test_loading_and_unloading_in_a_loop_holds_nothing(tmp_path):
    repo = tmp_path / "repo"
    (repo / "swap" / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "3",
                    "--out", str(repo / "swap" / "1" / "model.safetensors")], check=True, capture_output=True)
    (repo / "swap" / "config.yaml").write_text(scale_config(count=1, kind="KIND_CPU"))
    # On host memory wherever it runs: what is measured is the server's own.
    state = start_serve(tmp_path, repo, ["--grpc-port", "-1"], name="churn", device="cpu")
    url, pid = state["url"], state["proc"].pid
    x = np.ones((1, SCALE_N), np.float32)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, SCALE_N], "data": x.ravel().tolist()}]}
    stop, answered, refused, wrong = threading.Event(), [0], [0], []

    def keep_asking():
        with requests.Session() as s:
            while not stop.is_set():
                r = s.post(f"{url}/v2/models/swap/infer", json=body, timeout=60)
                if r.status_code == 200:
                    answered[0] += 1
                elif r.status_code == 503 and "unloaded" in r.text:
                    refused[0] += 1  # between an unload and the next load
                else:
                    wrong.append((r.status_code, r.text[:300]))

    clients = [threading.Thread(target=keep_asking) for _ in range(4)]
    for c in clients:
        c.start()
    retired = 0
    try:
        for i in range(ROUNDS):
            if i % 10 == 9:
                r = requests.post(f"{url}/v2/repository/models/swap/unload", timeout=120)
                assert r.status_code == 200, r.text
                retired += 1
                r = requests.post(f"{url}/v2/repository/models/swap/load", timeout=120)
                assert r.status_code == 200, r.text  # after an unload: a fresh start, nothing replaced
            else:
                r = requests.post(f"{url}/v2/repository/models/swap/load", timeout=120)
                assert r.status_code == 200, r.text
                retired += 1
            if i + 1 == WARM:
                settled(url, retired)
                before = held(pid)
    finally:
        stop.set()
        for c in clients:
            c.join()
    try:
        settled(url, retired)
        after = held(pid)
        assert wrong == [], wrong[:5]
        assert answered[0] > 0
        threads, fds, rss, mapped = (a - b for a, b in zip(after, before))
        report = (f"after {WARM} rounds: {before[0]} threads, {before[1]} descriptors, "
                  f"{before[2] / MIB:.1f} MiB resident, {before[3] / MIB:.1f} MiB mapped; after {ROUNDS}: "
                  f"{after[0]}, {after[1]}, {after[2] / MIB:.1f} MiB, {after[3] / MIB:.1f} MiB")
        # Flat. Kept, 450 more replaced runtimes would hold about 9 MiB
        # resident and, in their unjoined supervisor threads' stacks, 8 MiB
        # mapped each (3.6 GB).
        assert threads <= 4, report
        assert fds <= 8, report
        assert rss < 4 * MIB, report
        # A new thread may get a malloc arena of its own (64 MiB reserved).
        assert mapped < 256 * MIB, report
        print(report)
    finally:
        code, text = stop_serve(state)
    assert code == 0, text[-3000:]
