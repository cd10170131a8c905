"""Tests of the Python package python/hearth against a real `hearth store`.

The store runs on host memory (--device cpu) on a private socket. Paths come
from $HEARTH_CLI and $HEARTH_LIBRARY (set by ctest), defaulting to build/.
"""

import gc
import json
import os
import pathlib
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI = os.environ.get("HEARTH_CLI") or str(ROOT / "build" / "bin" / "hearth")
LIBRARY = os.environ.get("HEARTH_LIBRARY") or str(ROOT / "build" / "src" / "capi" / "libhearth.so")
os.environ["HEARTH_LIBRARY"] = LIBRARY
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))

import hearth  # noqa: E402
from hearth import _dlpack  # noqa: E402

ARENA = "memfd:hearth-arena"
MLP_DIMS = (8, 16, 4)  # in, hidden, out


# ---- helpers --------------------------------------------------------------


def read_safetensors(path):
    """{name: numpy array} read with nothing but the format's definition."""
    blob = pathlib.Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + header_len])
    data = blob[8 + header_len:]
    types = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "I32": "<i4", "U8": "u1"}
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = data[begin:end]
        if entry["dtype"] == "BF16":
            out[name] = (entry["dtype"], tuple(entry["shape"]), raw)
        else:
            arr = np.frombuffer(raw, dtype=types[entry["dtype"]]).reshape(entry["shape"])
            out[name] = (entry["dtype"], tuple(entry["shape"]), arr)
    return out


def arena_mappings():
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if ARENA in line)


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def maps_lines():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def run_python(code, **env):
    """Runs `code` in a fresh interpreter with the package on the path; returns stdout."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), HEARTH_LIBRARY=LIBRARY)
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def forked(fn, *args):
    """Runs fn(*args) in an os.fork() child; returns what it returned (JSON) or raises."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        status = 0
        try:
            os.close(r)
            try:
                payload = {"ok": fn(*args)}
            except BaseException as e:  # report everything to the parent
                payload = {"error": f"{type(e).__name__}: {e}"}
            with os.fdopen(w, "w") as f:
                json.dump(payload, f)
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child {pid} failed: {text}"
    result = json.loads(text)
    if "error" in result:
        raise AssertionError(f"child {pid}: {result['error']}")
    return result["ok"]


# ---- fixtures -------------------------------------------------------------


class Store:
    def __init__(self, directory, socket, files):
        self.directory = directory
        self.socket = socket
        self.files = files


