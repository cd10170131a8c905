"""`backend: python` under `hearth serve`: a model.py on the store's one copy
of the weights, with batching, BYTES and variable dimensions, errors that
fail only the requests that cause them, crashes that are retried, and
models whose code or interpreter is broken failing alone with the reason.

The workers run /usr/bin/python3 (this interpreter: numpy, and torch where
it is installed); the model code uses NumPy only.
"""

import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import requests

import serve_support
from serve_support import (CLI, ON_GPU, infer_json, metrics, mlp_reference, read_safetensors, split_binary,
                           start_serve, stop_serve, wait_for)


N = 6

SCALE_PY = """
import numpy as np

class Model:
    def initialize(self, args):
        self.args = args
        self.w = np.asarray(args["weights"]["weight"])
        assert args["model_config"]["name"] == args["model_name"]

    def execute(self, inputs):
        x = np.asarray(inputs["x"])
        if (x == 13).any():
            raise ValueError("thirteen is not allowed")
        if (x == 666).any():
            import os
            os._exit(9)
        if (x == 7).any():
            return {"y": np.zeros((x.shape[0], 1), dtype=np.float64)}
        if (x == 8).any():
            return {"y": np.zeros((x.shape[0], 2), dtype=np.float32)}
        return {"y": (x * self.w).sum(axis=1, keepdims=True).astype(np.float32)}

    def finalize(self):
        import os
        open(os.path.join(self.args["model_repository"], f"finalized-{os.getpid()}"), "w").close()
"""

TEXT_PY = """
import numpy as np

class Model:
    def initialize(self, args):
        self.repo = args["model_repository"]

    def execute(self, inputs):
        text = inputs["text"]
        upper = np.array([[t.upper() + b"!" for t in row] for row in text], dtype=object)
        lengths = np.array([[len(t) for t in row] for row in text], dtype=np.int64)
        return {"upper": upper, "length": lengths}
"""

VAR_PY = """
import numpy as np

class Model:
    def initialize(self, args):
        self.batches = 0

    def execute(self, inputs):
        x = np.asarray(inputs["x"])
        self.batches += 1
        # A row per request, its length as given, and the batch it ran in.
        return {"y": x * 2, "rows": np.full((x.shape[0], 1), x.shape[0], dtype=np.int32)}
"""


def scale_config(extra=""):
    return f"""backend: python
max_batch_size: 8
input:
  - {{name: x, data_type: TYPE_FP32, dims: [{N}]}}
output:
  - {{name: y, data_type: TYPE_FP32, dims: [1]}}
instance_group:
  - {{count: 2, kind: KIND_CPU}}
dynamic_batching:
  max_queue_delay_microseconds: 200000
  preferred_batch_size: [4]
parameters:
  python: {sys.executable}
""" + extra


