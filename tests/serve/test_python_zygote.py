"""`backend: python` workers forked from the model's zygote: they answer as
exec'd ones do, hold only their own descriptors and are the server's own
children; a model.py that touches a device, or starts threads, at import
makes its model exec its workers, saying why; a zygote that dies is
replaced; and descendants orphaned by a dead worker are reaped by the
server, their subreaper.

The workers run /usr/bin/python3 (this interpreter) on NumPy.
"""

import os
import pathlib
import re
import signal
import sys

import numpy as np

import serve_support
from serve_support import gone, infer_json, read_safetensors, start_serve, stop_serve, wait_for

N = 6

MODEL_PY = """
import os
import subprocess
import sys

import numpy as np


class Model:
    def initialize(self, args):
        self.w = np.asarray(args["weights"]["weight"])
        # A module first imported here: the zygote learns it from the workers.
        self.had_minidom = "xml.dom.minidom" in sys.modules
        import xml.dom.minidom  # noqa: F401

    def execute(self, inputs):
        x = np.asarray(inputs["x"])
        if (x == 98).any():
            return {"y": np.full((x.shape[0], 1), float(self.had_minidom), dtype=np.float32)}
        if (x == 99).any():
            # A descendant that outlives this worker (killed next by the
            # test): orphaned, it is handed to the server.
            child = subprocess.Popen(["sleep", "1"])
            return {"y": np.full((x.shape[0], 1), child.pid, dtype=np.float32)}
        return {"y": (x * self.w).sum(axis=1, keepdims=True).astype(np.float32)}
"""


def config(count=2, extra=""):
    return f"""backend: python
max_batch_size: 8
input:
  - {{name: x, data_type: TYPE_FP32, dims: [{N}]}}
output:
  - {{name: y, data_type: TYPE_FP32, dims: [1]}}
instance_group:
  - {{count: {count}, kind: KIND_CPU}}
parameters:
  python: {sys.executable}
""" + extra


def write_model(root, name, text, code=MODEL_PY):
    serve_support.write_model(root, name, text, code, dims=N, seed=6)


def ask(url, model, x):
    r = infer_json(url, model, [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                 "data": x.ravel().tolist()}])
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["outputs"][0]["data"], np.float32)


def ready_pids(log, model):
    return [int(p) for p in re.findall(rf"{model} worker \d+ ready: pid (\d+)", log.read_text())]


def zygote_pids(log, model):
    return [int(p) for p in re.findall(rf"{model}: zygote ready: pid (\d+)", log.read_text())]


def fd_targets(pid):
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            pass
    return out


def environ_value(pid, name):
    """NAME's value in process pid's environment, None where it has none."""
    for entry in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        key, _, value = entry.decode(errors="replace").partition("=")
        if key == name:
            return value
    return None