@pytest.fixture(scope="session")
def store():
    if not os.path.exists(CLI):
        pytest.fail(f"hearth CLI not found at {CLI}; build target hearth_cli or set HEARTH_CLI")
    # A short path of our own: Unix socket paths are limited to 107 bytes.
    directory = tempfile.mkdtemp(prefix="hearth-py-")
    files = {
        "mlp": os.path.join(directory, "mlp.safetensors"),
        "scale": os.path.join(directory, "scale.safetensors"),
        "mlpbf": os.path.join(directory, "mlpbf.safetensors"),
    }
    dims = ",".join(map(str, MLP_DIMS))
    for args in (["mlp", "--dims", dims, "--dtype", "f32", "--seed", "7", "--out", files["mlp"]],
                 ["scale", "--dims", "10", "--seed", "3", "--out", files["scale"]],
                 ["mlp", "--dims", "4,6,2", "--dtype", "bf16", "--seed", "5", "--out",
                  files["mlpbf"]]):
        subprocess.run([CLI, "make-model", *args], check=True, capture_output=True, timeout=60)
    socket = os.path.join(directory, "store.sock")
    out_path = os.path.join(directory, "store.out")
    with open(out_path, "w") as out, open(os.path.join(directory, "store.err"), "w") as err:
        proc = subprocess.Popen(
            [CLI, "store", "--socket", socket, "--device", "cpu"]
            + [f"--model={name}={path}" for name, path in files.items()],
            stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while "ready" not in pathlib.Path(out_path).read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                err_text = pathlib.Path(directory, "store.err").read_text()
                pytest.fail(f"hearth store did not become ready (rc {proc.poll()}):\n{err_text}")
            time.sleep(0.02)
        yield Store(directory, socket, files)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


# ---- import and laziness --------------------------------------------------


def test_import_needs_no_library_and_no_torch(store):
    out = run_python(f"""
        import sys, hearth
        assert "torch" not in sys.modules
        assert hearth._capi._lib is None, "import loaded libhearth"
        w = hearth.attach("mlp", socket={store.socket!r})
        assert hearth._capi._lib is None, "attach() loaded libhearth"
        try:
            len(w)
        except hearth.HearthError as e:
            print("ERROR", e)
        import hearth.torch
        assert "torch" not in sys.modules
        """, HEARTH_LIBRARY="/nonexistent/libhearth.so")
    assert "ERROR" in out and "/nonexistent/libhearth.so" in out and "HEARTH_LIBRARY" in out


def test_attach_is_lazy(store):
    out = run_python(f"""
        import hearth
        def arenas():
            return sum("{ARENA}" in line for line in open("/proc/self/maps"))
        print("before", arenas())
        w = hearth.attach("mlp", socket={store.socket!r})
        print("after attach()", arenas(), w.attached)
        n = len(w)
        print("after len()", arenas(), w.attached, n)
        """)
    lines = out.splitlines()
    assert lines[0] == "before 0"
    assert lines[1] == "after attach() 0 False"
    assert lines[2].startswith("after len() ") and lines[2].split()[2] != "0"
    assert lines[2].endswith("True 4")


@pytest.mark.parametrize("trigger", ["getitem", "keys", "contains", "checksum"])
def test_each_first_use_attaches(store, trigger):
    w = hearth.attach("mlp", socket=store.socket)
    assert not w.attached
    if trigger == "getitem":
        w["head.bias"]
    elif trigger == "keys":
        list(w.keys())
    elif trigger == "contains":
        assert "head.bias" in w
    else:
        w.checksum
    assert w.attached


def test_socket_from_environment(store, monkeypatch):
    monkeypatch.setenv("HEARTH_SOCKET", store.socket)
    w = hearth.attach("scale")
    assert list(w) == ["weight"]
    assert w.socket == store.socket


# ---- values, metadata and read-only views ---------------------------------


@pytest.mark.parametrize("model", ["mlp", "scale"])
def test_values_equal_the_checkpoint(store, model):
    expected = read_safetensors(store.files[model])
    w = hearth.attach(model, socket=store.socket)
    assert sorted(w) == sorted(expected)
    for name, (dtype, shape, values) in expected.items():
        t = w[name]
        assert t.name == name
        assert t.dtype == dtype
        assert t.shape == shape
        assert t.device == "cpu"
        assert t.nbytes == values.nbytes
        assert t.data_ptr != 0
        assert t.numpy_dtype == values.dtype
        np.testing.assert_array_equal(t.numpy(), values)
        assert t.tobytes() == values.tobytes()


def test_metadata_matches_inspect(store):
    out = subprocess.run([CLI, "inspect", store.files["mlp"]], check=True, capture_output=True,
                         text=True).stdout
    checksum = int(next(line for line in out.splitlines()
                        if line.startswith("checksum:")).split()[1], 16)
    w = hearth.attach("mlp", socket=store.socket)
    assert (w.model, w.version, w.device, w.checksum) == ("mlp", 1, "cpu", checksum)
    assert w["encoder.weight"].shape == (MLP_DIMS[1], MLP_DIMS[0])
    assert w["head.weight"].shape == (MLP_DIMS[2], MLP_DIMS[1])


def test_mapping_is_read_only(store):
    w = hearth.attach("mlp", socket=store.socket)
    with pytest.raises(TypeError):
        w["head.bias"] = None
    with pytest.raises(KeyError, match="nope"):
        w["nope"]
    assert w.get("nope") is None


def test_arrays_are_read_only(store):
    t = hearth.attach("mlp", socket=store.socket)["encoder.weight"]
    for array in (t.numpy(), np.asarray(t), np.array(t, copy=False)):
        assert not array.flags.writeable
        with pytest.raises(ValueError):
            array[0, 0] = 1.0
        with pytest.raises(ValueError):
            array.setflags(write=True)
    with pytest.raises(AttributeError):
        t.__cuda_array_interface__
    assert t.__array_interface__["data"][1] is True


def test_arrays_keep_the_mapping_alive(store):
    expected = read_safetensors(store.files["mlp"])["head.weight"][2]
    w = hearth.attach("mlp", socket=store.socket)
    array = w["head.weight"].numpy()
    exported = np.from_dlpack(w["head.weight"])
    del w
    gc.collect()
    assert arena_mappings() >= 1
    np.testing.assert_array_equal(array, expected)
    np.testing.assert_array_equal(exported, expected)


# ---- DLPack ---------------------------------------------------------------


def test_dlpack_round_trip(store):
    expected = read_safetensors(store.files["mlp"])
    baseline = _dlpack.live_exports()
    w = hearth.attach("mlp", socket=store.socket)
    for name, (_, shape, values) in expected.items():
        t = w[name]
        assert t.__dlpack_device__() == (1, 0)
        array = np.from_dlpack(t)
        assert array.shape == shape and array.dtype == values.dtype
        assert array.__array_interface__["data"][0] == t.data_ptr  # a view, not a copy
        np.testing.assert_array_equal(array, values)
        del array
    assert _dlpack.live_exports() == baseline


def test_unconsumed_capsule_is_released(store):
    baseline = _dlpack.live_exports()
    t = hearth.attach("scale", socket=store.socket)["weight"]
    capsule = t.__dlpack__(stream=None)
    assert type(capsule).__name__ == "PyCapsule"
    assert _dlpack.live_exports() == baseline + 1
    del capsule
    assert _dlpack.live_exports() == baseline
    with pytest.raises(BufferError):
        t.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=(2, 0))


