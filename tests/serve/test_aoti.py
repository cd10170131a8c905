"""`backend: aoti` under `hearth serve`: an AOTInductor package exported by
`python3 -m hearth.aoti export`, run by hearth-worker through
libhearth_backend_aoti.so on the store's one copy of its constants.

Where hearth was built without libtorch (CI: Debian's torch 1.13 has no
AOTInductor) only the first test runs: an aoti model fails alone, saying
why. The others need the library and a torch >= 2.6 (the GPU machine), and
skip saying so otherwise.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import requests

from cuda_driver import Cuda
from serve_support import CLI, ON_GPU, infer_json, start_serve, stop_serve, wait_for


ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = pathlib.Path(CLI).resolve().parent / "libhearth_backend_aoti.so"

MODEL_PY = """
import torch


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(64, 128)
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))


def build():
    torch.manual_seed(7)
    return Mlp()
"""


GATHER_PY = """
import torch


class Gather(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(1024, 16))

    def forward(self, index):
        return self.table[index.squeeze(-1)]


def build():
    torch.manual_seed(3)
    return Gather()
"""


def torch_missing():
    try:
        import torch
    except ImportError:
        return "torch is not installed for this interpreter"
    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 6) or not hasattr(torch._inductor, "aoti_compile_and_package"):
        return f"torch {torch.__version__} has no AOTInductor packages (needs >= 2.6)"
    if not LIBRARY.exists():
        return f"{LIBRARY} was not built (configure with -DHEARTH_TORCH=ON)"
    return None


def failed(url, model):
    r = requests.get(f"{url}/v2/models/{model}/ready")
    return r.text if r.status_code == 503 and "no worker could start" in r.text else None


def test_an_aoti_model_without_the_library_fails_alone_saying_why(tmp_path):
    if LIBRARY.exists():
        pytest.skip(f"{LIBRARY} is built here")
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", "8", "--seed", "1",
                    "--out", str(repo / "m" / "1" / "model.safetensors")], check=True, capture_output=True)
    (repo / "m" / "1" / "model.pt2").write_bytes(b"not a package")
    (repo / "m" / "config.yaml").write_text("backend: aoti\nmax_batch_size: 4\ninstance_group:\n"
                                            "  - {count: 1, kind: KIND_CPU}\n")
    (repo / "s" / "1").mkdir(parents=True)
    shutil.copy(repo / "m" / "1" / "model.safetensors", repo / "s" / "1" / "model.safetensors")
    (repo / "s" / "config.yaml").write_text("backend: scale\nmax_batch_size: 4\ninstance_group:\n"
                                            "  - {count: 1, kind: KIND_CPU}\n")
    state = start_serve(tmp_path, repo)
    try:
        text = wait_for(lambda: failed(state["url"], "m"), "the aoti model to fail", timeout=60)
        assert "libhearth_backend_aoti.so" in text and "-DHEARTH_TORCH=ON" in text, text
        assert requests.get(f"{state['url']}/v2/models/s/ready").status_code == 200
    finally:
        code, log = stop_serve(state)
    assert code == 0, log[-3000:]


def export(tmp_path, repo, name, device, dynamic="1..32", extra=(), source_text=MODEL_PY, shape="4,64"):
    source = tmp_path / f"{name}_model.py"
    source.write_text(source_text)
    out = repo / name / "1"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "hearth.aoti", "export", f"{source}:build",
                        "--example-input-shape", shape, "--dynamic-batch", dynamic, "--device", device,
                        "--out", str(out), *extra], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def reference(x):
    import torch
    namespace = {}
    exec(MODEL_PY, namespace)
    with torch.no_grad():
        return namespace["build"]()(torch.from_numpy(x)).numpy()


@pytest.fixture(scope="module")
def aoti_served(tmp_path_factory):
    why = torch_missing()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("aoti")
    repo = tmp / "repo"
    devices = ["cpu"] + (["cuda"] if ON_GPU else [])
    for device in devices:
        export(tmp, repo, f"mlp_{device}", device)
    # The same package on another model's weights: every difference listed.
    (repo / "wrong" / "1").mkdir(parents=True)
    shutil.copy(repo / "mlp_cpu" / "1" / "model.pt2", repo / "wrong" / "1" / "model.pt2")
    subprocess.run([CLI, "make-model", "mlp", "--dims", "64,100,10", "--seed", "3",
                    "--out", str(repo / "wrong" / "1" / "model.safetensors")], check=True, capture_output=True)
    config = (repo / "mlp_cpu" / "config.yaml").read_text()
    (repo / "wrong" / "config.yaml").write_text(re.sub(r"^name: .*$", "name: wrong", config, flags=re.M))
    # A max_batch_size past the package's batch range.
    shutil.copytree(repo / "mlp_cpu" / "1", repo / "toobig" / "1")
    (repo / "toobig" / "config.yaml").write_text(re.sub(r"^name: .*$", "name: toobig", re.sub(
        r"^max_batch_size: 32.*$", "max_batch_size: 64", config, flags=re.M), flags=re.M))
    if ON_GPU:
        # Fault injection on a CUDA package: a sticky fault before the batch.
        shutil.copytree(repo / "mlp_cuda" / "1", repo / "gpufault" / "1")
        cuda_config = (repo / "mlp_cuda" / "config.yaml").read_text()
        (repo / "gpufault" / "config.yaml").write_text(
            re.sub(r"^parameters: \{(.*)\}$",
                   r"parameters: {\1, fault_injection: {on_value: 12345.0, kind: cuda_illegal_address}}",
                   re.sub(r"^name: .*$", "name: gpufault", cuda_config, flags=re.M), flags=re.M)
            .replace("count: 1", "count: 2"))
        assert "fault_injection" in (repo / "gpufault" / "config.yaml").read_text()
        # A package whose own kernel reads far out of bounds on a bad index.
        export(tmp, repo, "gather", "cuda", source_text=GATHER_PY, shape="4,1",
               extra=("--dtype", "int64", "--workers", "2"))
    state = start_serve(tmp, repo)
    state["devices"] = devices
    yield state
    code, log = stop_serve(state)
    assert code == 0, log[-3000:]


def test_an_exported_package_answers_as_eager_pytorch(aoti_served):
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    want = reference(x)
    for device in aoti_served["devices"]:
        model = f"mlp_{device}"
        meta = requests.get(f"{aoti_served['url']}/v2/models/{model}").json()
        assert meta["platform"] == "hearth_aoti", meta
        assert meta["inputs"][0]["shape"] == [-1, 64], meta
        r = infer_json(aoti_served["url"], model, [{"name": meta["inputs"][0]["name"], "datatype": "FP32",
                                                   "shape": [3, 64], "data": x.ravel().tolist()}])
        assert r.status_code == 200, r.text
        got = np.array(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(3, 10)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=model)


def test_every_batch_size_in_the_range_runs(aoti_served):
    model = f"mlp_{aoti_served['devices'][-1]}"
    name = requests.get(f"{aoti_served['url']}/v2/models/{model}").json()["inputs"][0]["name"]
    for rows in (1, 7, 32):
        x = np.ones((rows, 64), dtype=np.float32)
        r = infer_json(aoti_served["url"], model, [{"name": name, "datatype": "FP32", "shape": [rows, 64],
                                                   "data": x.ravel().tolist()}])
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["shape"] == [rows, 10]


def test_constants_that_are_not_the_stores_tensors_are_all_listed(aoti_served):
    text = wait_for(lambda: failed(aoti_served["url"], "wrong"), "the mismatched model to fail", timeout=120)
    assert "encoder.weight" in text and "[100,64]" in text and "[128,64]" in text, text


def test_a_max_batch_size_past_the_package_range_is_refused(aoti_served):
    text = wait_for(lambda: failed(aoti_served["url"], "toobig"), "toobig to fail", timeout=120)
    assert "max_batch_size 64" in text and "[1, 32]" in text, text


def restarts(url, model):
    total = 0.0
    for line in requests.get(f"{url}/metrics").text.splitlines():
        if line.startswith("hearth_worker_restarts{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_ready(url, model):
    wait_for(lambda: requests.get(f"{url}/v2/models/{model}/ready").status_code == 200,
             f"{model} to be ready", timeout=120)


def test_fault_injection_on_a_cuda_package_fails_the_poison_alone(aoti_served):
    if "cuda" not in aoti_served["devices"]:
        pytest.skip("cuda_illegal_address needs a GPU worker (HEARTH_TEST_DEVICE=cuda)")
    url = aoti_served["url"]
    wait_ready(url, "gpufault")
    name = requests.get(f"{url}/v2/models/gpufault").json()["inputs"][0]["name"]
    good = np.random.default_rng(9).standard_normal((2, 64)).astype(np.float32)
    bad = good.copy()
    bad[1, 5] = 12345.0
    ask = lambda x: infer_json(url, "gpufault", [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                                                  "data": x.ravel().tolist()}])
    before = restarts(url, "gpufault")
    r = ask(bad)
    assert r.status_code == 500 and "poison" in r.json()["error"], r.text
    wait_for(lambda: restarts(url, "gpufault") > before, "a gpufault worker to be replaced")
    wait_ready(url, "gpufault")
    after = ask(good)
    assert after.status_code == 200, after.text
    got = np.array(after.json()["outputs"][0]["data"], dtype=np.float32).reshape(2, 10)
    np.testing.assert_allclose(got, reference(good), rtol=1e-4, atol=1e-4)


def test_a_package_kernel_that_faults_replaces_the_worker(aoti_served):
    """An index far out of range makes the package's own gather kernel read
    unmapped device memory: a sticky CUDA error. The worker exits and is
    replaced; the request fails; good requests are answered after it."""
    if "cuda" not in aoti_served["devices"]:
        pytest.skip("a faulting CUDA kernel needs a GPU worker (HEARTH_TEST_DEVICE=cuda)")
    url = aoti_served["url"]
    wait_ready(url, "gather")
    meta = requests.get(f"{url}/v2/models/gather").json()
    assert meta["inputs"][0]["datatype"] == "INT64", meta
    name = meta["inputs"][0]["name"]
    ask = lambda idx: infer_json(url, "gather", [{"name": name, "datatype": "INT64", "shape": [len(idx), 1],
                                                "data": idx}])
    namespace = {}
    exec(GATHER_PY, namespace)
    table = namespace["build"]().table.detach().numpy()
    before = restarts(url, "gather")
    r = ask([1, 1 << 40])
    assert r.status_code == 500, r.text
    wait_for(lambda: restarts(url, "gather") > before, "a gather worker to be replaced")
    wait_ready(url, "gather")
    after = ask([3, 1023])
    assert after.status_code == 200, after.text
    got = np.array(after.json()["outputs"][0]["data"], dtype=np.float32).reshape(2, 16)
    np.testing.assert_allclose(got, table[[3, 1023]], rtol=1e-6)


def test_a_cuda_package_reports_its_own_device_buffers(aoti_served):
    """What the package's kernels allocate for themselves (libtorch's caching
    allocator, after the first run) is the worker's device memory."""
    if "cuda" not in aoti_served["devices"]:
        pytest.skip("needs a GPU worker (HEARTH_TEST_DEVICE=cuda)")
    url = aoti_served["url"]
    wait_ready(url, "mlp_cuda")
    values = [float(line.rsplit(" ", 1)[1]) for line in requests.get(f"{url}/metrics").text.splitlines()
              if line.startswith("hearth_worker_device_memory_bytes{") and 'model="mlp_cuda"' in line]
    assert values and all(v > 0 for v in values), values