def write_model(root, name, config, code, weights=True):
    serve_support.write_model(root, name, config, code, dims=N, seed=6, weights=weights)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("python_backend")
    root = tmp / "repo"
    write_model(root, "pyscale", scale_config(), SCALE_PY)
    write_model(root, "text", f"""backend: python
max_batch_size: 4
input:
  - {{name: text, data_type: TYPE_STRING, dims: [2]}}
output:
  - {{name: upper, data_type: TYPE_STRING, dims: [2]}}
  - {{name: length, data_type: TYPE_INT64, dims: [2]}}
instance_group:
  - {{count: 1, kind: KIND_CPU}}
parameters:
  python: {sys.executable}
""", TEXT_PY)
    write_model(root, "var", f"""backend: python
max_batch_size: 8
input:
  - {{name: x, data_type: TYPE_FP32, dims: [-1]}}
output:
  - {{name: y, data_type: TYPE_FP32, dims: [-1]}}
  - {{name: rows, data_type: TYPE_INT32, dims: [1]}}
instance_group:
  - {{count: 1, kind: KIND_CPU}}
dynamic_batching:
  max_queue_delay_microseconds: 300000
  preferred_batch_size: [8]
parameters:
  python: {sys.executable}
""", VAR_PY)
    write_model(root, "noinit", scale_config(), SCALE_PY.replace(
        "self.args = args", "raise RuntimeError('the model cannot find its vocabulary')"))
    write_model(root, "syntax", scale_config(), "class Model(:\n")
    write_model(root, "nocode", scale_config(), None)
    write_model(root, "badpython", scale_config().replace(sys.executable, "/nonexistent/python9"),
                SCALE_PY)
    write_model(root, "nokind", scale_config().replace("backend: python", "backend: tensorflow"),
                SCALE_PY)
    # Returns its input: a view of the slot, read after the slot has grown.
    write_model(root, "echo", f"""backend: python
max_batch_size: 2
input:
  - {{name: x, data_type: TYPE_FP32, dims: [-1]}}
output:
  - {{name: y, data_type: TYPE_FP32, dims: [-1]}}
instance_group:
  - {{count: 1, kind: KIND_CPU}}
parameters:
  python: {sys.executable}
""", "class Model:\n    def initialize(self, args):\n        pass\n\n"
                "    def execute(self, inputs):\n        return {'y': inputs['x']}\n")
    # Fault injection: a worker that segfaults on an input of 12345.
    write_model(root, "pyfaulty", scale_config("  fault_injection: {on_value: 12345.0, kind: segv}\n"),
                SCALE_PY)
    # A built-in backend given another backend's weights.
    write_model(root, "wrongweights", "backend: mlp\nmax_batch_size: 2\ninstance_group:\n"
                "  - {count: 1, kind: KIND_CPU}\n", None)
    # A built-in backend with no input or output in its config: the
    # worker's signature is taken.
    write_model(root, "bare", "backend: scale\nmax_batch_size: 2\ninstance_group:\n"
                "  - {count: 1, kind: KIND_CPU}\n", None)
    state = start_serve(tmp, root)
    state["weights"] = np.arange(N, dtype=np.float32)
    state["w"] = read_safetensors(root / "pyscale" / "1" / "model.safetensors")["weight"]
    yield state
    code, text = stop_serve(state)
    assert code == 0, text[-3000:]
    # An orderly shutdown runs finalize() in the workers that are up.
    assert list((root / "pyscale" / "1").glob("finalized-*")), "no worker ran finalize()"


def test_a_python_model_answers_from_the_stores_weights(served):
    x = np.random.default_rng(1).standard_normal((3, N)).astype(np.float32)
    r = infer_json(served["url"], "pyscale", [{"name": "x", "datatype": "FP32", "shape": [3, N],
                                                "data": x.ravel().tolist()}])
    assert r.status_code == 200, r.text
    y = np.array(r.json()["outputs"][0]["data"], dtype=np.float32)
    np.testing.assert_allclose(y, x @ served["w"], rtol=1e-5)
    meta = requests.get(f"{served['url']}/v2/models/pyscale").json()
    assert meta["platform"] == "hearth_python"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, N]}]


READY_LINE = re.compile(r"pyscale worker \d+ ready: pid (\d+) on .*?; start: ([^)]*)\) in (\d+) ms")
PHASES = ["interpreter", "setup", "imports", "model.py", "attach", "tensors", "initialize"]
# A worker forked from the zygote (the default): its imports and model.py are the zygote's.
FORKED_PHASES = ["fork", "setup", "attach", "tensors", "initialize"]


def test_a_python_workers_start_is_timed_phase_by_phase(served):
    """Each Python worker's ready line lists the phases of its start, in
    order; together they fit in the start the server measured (from the
    spawn to the ready message; the first phase, from the kernel's start
    time in clock ticks, may be up to one tick, 10 ms, more). The workers are
    forked from the model's zygote; test_python_zygote.py times exec'd ones.
    Its first batch's time is logged once it has run one."""
    x = np.ones((1, N), np.float32)
    r = infer_json(served["url"], "pyscale", [{"name": "x", "datatype": "FP32", "shape": [1, N],
                                                "data": x.ravel().tolist()}])
    assert r.status_code == 200, r.text
    text = served["log"].read_text()
    lines = READY_LINE.findall(text)
    assert lines, text[-3000:]
    for pid, phases, spawn_to_ready_ms in lines:
        named = [p.rsplit(" ", 2) for p in phases.split(", ")]
        assert [n for n, _, unit in named] == FORKED_PHASES and {unit for _, _, unit in named} == {"s"}, phases
        seconds = [float(v) for _, v, _ in named]
        assert all(v >= 0 for v in seconds), phases
        assert sum(seconds) <= int(spawn_to_ready_ms) / 1000 + 0.02, (phases, spawn_to_ready_ms)
    assert re.search(r"pid \d+: its first batch ran in \d+\.\d{3} s", text), text[-3000:]
    # /metrics: each phase's starts and summed time, for the Python workers
    # and for the C++ ones (model "bare": the scale backend).
    values = metrics(served["url"])
    for model, phases in (("pyscale", FORKED_PHASES), ("bare", ["exec", "setup", "attach", "backend"])):
        for phase in phases:
            labels = f'{{model="{model}",phase="{phase}"}}'
            assert values.get("hearth_worker_start_phase_count" + labels, 0) >= 1, (model, phase)
            assert values.get("hearth_worker_start_phase_duration_us" + labels, -1) >= 0, (model, phase)