def test_bf16_has_no_numpy_dtype_but_exports_dlpack(store):
    w = hearth.attach("mlpbf", socket=store.socket)
    t = w["encoder.weight"]
    assert t.dtype == "BF16" and t.shape == (6, 4) and t.nbytes == 48
    with pytest.raises(TypeError, match="BF16"):
        t.numpy()
    with pytest.raises(TypeError, match="BF16"):
        t.numpy_dtype
    expected = read_safetensors(store.files["mlpbf"])["encoder.weight"][2]
    assert t.tobytes() == expected
    capsule = t.__dlpack__()
    del capsule


# ---- errors ---------------------------------------------------------------


def test_unknown_model_is_not_found(store):
    w = hearth.attach("no-such-model", socket=store.socket)
    with pytest.raises(hearth.NotFound, match="no-such-model") as info:
        len(w)
    assert isinstance(info.value, hearth.HearthError)
    assert isinstance(info.value, RuntimeError)
    assert info.value.code == -2


def test_no_store_is_unavailable(store):
    socket = os.path.join(store.directory, "nobody-listens.sock")
    with pytest.raises(hearth.Unavailable, match="nobody-listens.sock"):
        hearth.attach("mlp", socket=socket)["head.bias"]


def test_bad_arguments():
    with pytest.raises(ValueError):
        hearth.attach("")
    with pytest.raises(ValueError):
        hearth.attach("mlp", version=-1)


# ---- fork -----------------------------------------------------------------


def _child_reads(w):
    values = {name: t.numpy().tolist() for name, t in w.items()}  # first use in this child
    return {
        "pid": os.getpid(),
        "arenas": arena_mappings(),
        "attached_by": w._attachment.pid if w.attached else None,
        "values": values,
    }


def test_lazy_attach_in_parent_each_forked_child_maps_its_own(store):
    expected = read_safetensors(store.files["mlp"])
    w = hearth.attach("mlp", socket=store.socket)
    before = arena_mappings()
    results = [forked(_child_reads, w) for _ in range(3)]
    assert not w.attached, "the parent mapped the model"
    assert arena_mappings() == before
    assert len({r["pid"] for r in results}) == 3
    for r in results:
        assert r["pid"] != os.getpid()
        assert r["arenas"] > before
        assert r["attached_by"] == r["pid"]
        for name, (_, _, values) in expected.items():
            np.testing.assert_array_equal(np.array(r["values"][name], dtype=values.dtype), values)
    np.testing.assert_array_equal(w["head.bias"].numpy(), expected["head.bias"][2])


def test_child_of_an_attached_parent_attaches_again(store):
    w = hearth.attach("scale", socket=store.socket)
    parent_values = w["weight"].numpy().tolist()
    result = forked(_child_reads, w)
    assert result["attached_by"] == result["pid"] != os.getpid()
    assert result["values"]["weight"] == parent_values
    assert w._attachment.pid == os.getpid()


def test_fork_after_cuda_is_flagged_and_host_attachments_still_work(store):
    # A stand-in for torch whose CUDA is initialised: the check runs in the
    # parent just before fork, because in the child torch reports "not initialised".
    out = run_python(f"""
        import os, sys, types, hearth
        fake = types.ModuleType("torch")
        fake.cuda = types.SimpleNamespace(is_initialized=lambda: True)
        sys.modules["torch"] = fake
        w = hearth.attach("scale", socket={store.socket!r})
        pid = os.fork()
        if pid == 0:
            ok = hearth._forked_after_cuda and len(w["weight"].numpy()) == 10
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), "parent flag", hearth._forked_after_cuda)
        """)
    assert out.strip() == "child 0 parent flag False"


