"""CUDA shared memory (Triton's cudasharedmemory extension) on `hearth serve`,
over REST (`requests`, Triton's register body) and gRPC (grpcio with stubs
from proto/), with no GPU needed: a server whose --device is cuda:0 takes
registrations (the handle is opaque to the server: a worker opens it at
first use), lists and unregisters them, refuses every malformed one with
the same error on both protocols, shares names and the region limit with
system shared memory, and refuses a request that names a region for a
model whose workers are on the host. A server on the host refuses CUDA
regions. Copies to and from a real region need a GPU: they are tested on
the GPU machine.

Paths: $HEARTH_CLI (default build/bin/hearth). The gRPC cases skip, saying
why, when this hearth was built without gRPC or /usr/bin/python3 lacks
grpcio and grpc_tools.
"""

import base64
import os
import pathlib
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import requests

from serve_support import CLI, SCALE_N, scale_config, start_serve, stop_serve


HANDLE = bytes(range(7, 7 + 64))  # what cudaIpcGetMemHandle would give: 64 opaque bytes


def error_of(r):
    try:
        return r.json().get("error", "")
    except ValueError:
        return r.text


def write_repository(root):
    (root / "scale" / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "6",
                    "--out", str(root / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    (root / "scale" / "config.yaml").write_text(scale_config(count=1, kind="KIND_CPU"))


def grpc_port(text):
    m = re.search(r"KServe v2 gRPC on 127\.0\.0\.1:(\d+)", text)
    return int(m.group(1)) if m else None


@pytest.fixture(scope="module")
def servers():
    """Two servers of one CPU model: one with --device cuda:0 (its GPU is
    never touched: the model runs on the host), one with --device cpu."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-cuda-shm-"))
    write_repository(tmp / "repo")
    states = {}
    try:
        for name, device in (("gpu", "cuda:0"), ("cpu", "cpu")):
            states[name] = start_serve(tmp, tmp / "repo", name=name, device=device)
            states[name]["grpc_port"] = grpc_port(states[name]["log"].read_text())
        yield states
    finally:
        codes = {name: stop_serve(s) for name, s in states.items()}
        shutil.rmtree(tmp, ignore_errors=True)
    for name, (code, text) in codes.items():
        assert code == 0, f"{name}: {text[-2000:]}"


@pytest.fixture(scope="module")
def grpc_stubs(servers):
    """(pb, {server name: stub}); skips when gRPC cannot be driven here."""
    if os.environ.get("HEARTH_GRPC_BUILT", "ON").upper() in ("OFF", "0", "FALSE"):
        pytest.skip("this hearth was built without gRPC")
    grpc = pytest.importorskip("grpc", reason="needs grpcio (Debian: python3-grpcio)")
    pytest.importorskip("grpc_tools", reason="needs grpc_tools (Debian: python3-grpc-tools)")
    import grpc_support  # generates the stubs from proto/
    channels, stubs = [], {}
    for name, s in servers.items():
        assert s["grpc_port"], f"the {name} server did not log its gRPC port"
        channel, stub = grpc_support.connect(s["grpc_port"])
        channels.append(channel)
        stubs[name] = stub
    yield grpc_support.pb, grpc, stubs
    for c in channels:
        c.close()


def rest_register(url, name, handle=HANDLE, device_id=0, byte_size=4096, b64=None, http=requests):
    body = {"raw_handle": {"b64": b64 if b64 is not None else base64.b64encode(handle).decode()},
            "device_id": device_id, "byte_size": byte_size}
    r = http.post(f"{url}/v2/cudasharedmemory/region/{name}/register", json=body, timeout=30)
    return r.status_code, error_of(r) if r.status_code != 200 else r.content


def rest_status(url, name=""):
    path = f"/region/{name}/status" if name else "/status"
    return requests.get(f"{url}/v2/cudasharedmemory{path}", timeout=30)


def rest_unregister(url, name=""):
    path = f"/region/{name}/unregister" if name else "/unregister"
    return requests.post(f"{url}/v2/cudasharedmemory{path}", timeout=30)


class PosixShm:
    """A POSIX shared-memory object of this user, mode 0600, for a system region."""

    def __init__(self, name, size):
        self.key = "/" + name
        self.path = "/dev/shm/" + name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def close(self):
        os.unlink(self.path)


def test_rest_register_status_unregister(servers):
    url = servers["gpu"]["url"]
    try:
        assert rest_register(url, "a", byte_size=4096) == (200, b"")
        assert rest_register(url, "b", handle=bytes(64), byte_size=8) == (200, b"")
        r = rest_status(url)
        assert r.status_code == 200, r.text
        assert sorted(r.json(), key=lambda s: s["name"]) == [
            {"name": "a", "device_id": 0, "byte_size": 4096}, {"name": "b", "device_id": 0, "byte_size": 8}]
        assert rest_status(url, "b").json() == [{"name": "b", "device_id": 0, "byte_size": 8}]
        r = rest_status(url, "zz")
        assert r.status_code == 404 and "no CUDA shared-memory region named 'zz'" in error_of(r), r.text
        code, e = rest_register(url, "a")
        assert code == 400 and "a CUDA shared-memory region named 'a' is registered" in e, e
        assert rest_unregister(url, "a").status_code == 200
        r = rest_unregister(url, "a")
        assert r.status_code == 404 and "'a'" in error_of(r), r.text
        assert [s["name"] for s in rest_status(url).json()] == ["b"]
        # Registered again under a freed name.
        assert rest_register(url, "a", byte_size=16) == (200, b"")
        r = rest_unregister(url)
        assert r.status_code == 200 and r.content == b"", r.text
        assert rest_status(url).json() == []
    finally:
        rest_unregister(url)


@pytest.mark.parametrize("case,fields,says", [
    ("short handle", {"handle": HANDLE[:63]}, "'raw_handle' must be a CUDA IPC handle (cudaIpcMemHandle_t) of 64 "
                                              "bytes, not 63"),
    ("long handle", {"handle": HANDLE + b"x"}, "of 64 bytes, not 65"),
    ("not base64", {"b64": "@@@@"}, "'raw_handle' is not base64"),
    ("unpadded", {"b64": base64.b64encode(HANDLE).decode().rstrip("=")}, "'raw_handle' is not base64"),
    ("negative device", {"device_id": -1}, "device_id -1 is negative"),
    ("unused device", {"device_id": 3}, "device_id 3 is not a GPU this server uses (0)"),
    ("no bytes", {"byte_size": 0}, "byte_size must be 1 to"),
    ("too many bytes", {"byte_size": 1 << 62}, "byte_size must be 1 to"),
])
def test_rest_registration_errors(servers, case, fields, says):
    url = servers["gpu"]["url"]
    code, e = rest_register(url, "bad", **fields)
    assert code == 400 and says in e, (case, code, e)
    assert rest_status(url).json() == [], case


def test_rest_body_errors(servers):
    url = servers["gpu"]["url"] + "/v2/cudasharedmemory/region/bad/register"
    good = {"raw_handle": {"b64": base64.b64encode(HANDLE).decode()}, "device_id": 0, "byte_size": 64}
    for drop, says in (("raw_handle", "'raw_handle' is missing"), ("device_id", "'device_id' is missing"),
                       ("byte_size", "'byte_size' is missing")):
        body = {k: v for k, v in good.items() if k != drop}
        r = requests.post(url, json=body, timeout=30)
        assert r.status_code == 400 and says in error_of(r), r.text
    r = requests.post(url, json={**good, "raw_handle": base64.b64encode(HANDLE).decode()}, timeout=30)
    assert r.status_code == 400 and "'raw_handle' must be" in error_of(r), r.text
    r = requests.post(url, data=b"{", timeout=30)
    assert r.status_code == 400, r.text
    code, e = rest_register(servers["gpu"]["url"], "n" * 257)
    assert code == 400 and "name of 1 to 256 bytes" in e, e
    assert rest_status(servers["gpu"]["url"]).json() == []


def test_names_are_shared_with_system_regions(servers):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here for POSIX shared memory")
    url = servers["gpu"]["url"]
    obj = PosixShm(f"hearth-cuda-shm-{os.getpid()}", 4096)
    try:
        r = requests.post(f"{url}/v2/systemsharedmemory/region/sys/register",
                          json={"key": obj.key, "byte_size": 64}, timeout=30)
        assert r.status_code == 200, r.text
        code, e = rest_register(url, "sys")
        assert code == 400 and "a system shared-memory region named 'sys' is registered" in e, e
        assert rest_register(url, "dev") == (200, b"")
        r = requests.post(f"{url}/v2/systemsharedmemory/region/dev/register",
                          json={"key": obj.key, "byte_size": 64}, timeout=30)
        assert r.status_code == 400 and "a CUDA shared-memory region named 'dev' is registered" in error_of(r)
        # Each kind's status and unregister see only its own regions.
        assert [s["name"] for s in rest_status(url).json()] == ["dev"]
        assert rest_unregister(url, "sys").status_code == 404
        assert rest_unregister(url).status_code == 200
        system = requests.get(f"{url}/v2/systemsharedmemory/status", timeout=30).json()
        assert [s["name"] for s in system] == ["sys"]
    finally:
        requests.post(f"{url}/v2/systemsharedmemory/unregister", timeout=30)
        rest_unregister(url)
        obj.close()


def test_one_limit_for_system_and_cuda_regions(servers):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here for POSIX shared memory")
    url = servers["gpu"]["url"]
    obj = PosixShm(f"hearth-cuda-limit-{os.getpid()}", 4096)
    system = f"{url}/v2/systemsharedmemory"
    try:
        with requests.Session() as http:
            r = http.post(f"{system}/region/sys/register", json={"key": obj.key, "byte_size": 8}, timeout=30)
            assert r.status_code == 200, r.text
            for k in range(1023):
                code, e = rest_register(url, f"r{k}", byte_size=8, http=http)
                assert code == 200, (k, e)
            code, e = rest_register(url, "one-more", byte_size=8, http=http)
            assert code == 503 and "already 1024 shared-memory regions are registered (system and CUDA together)" in e, e
            r = http.post(f"{system}/region/one-more/register", json={"key": obj.key, "byte_size": 8}, timeout=30)
            assert r.status_code == 503 and "already 1024" in error_of(r), r.text
            # Room made by either kind serves both.
            assert http.post(f"{system}/region/sys/unregister", timeout=30).status_code == 200
            assert rest_register(url, "one-more", byte_size=8, http=http) == (200, b"")
            assert rest_unregister(url, "r0").status_code == 200
            r = http.post(f"{system}/region/sys/register", json={"key": obj.key, "byte_size": 8}, timeout=30)
            assert r.status_code == 200, r.text
    finally:
        requests.post(f"{system}/unregister", timeout=30)
        rest_unregister(url)
        obj.close()
    assert rest_status(url).json() == []


def infer_body(x_in_region=True, y_in_region=False, byte_size=None):
    rows = 2
    x = {"name": "x", "datatype": "FP32", "shape": [rows, SCALE_N]}
    if x_in_region:
        x["parameters"] = {"shared_memory_region": "dev", "shared_memory_offset": 0,
                           "shared_memory_byte_size": byte_size or 4 * rows * SCALE_N}
    else:
        x["data"] = [0.5] * (rows * SCALE_N)
    body = {"inputs": [x]}
    if y_in_region:
        body["outputs"] = [{"name": "y", "parameters": {"shared_memory_region": "dev", "shared_memory_offset": 64,
                                                        "shared_memory_byte_size": 4 * rows}}]
    return body


def test_rest_infer_naming_a_cuda_region_for_a_model_on_the_host_is_refused(servers):
    url = servers["gpu"]["url"]
    try:
        assert rest_register(url, "dev", byte_size=1 << 20) == (200, b"")
        infer = f"{url}/v2/models/scale/infer"
        r = requests.post(infer, json=infer_body(), timeout=30)
        assert r.status_code == 400, r.text
        assert error_of(r) == ("input 'x' is in CUDA shared-memory region 'dev', but model 'scale' runs its "
                               "workers on the host (cpu): CUDA shared memory is for models on a GPU; use "
                               "system shared memory or the request body"), r.text
        r = requests.post(infer, json=infer_body(x_in_region=False, y_in_region=True), timeout=30)
        assert r.status_code == 400 and error_of(r).startswith(
            "output 'y' is in CUDA shared-memory region 'dev', but model 'scale' runs its workers on the host"), r.text
        # Checked against the region first.
        body = infer_body()
        body["inputs"][0]["parameters"]["shared_memory_offset"] = (1 << 20) - 8
        r = requests.post(infer, json=body, timeout=30)
        assert r.status_code == 400 and "lies outside CUDA region 'dev'" in error_of(r), r.text
        # The server serves on.
        r = requests.post(infer, json=infer_body(x_in_region=False), timeout=30)
        assert r.status_code == 200, r.text
    finally:
        rest_unregister(url)


def test_a_server_on_the_host_refuses_cuda_regions(servers):
    url = servers["cpu"]["url"]
    code, e = rest_register(url, "c")
    assert code == 400 and "this server has no GPU" in e, e
    # Its handle is checked as any server's is, first.
    code, e = rest_register(url, "c", handle=b"x")
    assert code == 400 and "of 64 bytes, not 1" in e, e
    # None registered: perf_analyzer's clean-up (status, unregister all) succeeds.
    assert rest_status(url).json() == []
    assert rest_unregister(url).status_code == 200
    assert "cuda_shared_memory" not in requests.get(f"{url}/v2", timeout=30).json()["extensions"]
    assert "cuda_shared_memory" in requests.get(f"{servers['gpu']['url']}/v2", timeout=30).json()["extensions"]


def grpc_register(pb, stub, name, handle=HANDLE, device_id=0, byte_size=4096):
    return stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(
        name=name, raw_handle=handle, device_id=device_id, byte_size=byte_size), timeout=30)


def test_grpc_register_status_unregister_and_errors(servers, grpc_stubs):
    pb, grpc, stubs = grpc_stubs
    stub = stubs["gpu"]

    def error(call, *args, **kwargs):
        with pytest.raises(grpc.RpcError) as e:
            call(*args, **kwargs)
        return e.value

    try:
        grpc_register(pb, stub, "a", byte_size=4096)
        grpc_register(pb, stub, "b", handle=bytes(64), byte_size=8)
        regions = stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(), timeout=30).regions
        assert {k: (v.name, v.device_id, v.byte_size) for k, v in regions.items()} == {
            "a": ("a", 0, 4096), "b": ("b", 0, 8)}
        one = stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(name="b"), timeout=30).regions
        assert list(one) == ["b"]
        # What REST registers, gRPC lists, and the other way round.
        assert sorted(s["name"] for s in rest_status(servers["gpu"]["url"]).json()) == ["a", "b"]
        for fields, code, says in (
                ({"handle": HANDLE[:63]}, grpc.StatusCode.INVALID_ARGUMENT, "of 64 bytes, not 63"),
                ({"handle": base64.b64encode(HANDLE)}, grpc.StatusCode.INVALID_ARGUMENT, "of 64 bytes, not 88"),
                ({"device_id": -1}, grpc.StatusCode.INVALID_ARGUMENT, "device_id -1 is negative"),
                ({"device_id": 3}, grpc.StatusCode.INVALID_ARGUMENT, "not a GPU this server uses (0)"),
                ({"byte_size": 0}, grpc.StatusCode.INVALID_ARGUMENT, "byte_size must be 1 to")):
            e = error(grpc_register, pb, stub, "bad", **fields)
            assert e.code() == code and says in e.details(), (fields, e.code(), e.details())
        e = error(grpc_register, pb, stub, "a")
        assert e.code() == grpc.StatusCode.ALREADY_EXISTS and "'a' is registered" in e.details(), e.details()
        e = error(stub.CudaSharedMemoryStatus, pb.CudaSharedMemoryStatusRequest(name="bad"), timeout=30)
        assert e.code() == grpc.StatusCode.NOT_FOUND and "no CUDA shared-memory region named 'bad'" in e.details()
        stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(name="a"), timeout=30)
        e = error(stub.CudaSharedMemoryUnregister, pb.CudaSharedMemoryUnregisterRequest(name="a"), timeout=30)
        assert e.code() == grpc.StatusCode.NOT_FOUND
        stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(), timeout=30)
        assert dict(stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(), timeout=30).regions) == {}

        # An infer over gRPC naming a region, for a model on the host.
        grpc_register(pb, stub, "dev", byte_size=1 << 20)
        x = np.zeros((2, SCALE_N), np.float32)
        request = pb.ModelInferRequest(model_name="scale", inputs=[
            pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=list(x.shape))])
        p = request.inputs[0].parameters
        p["shared_memory_region"].string_param = "dev"
        p["shared_memory_offset"].int64_param = 0
        p["shared_memory_byte_size"].int64_param = x.nbytes
        e = error(stub.ModelInfer, request, timeout=30)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
        assert "model 'scale' runs its workers on the host (cpu)" in e.details(), e.details()
    finally:
        stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(), timeout=30)

    e = error(grpc_register, pb, stubs["cpu"], "c")
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "this server has no GPU" in e.details(), e.details()