def test_a_config_without_inputs_and_outputs_takes_the_backends(served):
    meta = requests.get(f"{served['url']}/v2/models/bare").json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, N]}], meta
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}], meta
    x = np.ones((2, N), dtype=np.float32)
    r = infer_json(served["url"], "bare", [{"name": "x", "datatype": "FP32", "shape": [2, N],
                                            "data": x.ravel().tolist()}])
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["outputs"][0]["data"], x @ served["w"], rtol=1e-5)


def test_an_input_returned_as_output_survives_the_slot_growing(served):
    """The output (variable size, placed by the worker) does not fit the room
    the slot has, so the slot grows while the worker holds views of the
    inputs in the old mapping: the answer must still be the input."""
    x = np.arange(600000, dtype=np.float32)[None, :]
    r = requests.post(f"{served['url']}/v2/models/echo/infer", timeout=60, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 600000], "data": x.ravel().tolist()}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}]})
    assert r.status_code == 200, r.text[:500]
    _, parts = split_binary(r)
    np.testing.assert_array_equal(np.frombuffer(parts["y"], dtype="<f4"), x.ravel())


def one(url, x, timeout=120):
    # Generous: a request that crashes workers waits for Python workers to
    # start again (importing torch), which on a loaded machine takes seconds.
    return requests.post(f"{url}/v2/models/pyscale/infer", timeout=timeout, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]})


def test_an_exception_fails_only_the_request_that_causes_it(served):
    """Four requests form one batch (preferred size 4, 200 ms to fill); one
    of them raises in execute(): it fails with the exception's last line, the
    other three are answered right, and the worker serves on."""
    xs = [np.full((1, N), v, dtype=np.float32) for v in (1, 2, 13, 3)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda x: one(served["url"], x), xs))
    for x, r in zip(xs, rs):
        if x[0, 0] == 13:
            assert r.status_code == 500, r.text
            assert "ValueError: thirteen is not allowed" in r.json()["error"]
        else:
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["outputs"][0]["data"], x @ served["w"], rtol=1e-5)
    assert one(served["url"], np.ones((2, N), dtype=np.float32)).status_code == 200


def test_wrong_outputs_fail_the_batch_naming_the_output(served):
    r = one(served["url"], np.full((1, N), 7, dtype=np.float32))
    assert r.status_code == 400, r.text
    assert "output 'y'" in r.json()["error"] and "float64" in r.json()["error"], r.text
    r = one(served["url"], np.full((1, N), 8, dtype=np.float32))
    assert r.status_code == 400, r.text
    assert "'y'" in r.json()["error"] and "[1,2]" in r.json()["error"], r.text
    assert one(served["url"], np.ones((1, N), dtype=np.float32)).status_code == 200


def test_a_crash_in_model_code_is_retried_then_refused_as_poison(served):
    pids = lambda: set(p for p in subprocess.run(  # noqa: E731
        ["pgrep", "-P", str(served["proc"].pid)], capture_output=True, text=True).stdout.split())
    r = one(served["url"], np.full((1, N), 666, dtype=np.float32))
    assert r.status_code == 500, r.text
    assert "poison batch" in r.json()["error"]
    wait_for(lambda: requests.get(f"{served['url']}/v2/models/pyscale/ready").status_code == 200,
             "pyscale ready again", timeout=120)
    assert one(served["url"], np.ones((1, N), dtype=np.float32)).status_code == 200
    assert pids()