# ---- lifetime -------------------------------------------------------------


def _cycle(socket):
    w = hearth.attach("mlp", socket=socket)
    t = w["encoder.weight"]
    a = t.numpy()
    b = np.from_dlpack(w["head.bias"])
    c = w["head.weight"].__dlpack__()
    return float(a[0, 0]) + float(b[0]) + (c is not None)


def test_thousand_attach_detach_cycles_leak_nothing(store):
    for _ in range(5):
        _cycle(store.socket)
    gc.collect()
    fds, lines, arenas = fd_count(), maps_lines(), arena_mappings()
    exports = _dlpack.live_exports()
    for _ in range(1000):
        _cycle(store.socket)
    gc.collect()
    assert fd_count() == fds
    assert maps_lines() == lines
    assert arena_mappings() == arenas
    assert _dlpack.live_exports() == exports


def test_detach_happens_when_the_last_reference_goes(store):
    gc.collect()
    arenas = arena_mappings()
    w = hearth.attach("scale", socket=store.socket)
    t = w["weight"]
    capsule = t.__dlpack__()
    del w
    assert arena_mappings() == arenas + 1
    del t
    assert arena_mappings() == arenas + 1, "a live capsule must keep the mapping"
    del capsule
    assert arena_mappings() == arenas


# ---- torch ----------------------------------------------------------------


def _mlp_module(torch, dims):
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.Linear(dims[0], dims[1])
            self.head = torch.nn.Linear(dims[1], dims[2])

        def forward(self, x):
            return self.head(torch.relu(self.encoder(x)))

    return Mlp()


def test_torch_state_dict_is_zero_copy(store):
    torch = pytest.importorskip("torch", reason="torch is not installed for this interpreter")
    import hearth.torch as ht

    expected = read_safetensors(store.files["mlp"])
    w = hearth.attach("mlp", socket=store.socket)
    sd = ht.state_dict(w)
    assert sorted(sd) == sorted(expected)
    for name, tensor in sd.items():
        assert tensor.data_ptr() == w[name].data_ptr
        assert tensor.device.type == "cpu"
        np.testing.assert_array_equal(tensor.numpy(), expected[name][2])
    assert sorted(ht.state_dict("scale", socket=store.socket)) == ["weight"]


def test_torch_load_into_binds_the_shared_weights(store):
    torch = pytest.importorskip("torch", reason="torch is not installed for this interpreter")
    import hearth.torch as ht

    w = hearth.attach("mlp", socket=store.socket)
    module = _mlp_module(torch, MLP_DIMS)
    assert ht.load_into(module, w) is module
    assert module.encoder.weight.data_ptr() == w["encoder.weight"].data_ptr
    x = torch.ones(2, MLP_DIMS[0])
    enc_w, enc_b = w["encoder.weight"].numpy(), w["encoder.bias"].numpy()
    head_w, head_b = w["head.weight"].numpy(), w["head.bias"].numpy()
    want = np.maximum(np.ones((2, MLP_DIMS[0]), np.float32) @ enc_w.T + enc_b, 0) @ head_w.T + head_b
    with torch.no_grad():
        np.testing.assert_allclose(module(x).numpy(), want, rtol=1e-5, atol=1e-6)


def test_torch_load_into_lists_every_mismatch(store):
    torch = pytest.importorskip("torch", reason="torch is not installed for this interpreter")
    import hearth.torch as ht

    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.Linear(MLP_DIMS[0], MLP_DIMS[1] + 1)  # mis-shaped
            self.extra = torch.nn.Linear(2, 2)                             # missing in store
            # head.* absent: unexpected

    module = Other()
    before = module.encoder.weight.data_ptr()
    with pytest.raises(hearth.InvalidArgument) as info:
        ht.load_into(module, "mlp", socket=store.socket)
    message = str(info.value)
    for word in ("extra.weight", "extra.bias", "head.weight", "head.bias",
                 "encoder.weight", "encoder.bias"):
        assert word in message
    assert module.encoder.weight.data_ptr() == before, "the module was changed"


def test_torch_bf16_via_dlpack(store):
    torch = pytest.importorskip("torch", reason="torch is not installed for this interpreter")
    import hearth.torch as ht

    sd = ht.state_dict("mlpbf", socket=store.socket)
    t = sd["encoder.weight"]
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (6, 4)
    expected = read_safetensors(store.files["mlpbf"])["encoder.weight"][2]
    assert t.view(torch.int16).numpy().tobytes() == expected