def stat(pid):
    """(state, parent pid) from /proc/PID/stat."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def test_forked_workers_answer_as_execd_ones_and_hold_only_their_own_descriptors(tmp_path):
    root = tmp_path / "repo"
    write_model(root, "forked", config())
    write_model(root, "execd", config(extra="  zygote: 'false'\n"))
    state = start_serve(tmp_path, root)
    try:
        log, serve_pid = state["log"], state["proc"].pid
        wait_for(lambda: len(ready_pids(log, "forked")) == 2 and len(ready_pids(log, "execd")) == 2,
                 "every worker ready", timeout=60)
        text = log.read_text()
        assert re.search(r"forked: zygote ready: pid \d+ in \d+ ms \(.*imports [\d.]+ s", text), text[-3000:]
        assert "execd: zygote" not in text
        forked = re.findall(r"forked worker \d+ ready: pid \d+ on cpu \((.*)\) in \d+ ms", text)
        execd = re.findall(r"execd worker \d+ ready: pid \d+ on cpu \((.*)\) in \d+ ms", text)
        assert len(forked) == 2 and all("forked from the zygote; start: fork " in t for t in forked), forked
        assert len(execd) == 2 and not any("forked" in t for t in execd), execd
        # Each start's phases, in order, fit in the start the server measured
        # (the first, from the kernel's start time in clock ticks, may be a
        # tick, 10 ms, more).
        for model, names in (("forked", ["fork", "setup", "attach", "tensors", "initialize"]),
                             ("execd", ["interpreter", "setup", "imports", "model.py", "attach", "tensors",
                                        "initialize"])):
            for phases, spawn_to_ready_ms in re.findall(
                    rf"{model} worker \d+ ready: pid \d+ on .*?; start: ([^)]*)\) in (\d+) ms", text):
                named = [p.rsplit(" ", 2) for p in phases.split(", ")]
                assert [n for n, _, _ in named] == names, phases
                assert sum(float(v) for _, v, _ in named) <= int(spawn_to_ready_ms) / 1000 + 0.02, phases

        # The same answers, the store's weights.
        w = read_safetensors(root / "forked" / "1" / "model.safetensors")["weight"]
        x = np.random.default_rng(0).standard_normal((3, N)).astype(np.float32)
        a, b = ask(state["url"], "forked", x), ask(state["url"], "execd", x)
        np.testing.assert_allclose(a, (x * w).sum(axis=1), rtol=1e-5)
        np.testing.assert_array_equal(a, b)

        # A forked worker is the server's child, never the zygote's, and
        # holds the server's stdio, its own control socket at 3, its slot at
        # 4 and its connection to the store: not the zygote's socket, nor
        # any of the server's.
        zygote = zygote_pids(log, "forked")[-1]
        assert stat(zygote)[1] == serve_pid
        assert pathlib.Path(f"/proc/{zygote}/comm").read_text().strip() == "hearth-zygote"
        zygote_fds = fd_targets(zygote)
        server_fds = fd_targets(serve_pid)
        server_sockets = {t for t in server_fds.values() if t.startswith("socket:")}
        for pid in ready_pids(log, "forked"):
            assert stat(pid)[1] == serve_pid, f"forked worker {pid} is not the server's child"
            assert pathlib.Path(f"/proc/{pid}/comm").read_text().strip() != "hearth-zygote"
            fds = fd_targets(pid)
            assert sorted(fds)[:5] == [0, 1, 2, 3, 4] and len(fds) == 6, f"worker {pid} holds {fds}"
            for std in (0, 1, 2):
                assert fds[std] == server_fds[std]
            assert fds[4] == "/memfd:hearth-slot-forked (deleted)", fds[4]
            for fd in (3, 5):
                assert fds[fd].startswith("socket:"), fds
                assert fds[fd] not in server_sockets, f"worker {pid} fd {fd} is a socket the server holds"
                assert fds[fd] != zygote_fds[3], f"worker {pid} fd {fd} is the zygote's socket"
        # The zygote holds no weights and no slot.
        assert sorted(zygote_fds) == [0, 1, 2, 3], zygote_fds
        assert "hearth-arena" not in pathlib.Path(f"/proc/{zygote}/maps").read_text()
        # One hardware work queue per worker's CUDA context, hearth-worker's
        # default where the server's environment sets none: in the
        # environment of the zygote (exec'd by hearth-worker), and so of every
        # worker forked from it, and of every exec'd worker.
        connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        for pid in [zygote] + ready_pids(log, "forked") + ready_pids(log, "execd"):
            assert environ_value(pid, "CUDA_DEVICE_MAX_CONNECTIONS") == connections, pid
    finally:
        code, text = stop_serve(state)
    assert code == 0, text[-3000:]


def test_a_killed_zygote_is_replaced_and_a_killed_worker_comes_back_forked(tmp_path):
    root = tmp_path / "repo"
    write_model(root, "pyz", config(count=1))
    # A value the server's environment sets is the one its workers get.
    state = start_serve(tmp_path, root, env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "3"})
    try:
        log, url = state["log"], state["url"]
        wait_for(lambda: ready_pids(log, "pyz"), "the worker ready", timeout=60)
        zygotes = zygote_pids(log, "pyz")
        for pid in zygotes[-1:] + ready_pids(log, "pyz")[-1:]:
            assert environ_value(pid, "CUDA_DEVICE_MAX_CONNECTIONS") == "3", pid
        first = zygotes[-1]
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: len(zygote_pids(log, "pyz")) > len(zygotes), "another zygote", timeout=60)
        assert re.search(rf"pyz: its zygote \(pid {first}\) killed by signal 9; starting another",
                         log.read_text())
        second = zygote_pids(log, "pyz")[-1]
        worker = ready_pids(log, "pyz")[-1]
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: ready_pids(log, "pyz")[-1] != worker, "the worker's replacement", timeout=60)
        replacement = ready_pids(log, "pyz")[-1]
        line = re.search(rf"pyz worker 0 ready: pid {replacement} on cpu \((.*)\)", log.read_text()).group(1)
        assert "forked from the zygote" in line, line
        assert stat(replacement)[1] == state["proc"].pid
        assert zygote_pids(log, "pyz")[-1] == second
        w = read_safetensors(root / "pyz" / "1" / "model.safetensors")["weight"]
        x = np.ones((1, N), np.float32)
        np.testing.assert_allclose(ask(url, "pyz", x), [w.sum()], rtol=1e-5)

        # The second zygote has learned from the worker it forked what that
        # worker imported in initialize: the next worker has it at its fork.
        assert ask(url, "pyz", np.full((1, N), 98, np.float32))[0] == 0.0
        wait_for(lambda: re.search(rf"zygote {second}: imported \d+ of the \d+ modules its workers import",
                                   log.read_text()), "the zygote to learn its worker's imports")
        worker = ready_pids(log, "pyz")[-1]
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: ready_pids(log, "pyz")[-1] != worker, "the worker's replacement", timeout=60)
        assert ask(url, "pyz", np.full((1, N), 98, np.float32))[0] == 1.0

        # A descendant of a worker that dies is handed to the server (a
        # subreaper), which reaps it once it has exited.
        orphan = int(ask(url, "pyz", np.full((1, N), 99, np.float32))[0])
        worker = ready_pids(log, "pyz")[-1]
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: gone(orphan) or stat(orphan)[1] == state["proc"].pid,
                 "the orphan to be handed to the server")
        wait_for(lambda: not pathlib.Path(f"/proc/{orphan}").exists(), "the orphan to be reaped", timeout=60)
    finally:
        code, text = stop_serve(state)
    assert code == 0, text[-3000:]


def test_a_model_py_that_touches_a_device_or_starts_threads_gets_execd_workers(tmp_path):
    """The zygote refuses to fork, the log says why, and the model serves
    from exec'd workers. A device is simulated on the CPU: a file named in
    HEARTH_ZYGOTE_DEVICE_FILES counts as one, as /dev/nvidia* does."""
    marker = tmp_path / "fake-gpu"
    marker.write_text("")
    root = tmp_path / "repo"
    write_model(root, "device", config(count=1),
                f"DEVICE = open({str(marker)!r})  # a context, as far as the zygote can tell\n" + MODEL_PY)
    write_model(root, "threads", config(count=1),
                "import threading, time\n"
                "threading.Thread(target=time.sleep, args=(3600,), daemon=True, name='poller').start()\n"
                + MODEL_PY)
    env = dict(os.environ, HEARTH_ZYGOTE_DEVICE_FILES=str(marker))
    state = start_serve(tmp_path, root, env=env)
    try:
        wait_for(lambda: ready_pids(state["log"], "device") and ready_pids(state["log"], "threads"),
                 "both models' workers ready", timeout=60)
        text = state["log"].read_text()
        assert re.search(r"device: its workers are exec'd, not forked from a zygote: the zygote refused to fork "
                         rf"workers: descriptor \d+ is open on {re.escape(str(marker))}", text), text[-3000:]
        assert re.search(r"threads: its workers are exec'd, not forked from a zygote: the zygote refused to fork "
                         r"workers: 1 Python threads run in it \(poller\)", text), text[-3000:]
        for model in ("device", "threads"):
            line = re.search(rf"{model} worker 0 ready: pid \d+ on cpu \((.*)\)", text).group(1)
            assert "forked" not in line and "start: interpreter" in line, line
            w = read_safetensors(root / model / "1" / "model.safetensors")["weight"]
            np.testing.assert_allclose(ask(state["url"], model, np.ones((1, N), np.float32)), [w.sum()], rtol=1e-5)
    finally:
        code, text = stop_serve(state)
    assert code == 0, text[-3000:]