def test_fault_injection_crashes_a_python_worker_and_only_that_request_fails(served):
    url = f"{served['url']}/v2/models/pyfaulty/infer"

    def ask(v):
        x = np.full((1, N), v, dtype=np.float32)
        return requests.post(url, timeout=120, json={"inputs": [{"name": "x", "datatype": "FP32",
                                                                  "shape": [1, N], "data": x.ravel().tolist()}]})

    r = ask(12345.0)
    assert r.status_code == 500 and "poison batch" in r.json()["error"], r.text
    wait_for(lambda: requests.get(f"{served['url']}/v2/models/pyfaulty/ready").status_code == 200,
             "pyfaulty ready again", timeout=120)
    r = ask(1.0)
    assert r.status_code == 200, r.text


def test_bytes_tensors_travel_as_strings_and_binary(served):
    r = infer_json(served["url"], "text", [{"name": "text", "datatype": "BYTES", "shape": [2, 2],
                                            "data": ["ab", "", "\u00e9t\u00e9", "x y"]}])
    assert r.status_code == 200, r.text
    outs = {o["name"]: o for o in r.json()["outputs"]}
    assert outs["upper"]["datatype"] == "BYTES" and outs["upper"]["shape"] == [2, 2]
    assert outs["upper"]["data"] == ["AB!", "!", "\u00e9T\u00e9!", "X Y!"]
    assert outs["length"]["data"] == [2, 0, 5, 3]