def test_a_cuda_package_reads_and_writes_cuda_shared_memory(aoti_served):
    """A client's device memory as the package's input and output: the
    package reads the region where it lies and its output is copied device
    to device into the other; the answer is eager PyTorch's."""
    if "cuda" not in aoti_served["devices"]:
        pytest.skip("CUDA shared memory needs a GPU (HEARTH_TEST_DEVICE=cuda)")
    import base64
    url, cuda = aoti_served["url"], Cuda(0)
    name = requests.get(f"{url}/v2/models/mlp_cuda").json()["inputs"][0]["name"]
    out_name = requests.get(f"{url}/v2/models/mlp_cuda").json()["outputs"][0]["name"]
    x = np.random.default_rng(12).standard_normal((3, 64)).astype(np.float32)
    ptrs = [cuda.alloc(1 << 20), cuda.alloc(1 << 20)]
    try:
        cuda.put(ptrs[0] + 256, x)
        for region, ptr in zip(("aoti-in", "aoti-out"), ptrs):
            r = requests.post(f"{url}/v2/cudasharedmemory/region/{region}/register",
                              json={"raw_handle": {"b64": base64.b64encode(cuda.handle(ptr)).decode()},
                                    "device_id": 0, "byte_size": 1 << 20}, timeout=30)
            assert r.status_code == 200, r.text
        body = {"inputs": [{"name": name, "datatype": "FP32", "shape": [3, 64],
                            "parameters": {"shared_memory_region": "aoti-in", "shared_memory_offset": 256,
                                           "shared_memory_byte_size": x.nbytes}}],
                "outputs": [{"name": out_name, "parameters": {"shared_memory_region": "aoti-out",
                                                              "shared_memory_offset": 0,
                                                              "shared_memory_byte_size": 3 * 10 * 4}}]}
        r = requests.post(f"{url}/v2/models/mlp_cuda/infer", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = cuda.get(ptrs[1], 3 * 10 * 4).view("<f4").reshape(3, 10)
        np.testing.assert_allclose(got, reference(x), rtol=1e-4, atol=1e-4)
    finally:
        requests.post(f"{url}/v2/cudasharedmemory/unregister", timeout=30)
        for ptr in ptrs:
            cuda.free(ptr)
