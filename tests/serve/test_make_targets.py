"""The README's first commands, as a new user runs them: `make serve`'s script
(scripts/serve, the script itself, not a copy) on a fresh repository directory
must bring every model of its demo up and answer them; `make demo`'s
(scripts/demo) must attach the demo checkpoint from four processes and find
every checksum equal to the file's.

Paths: $HEARTH_CLI (default build/bin/hearth); the scripts get its build
directory, as `make` gives them $(BUILD).
"""

import os
import pathlib
import re
import signal
import subprocess

import numpy as np
import requests

from serve_support import CLI, wait_for


ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(CLI).resolve().parent.parent


def test_make_serve_serves_every_model_of_its_demo(tmp_path):
    env = dict(os.environ, PORT="0", GRPC_PORT="0", REPO=str(tmp_path / "repo"))
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "serve"), str(BUILD)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def ready():
                if proc.poll() is not None:
                    raise AssertionError("scripts/serve exited:\n" + log_path.read_text()[-4000:])
                return re.search(r"ready on http://127\.0\.0\.1:(\d+) \((.*)\)", log_path.read_text())
            m = wait_for(ready, "scripts/serve's ready line", timeout=600)
            text = log_path.read_text()
            # The script ends in `exec hearth serve`: the process is the server.
            assert os.path.basename(os.readlink(f"/proc/{proc.pid}/exe")) == "hearth"
            # Every thread (the CUDA driver's too) leaves SIGTERM to the one
            # that waits for it in sigwait (the kernel unblocks it there): no
            # other may take it and end the process.
            takers = []
            for task in pathlib.Path(f"/proc/{proc.pid}/task").iterdir():
                status = (task / "status").read_text()
                blocked = int(re.search(r"SigBlk:\s*([0-9a-f]+)", status).group(1), 16)
                if not blocked & (1 << (signal.SIGTERM - 1)):
                    takers.append(task.name)
            assert len(takers) <= 1, f"threads that would take SIGTERM: {takers}"
            assert m.group(2) == "all models ready", text[-4000:]
            assert "is not served" not in text, text[-4000:]
            url = f"http://127.0.0.1:{m.group(1)}"
            index = requests.post(f"{url}/v2/repository/index", json={}, timeout=10).json()
            assert sorted((e["name"], e["state"]) for e in index) == [("mlp", "READY"), ("scale", "READY")], index
            for model in ("mlp", "scale"):
                meta = requests.get(f"{url}/v2/models/{model}", timeout=10).json()
                inputs = [{"name": i["name"], "datatype": i["datatype"], "shape": [1, *i["shape"][1:]],
                           "data": np.ones(int(np.prod(i["shape"][1:]))).tolist()} for i in meta["inputs"]]
                r = requests.post(f"{url}/v2/models/{model}/infer", json={"inputs": inputs}, timeout=60)
                assert r.status_code == 200, f"{model}: {r.status_code} {r.text}"
                outputs = {o["name"]: o for o in r.json()["outputs"]}
                assert set(outputs) == {o["name"] for o in meta["outputs"]}, r.text
                for o in outputs.values():
                    assert len(o["data"]) == int(np.prod(o["shape"])) and np.isfinite(o["data"]).all(), o
            # The curl line the script prints answers as printed (the port aside).
            curl = re.search(r"curl -s localhost:\d+(/v2/models/scale/infer) -d '(.*)'", text)
            assert curl, text[-4000:]
            r = requests.post(url + curl.group(1), data=curl.group(2), timeout=60)
            assert r.status_code == 200 and r.json()["outputs"][0]["name"] == "y", r.text
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    assert code == 0, log_path.read_text()[-4000:]


def test_make_demo_attaches_from_four_processes_with_equal_checksums():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "demo"), str(BUILD)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "== all 4 checksums match the file" in r.stdout, r.stdout[-4000:]
    assert r.stdout.count("checksum ok") == 4, r.stdout[-4000:]