def test_variable_dimensions_and_only_same_shapes_batch_together(served):
    url = served["url"]

    def ask(n):
        x = np.arange(n, dtype=np.float32)[None, :]
        r = infer_json(url, "var", [{"name": "x", "datatype": "FP32", "shape": [1, n],
                                     "data": x.ravel().tolist()}])
        assert r.status_code == 200, r.text
        outs = {o["name"]: o for o in r.json()["outputs"]}
        assert outs["y"]["shape"] == [1, n]
        np.testing.assert_allclose(outs["y"]["data"], (x * 2).ravel())
        return outs["rows"]["data"][0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        rows = list(pool.map(ask, [3, 5, 3, 5, 3, 5, 3, 5]))
    # Each batch held requests of one length only, so never more than the 4 of a length.
    assert all(1 <= r <= 4 for r in rows), rows
    # A large variable output makes the slot grow while the worker waits.
    assert ask(300000) == 1


def test_broken_models_fail_alone_with_their_reason(served):
    url = served["url"]
    cases = {
        "noinit": "RuntimeError: the model cannot find its vocabulary",
        "syntax": "SyntaxError",
        "nocode": "no model.py",
        "badpython": "/nonexistent/python9",
        "nokind": "unknown backend kind 'tensorflow'",
        "wrongweights": "encoder.weight",
    }
    def failed(model):
        r = requests.get(f"{url}/v2/models/{model}/ready")
        # (a Response is false for a 503: return its text)
        return r.text if r.status_code == 503 and "no worker could start" in r.text else None

    for model, why in cases.items():
        text = wait_for(lambda m=model: failed(m), f"{model} to fail", timeout=60)
        assert why in text, f"{model}: {text}"
    assert one(url, np.ones((1, N), dtype=np.float32)).status_code == 200


def test_the_examples_repository_serves_the_seeds_models(tmp_path):
    """examples/python_backend: seed 000's model and seed 004's MLP (small
    dims here) as model.py files in plain PyTorch, answering as NumPy does."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("the examples' model.py files use torch, which this python3 lacks")
    root = pathlib.Path(__file__).resolve().parents[2]
    repo = tmp_path / "repo"
    env = dict(os.environ, MLP_DIMS="32,64,10", WORKERS="2", HEARTH=CLI, PYTHON=sys.executable)
    subprocess.run(["sh", str(root / "examples" / "python_backend" / "make_repository.sh"), str(repo),
                    "KIND_GPU" if ON_GPU else "KIND_CPU"], check=True, capture_output=True, env=env)
    state = start_serve(tmp_path, repo)
    try:
        x = np.random.default_rng(3).standard_normal((3, 32)).astype(np.float32)
        r = infer_json(state["url"], "mlp", [{"name": "input", "datatype": "FP32", "shape": [3, 32],
                                              "data": x.ravel().tolist()}])
        assert r.status_code == 200, r.text
        outs = {o["name"]: o for o in r.json()["outputs"]}
        w = read_safetensors(repo / "mlp" / "1" / "model.safetensors")
        logits, argmax = mlp_reference(w, x)
        np.testing.assert_allclose(np.array(outs["logits"]["data"]).reshape(3, 10), logits,
                                   rtol=1e-4, atol=1e-4)
        assert outs["argmax"]["data"] == argmax.ravel().tolist()
        v = np.ones((2, 500), dtype=np.float32)
        r = infer_json(state["url"], "scale", [{"name": "x", "datatype": "FP32", "shape": [2, 500],
                                                "data": v.ravel().tolist()}])
        assert r.status_code == 200, r.text
        ws = read_safetensors(repo / "scale" / "1" / "model.safetensors")["weight"]
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], [ws.sum()] * 2, rtol=1e-4)
    finally:
        code, text = stop_serve(state)
    assert code == 0, text[-3000:]


STANDBY_PY = """
import os

import numpy as np

# A standby imports this before it is put to work: the mark says it did.
open(os.path.join(os.path.dirname(__file__), f"imported-{os.getpid()}"), "w").close()


class Model:
    def initialize(self, args):
        open(os.path.join(args["model_repository"], f"initialized-{os.getpid()}"), "w").close()
        self.w = np.asarray(args["weights"]["weight"])

    def execute(self, inputs):
        x = np.asarray(inputs["x"])
        return {"y": (x * self.w).sum(axis=1, keepdims=True).astype(np.float32)}
"""


def test_a_python_standby_imports_the_model_and_takes_over_from_a_worker_that_dies(tmp_path):
    """parameters.standby_workers for backend: python: the standby process has
    imported model.py (and torch, where installed) but not initialized it nor
    mapped the weights; a SIGKILLed worker's replacement is that process."""
    import re
    import signal
    root = tmp_path / "repo"
    # Exec'd workers: a standby forked from the zygote has nothing left to import.
    config = scale_config("  standby_workers: '1'\n  zygote: 'false'\n").replace("count: 2", "count: 1")
    write_model(root, "pystandby", config, STANDBY_PY)
    version = root / "pystandby" / "1"
    state = start_serve(tmp_path, root)
    try:
        def children():
            out = []
            for task in pathlib.Path(f"/proc/{state['proc'].pid}/task").iterdir():
                try:
                    out += [int(c) for c in (task / "children").read_text().split()]
                except (FileNotFoundError, ProcessLookupError):
                    pass
            return out

        def ready_pids():
            return [int(p) for p in re.findall(r"pystandby worker 0 ready: pid (\d+)", state["log"].read_text())]

        def standby():
            for pid in children():
                try:
                    argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except FileNotFoundError:
                    continue
                if b"--standby" in argv and pid not in ready_pids() and (version / f"imported-{pid}").exists():
                    return pid
            return None

        worker = ready_pids()[-1]
        spare = wait_for(standby, "a standby that has imported model.py", timeout=60)
        assert not (version / f"initialized-{spare}").exists(), "the standby initialized the model"
        assert "hearth-arena" not in pathlib.Path(f"/proc/{spare}/maps").read_text(), "a standby maps the weights"
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: ready_pids()[-1] == spare, "the standby to take over", timeout=60)
        assert re.search(rf"ready: pid {spare} on .*a standby, loaded \d+ ms before", state["log"].read_text())
        assert (version / f"initialized-{spare}").exists()
        x = np.arange(N, dtype=np.float32).reshape(1, N)
        r = infer_json(state["url"], "pystandby", [{"name": "x", "datatype": "FP32", "shape": [1, N],
                                                     "data": x.ravel().tolist()}])
        assert r.status_code == 200, r.text
        w = read_safetensors(version / "model.safetensors")["weight"]
        assert abs(r.json()["outputs"][0]["data"][0] - float((x * w).sum())) < 1e-3
    finally:
        code, text = stop_serve(state)
    assert code == 0, text[-3000:]
