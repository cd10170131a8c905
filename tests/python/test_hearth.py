"""Tests of the Python package python/hearth against a real `hearth store`.

The store runs on a private socket on the device $HEARTH_TEST_DEVICE (passed
as `hearth store --device`; default "cpu", host memory; "cuda:0" runs the same
suite against a store on a GPU). Tests that only make sense on host memory
(memfd mappings, numpy() views, __array_interface__, fork with host
attachments) skip on a GPU store; the CUDA tests skip on host memory. Paths
come from $HEARTH_CLI and $HEARTH_LIBRARY (set by ctest), defaulting to build/.
"""

import gc
import json
import os
import pathlib
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
from hearth_testing import wait_for  # noqa: E402

ARENA = "memfd:hearth-arena"
MLP_DIMS = (8, 16, 4)  # in, hidden, out

DEVICE = os.environ.get("HEARTH_TEST_DEVICE") or "cpu"  # the store's --device
ON_CUDA = DEVICE.startswith("cuda")
host_only = pytest.mark.skipif(ON_CUDA, reason=f"host-memory test; store on {DEVICE}")
cuda_only = pytest.mark.skipif(
    not ON_CUDA, reason="CUDA test; store on host memory (set HEARTH_TEST_DEVICE=cuda:0)")


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


def arena_permissions():
    """The permissions ("r--s") of each mapping of an arena in this process."""
    with open("/proc/self/maps") as f:
        return [line.split()[1] for line in f if ARENA in line]


def hearth_fds():
    """Descriptors of the kinds libhearth opens: sockets and arena memfds."""
    kinds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the directory's own descriptor, gone by now
            continue
        if target.startswith("socket:") or ARENA in target:
            kinds.append(target)
    return len(kinds)


def wait_until_ready(proc, out_path, what, marker="hearth store ready", error_path=None):
    """Polls the store's output for `marker` (30 s deadline); fails the test,
    with what the store said, if it exits or the deadline passes first."""
    wait_for(lambda: marker in pathlib.Path(out_path).read_text(), f"{what} to become ready", timeout=30,
             procs=(proc,), log=error_path or out_path)


def end_store(proc):
    """SIGTERM to a store, SIGKILL if it has not exited within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
    def __init__(self, directory, socket, files, proc=None):
        self.directory = directory
        self.socket = socket
        self.files = files
        self.proc = proc


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
            [CLI, "store", "--socket", socket, "--device", DEVICE]
            + [f"--model={name}={path}" for name, path in files.items()],
            stdout=out, stderr=err)
    try:
        wait_until_ready(proc, out_path, "hearth store", marker="ready",
                         error_path=os.path.join(directory, "store.err"))
        yield Store(directory, socket, files, proc)
    finally:
        end_store(proc)
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
    assert lines[2].startswith("after len() ")
    if not ON_CUDA:  # a GPU arena is no memfd mapping
        assert lines[2].split()[2] != "0"
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
        assert t.device == DEVICE
        assert t.nbytes == values.nbytes
        assert t.data_ptr != 0
        assert t.numpy_dtype == values.dtype
        if ON_CUDA:
            with pytest.raises(TypeError, match="host memory"):
                t.numpy()
        else:
            np.testing.assert_array_equal(t.numpy(), values)
        assert t.tobytes() == values.tobytes()


def test_metadata_matches_inspect(store):
    out = subprocess.run([CLI, "inspect", store.files["mlp"]], check=True, capture_output=True,
                         text=True).stdout
    checksum = int(next(line for line in out.splitlines()
                        if line.startswith("checksum:")).split()[1], 16)
    w = hearth.attach("mlp", socket=store.socket)
    assert (w.model, w.version, w.device, w.checksum) == ("mlp", 1, DEVICE, checksum)
    assert w["encoder.weight"].shape == (MLP_DIMS[1], MLP_DIMS[0])
    assert w["head.weight"].shape == (MLP_DIMS[2], MLP_DIMS[1])


def test_mapping_is_read_only(store):
    w = hearth.attach("mlp", socket=store.socket)
    with pytest.raises(TypeError):
        w["head.bias"] = None
    with pytest.raises(KeyError, match="nope"):
        w["nope"]
    assert w.get("nope") is None


@host_only
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


@host_only
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


@host_only
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
    other_device = (1, 0) if ON_CUDA else (2, 0)
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=other_device)


def test_bf16_has_no_numpy_dtype_but_exports_dlpack(store):
    w = hearth.attach("mlpbf", socket=store.socket)
    t = w["encoder.weight"]
    assert t.dtype == "BF16" and t.shape == (6, 4) and t.nbytes == 48
    with pytest.raises(TypeError, match="host memory" if ON_CUDA else "BF16"):
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
    with pytest.raises(ValueError, match="store_uid"):
        hearth.attach("mlp", store_uid="1000")
    with pytest.raises(ValueError, match="store_uid"):
        hearth.attach("mlp", store_uid=[1000, -1])


# ---- one store per device ------------------------------------------------


def test_device_socket_follows_the_stores_rule():
    # The same cases as tests/store/store_devices_test.cc (DeviceSocketPath).
    assert hearth.device_socket("/run/h/store.sock", "cuda:1") == "/run/h/store-cuda1.sock"
    assert hearth.device_socket("/run/h/store.sock", "cpu") == "/run/h/store-cpu.sock"
    assert hearth.device_socket("/run/h/store.sock", "host0") == "/run/h/store-host0.sock"
    assert hearth.device_socket("/run/h/store", "cuda:0") == "/run/h/store-cuda0"
    assert hearth.device_socket("s.sock", "cuda:2") == "s-cuda2.sock"
    assert hearth.device_socket("/x.sock/s", "host1") == "/x.sock/s-host1"
    assert hearth.device_socket("/run/.sock", "host1") == "/run/.sock-host1"
    assert hearth.device_socket(pathlib.Path("/run/h/store.sock"), 3) == "/run/h/store-cuda3.sock"
    assert hearth.device_socket("/s.sock", "cuda") == "/s-cuda0.sock"
    for bad in ("tpu", "host01", "cuda:", "cuda:1024", "host-1", True, -1, 1024, 1.0, None):
        with pytest.raises(ValueError, match="device"):
            hearth.device_socket("/s.sock", bad)
    with pytest.raises(ValueError, match="device"):
        hearth.attach("mlp", device="gpu0")


@pytest.fixture(scope="module")
def device_stores():
    """`hearth store --device host0,host1`: one store per (stand-in) device,
    each with its own copy; yields (base socket, checkpoint path)."""
    directory = tempfile.mkdtemp(prefix="hearth-py-dev-")
    model = os.path.join(directory, "scale.safetensors")
    subprocess.run([CLI, "make-model", "scale", "--dims", "64", "--seed", "9", "--out", model],
                   check=True, capture_output=True, timeout=60)
    socket = os.path.join(directory, "store.sock")
    out_path = os.path.join(directory, "store.out")
    with open(out_path, "w") as out:
        proc = subprocess.Popen([CLI, "store", "--socket", socket, "--device", "host0,host1",
                                 f"--model=scale={model}"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(proc, out_path, "the store")
        yield socket, model
    finally:
        end_store(proc)
        shutil.rmtree(directory, ignore_errors=True)


def arena_inodes():
    with open("/proc/self/maps") as f:
        return {line.split()[4] for line in f if ARENA in line}


def test_attach_picks_the_devices_store(device_stores, monkeypatch):
    socket, model = device_stores
    expected = read_safetensors(model)["weight"][2]
    before = arena_inodes()
    w0 = hearth.attach("scale", socket=socket, device="host0")
    w1 = hearth.attach("scale", socket=socket, device="host1")
    np.testing.assert_array_equal(w0["weight"].numpy(), expected)
    np.testing.assert_array_equal(w1["weight"].numpy(), expected)
    assert w0.socket == hearth.device_socket(socket, "host0")
    assert w1.socket == hearth.device_socket(socket, "host1")
    assert w0.device == w1.device == "cpu"  # a stand-in's memory is the host's
    # Two stores, two copies: each attachment maps its own arena.
    assert len(arena_inodes() - before) == 2
    # $HEARTH_SOCKET is the base the device's socket is made from.
    monkeypatch.setenv("HEARTH_SOCKET", socket)
    assert hearth.attach("scale", device="host1").socket == hearth.device_socket(socket, "host1")


def test_a_device_with_no_store_is_unavailable_naming_its_socket(device_stores):
    socket, _ = device_stores
    with pytest.raises(hearth.Unavailable, match=r"store-cuda1\.sock"):
        len(hearth.attach("scale", socket=socket, device="cuda:1"))


def test_a_store_on_another_device_than_asked_is_refused():
    """A host store at the socket cuda:0's would have: the attachment is
    refused, not taken for a GPU one."""
    directory = tempfile.mkdtemp(prefix="hearth-py-dev-")
    try:
        model = os.path.join(directory, "scale.safetensors")
        subprocess.run([CLI, "make-model", "scale", "--dims", "8", "--seed", "1", "--out", model],
                       check=True, capture_output=True, timeout=60)
        base = os.path.join(directory, "s.sock")
        out_path = os.path.join(directory, "store.out")
        with open(out_path, "w") as out:
            proc = subprocess.Popen([CLI, "store", "--socket", hearth.device_socket(base, "cuda:0"),
                                     "--device", "cpu", f"--model=scale={model}"],
                                    stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until_ready(proc, out_path, "the store")
            with pytest.raises(hearth.HearthError, match="that store holds it on cpu, not on cuda:0"):
                len(hearth.attach("scale", socket=base, device="cuda:0"))
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---- whose store ----------------------------------------------------------

OTHER_UID = 54331  # an unprivileged uid with no user entry
SETPRIV = "/usr/bin/setpriv"


@pytest.fixture
def foreign_store(tmp_path):
    """A `hearth store` run by OTHER_UID on a socket of its own; yields (socket, pid)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a store as another uid")
    if not os.access(SETPRIV, os.X_OK):
        pytest.skip(f"needs {SETPRIV} (util-linux)")
    # A short path of our own (socket paths are limited to 107 bytes),
    # searchable by the other uid.
    top = tempfile.mkdtemp(prefix="hearth-py-uid-")
    try:
        os.chmod(top, 0o711)
        model = os.path.join(top, "scale.safetensors")
        subprocess.run([CLI, "make-model", "scale", "--dims", "10", "--seed", "3", "--out", model],
                       check=True, capture_output=True, timeout=60)
        os.chmod(model, 0o644)
        own = os.path.join(top, "other")
        os.mkdir(own, 0o755)
        os.chown(own, OTHER_UID, OTHER_UID)
        socket = os.path.join(own, "store.sock")
        out_path = os.path.join(top, "store.out")
        with open(out_path, "w") as out:
            proc = subprocess.Popen(
                [SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "--",
                 CLI, "store", "--socket", socket, "--device", "cpu", "--socket-mode", "0666",
                 f"--model=scale={model}"],
                stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until_ready(proc, out_path, "the other uid's store")
            yield socket, proc.pid
        finally:
            proc.kill()
            proc.wait()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_store_of_another_uid_is_refused(foreign_store, monkeypatch):
    socket, pid = foreign_store
    monkeypatch.delenv("HEARTH_STORE_UID", raising=False)
    with pytest.raises(hearth.PermissionDenied) as info:
        len(hearth.attach("scale", socket=socket))
    message = str(info.value)
    assert socket in message and f"uid {OTHER_UID}" in message and f"pid {pid}" in message, message


def test_a_store_of_a_trusted_uid_is_used(foreign_store, monkeypatch):
    socket, _ = foreign_store
    monkeypatch.delenv("HEARTH_STORE_UID", raising=False)
    assert list(hearth.attach("scale", socket=socket, store_uid=OTHER_UID)) == ["weight"]
    assert len(hearth.attach("scale", socket=socket, store_uid=[1, OTHER_UID])) == 1
    monkeypatch.setenv("HEARTH_STORE_UID", f"7,{OTHER_UID}")
    assert list(hearth.attach("scale", socket=socket)) == ["weight"]


# ---- fork -----------------------------------------------------------------


def _child_reads(w):
    values = {name: t.numpy().tolist() for name, t in w.items()}  # first use in this child
    return {
        "pid": os.getpid(),
        "arenas": arena_mappings(),
        "attached_by": w._attachment.pid if w.attached else None,
        "values": values,
    }


@host_only
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


@host_only
def test_child_of_an_attached_parent_attaches_again(store):
    w = hearth.attach("scale", socket=store.socket)
    parent_values = w["weight"].numpy().tolist()
    result = forked(_child_reads, w)
    assert result["attached_by"] == result["pid"] != os.getpid()
    assert result["values"]["weight"] == parent_values
    assert w._attachment.pid == os.getpid()


@host_only
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


@host_only
def test_thousand_attach_detach_cycles_leak_nothing(store):
    # What hearth owns is counted (arena mappings, its sockets and memfds,
    # DLPack exports), not the interpreter's own mappings or descriptors.
    for _ in range(5):
        _cycle(store.socket)
    gc.collect()
    fds, arenas = hearth_fds(), arena_permissions()
    exports = _dlpack.live_exports()
    w = hearth.attach("mlp", socket=store.socket)
    w["head.bias"]
    assert arena_permissions() == arenas + ["r--s"], "one read-only shared mapping while attached"
    del w
    gc.collect()
    assert arena_permissions() == arenas
    for _ in range(1000):
        _cycle(store.socket)
    gc.collect()
    assert hearth_fds() == fds
    assert arena_permissions() == arenas
    assert _dlpack.live_exports() == exports


@host_only
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
        assert tensor.device == torch.device(DEVICE)
        np.testing.assert_array_equal(tensor.cpu().numpy(), expected[name][2])
    assert sorted(ht.state_dict("scale", socket=store.socket)) == ["weight"]


def test_torch_load_into_binds_the_shared_weights(store):
    torch = pytest.importorskip("torch", reason="torch is not installed for this interpreter")
    import hearth.torch as ht

    w = hearth.attach("mlp", socket=store.socket)
    module = _mlp_module(torch, MLP_DIMS)
    assert ht.load_into(module, w) is module
    assert module.encoder.weight.data_ptr() == w["encoder.weight"].data_ptr
    assert module.encoder.weight.device == torch.device(DEVICE)
    x = torch.ones(2, MLP_DIMS[0], device=DEVICE)
    expected = read_safetensors(store.files["mlp"])
    enc_w, enc_b = expected["encoder.weight"][2], expected["encoder.bias"][2]
    head_w, head_b = expected["head.weight"][2], expected["head.bias"][2]
    want = np.maximum(np.ones((2, MLP_DIMS[0]), np.float32) @ enc_w.T + enc_b, 0) @ head_w.T + head_b
    with torch.no_grad():
        got = module(x).cpu().numpy()
    tolerance = dict(rtol=1e-4, atol=1e-5) if ON_CUDA else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, **tolerance)


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
    assert t.device == torch.device(DEVICE)
    assert t.view(torch.int16).cpu().numpy().tobytes() == expected


# ---- CUDA: the store on a GPU (HEARTH_TEST_DEVICE=cuda:N) --------------------

MIB = 1 << 20


def _device_index():
    return int(DEVICE.partition(":")[2] or 0)


def _cuda_torch():
    torch = pytest.importorskip("torch", reason="torch is not installed for this interpreter")
    if not torch.cuda.is_available():
        pytest.fail(f"the store is on {DEVICE} but torch sees no CUDA device")
    return torch


def run_script(code, *args, timeout=180):
    """Runs `code` as a script in a fresh interpreter; returns the CompletedProcess (any rc)."""
    paths = [str(ROOT / "python")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                      if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), HEARTH_LIBRARY=LIBRARY)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=timeout)


def store_attached_count(socket, model):
    """The store's count of live leases on `model` (from `hearth status`)."""
    out = subprocess.run([CLI, "status", "--socket", socket], check=True, capture_output=True,
                         text=True, timeout=30).stdout
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0].startswith(model + "@") and "attached" in fields:
            return int(fields[fields.index("attached") + 1])
    raise AssertionError(f"no arena of {model} in `hearth status`:\n{out}")


@cuda_only
def test_cuda_tensors_report_the_device(store):
    w = hearth.attach("mlp", socket=store.socket)
    assert w.device == DEVICE
    assert repr(w).endswith(f"device={DEVICE!r})")
    for name, t in w.items():
        assert t.device == DEVICE, name
        assert t.__dlpack_device__() == (_dlpack.KDL_CUDA, _device_index())
        assert t.data_ptr != 0
        with pytest.raises(AttributeError, match="__cuda_array_interface__"):
            t.__array_interface__
        assert not hasattr(t, "__array_interface__")  # numpy's probing sees no host array
        with pytest.raises(TypeError, match="host memory"):
            t.numpy()
    assert hearth.attach("scale", socket=store.socket)["weight"].device == DEVICE


@cuda_only
@pytest.mark.parametrize("model", ["mlp", "scale"])
def test_cuda_array_interface_is_read_only_v3(store, model):
    expected = read_safetensors(store.files[model])
    w = hearth.attach(model, socket=store.socket)
    for name, (dtype, shape, values) in expected.items():
        t = w[name]
        cai = t.__cuda_array_interface__
        assert cai["version"] == 3
        assert cai["data"] == (t.data_ptr, True), "must be marked read-only"
        assert tuple(cai["shape"]) == shape
        assert np.dtype(cai["typestr"]) == values.dtype
        assert cai["strides"] is None  # C-contiguous
        assert cai["stream"] is None   # no synchronisation needed: the bytes never change
        assert t.tobytes() == values.tobytes()


class _InterfaceWithoutReadOnlyFlag:
    """The tensor's __cuda_array_interface__ with the read-only flag cleared.

    torch.as_tensor refuses any producer that marks its memory read-only
    ("the read only flag is not supported"); this wrapper lets the test read
    through the interface anyway. The memory stays read-only: only read it.
    """

    def __init__(self, tensor):
        cai = dict(tensor.__cuda_array_interface__)
        cai["data"] = (cai["data"][0], False)
        self.__cuda_array_interface__ = cai
        self.tensor = tensor  # keeps the mapping alive


@cuda_only
def test_cuda_torch_as_tensor_via_the_interface(store):
    torch = _cuda_torch()
    expected = read_safetensors(store.files["mlp"])
    w = hearth.attach("mlp", socket=store.socket)
    t = w["encoder.weight"]
    # The honest interface (read-only flag set) is refused by torch, as documented there.
    try:
        torch.as_tensor(t, device=DEVICE)
    except TypeError as e:
        assert "read only" in str(e), e
    for name, (_, shape, values) in expected.items():
        t = w[name]
        view = _InterfaceWithoutReadOnlyFlag(t)
        x = torch.as_tensor(view, device=DEVICE)
        assert x.device == torch.device(DEVICE)
        assert x.data_ptr() == t.data_ptr, "as_tensor copied"
        assert tuple(x.shape) == shape
        np.testing.assert_array_equal(x.cpu().numpy(), values)


@cuda_only
def test_cuda_cupy_via_the_interface(store):
    cupy = pytest.importorskip("cupy", reason="cupy is not installed for this interpreter")
    expected = read_safetensors(store.files["mlp"])
    w = hearth.attach("mlp", socket=store.socket)
    with cupy.cuda.Device(_device_index()):
        for name, (_, shape, values) in expected.items():
            t = w[name]
            a = cupy.asarray(t)  # through __cuda_array_interface__, no copy
            assert a.data.ptr == t.data_ptr
            assert a.shape == shape
            np.testing.assert_array_equal(cupy.asnumpy(a), values)


@cuda_only
@pytest.mark.parametrize("model", ["mlp", "scale"])
def test_cuda_torch_from_dlpack_equals_the_checkpoint(store, model):
    torch = _cuda_torch()
    expected = read_safetensors(store.files[model])
    gc.collect()
    baseline = _dlpack.live_exports()
    w = hearth.attach(model, socket=store.socket)
    for name, (_, shape, values) in expected.items():
        t = w[name]
        x = torch.from_dlpack(t)
        assert x.device == torch.device(DEVICE)
        assert x.data_ptr() == t.data_ptr, "from_dlpack copied"
        assert tuple(x.shape) == shape
        np.testing.assert_array_equal(x.cpu().numpy(), values)
        assert t.tobytes() == values.tobytes()
        del x
    gc.collect()
    assert _dlpack.live_exports() == baseline


@cuda_only
def test_cuda_torch_state_dict_zero_copy_and_forward(store):
    torch = _cuda_torch()
    import hearth.torch as ht

    expected = read_safetensors(store.files["mlp"])
    w = hearth.attach("mlp", socket=store.socket)
    sd = ht.state_dict(w)
    assert sorted(sd) == sorted(expected)
    for name, tensor in sd.items():
        assert tensor.device == torch.device(DEVICE)
        assert tensor.data_ptr() == w[name].data_ptr

    module = ht.load_into(_mlp_module(torch, MLP_DIMS), w)
    for name, tensor in module.state_dict().items():
        assert tensor.device == torch.device(DEVICE)
        assert tensor.data_ptr() == w[name].data_ptr, f"{name} is not the shared view"

    reference = _mlp_module(torch, MLP_DIMS)  # on the host, from the file
    reference.load_state_dict({k: torch.from_numpy(v[2].copy()) for k, v in expected.items()})
    x = torch.randn(5, MLP_DIMS[0], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = module(x.to(DEVICE)).cpu()
        want = reference(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


_FORK_SCRIPT = r"""
import json, os, sys
import torch
import hearth

socket = sys.argv[1]


def in_child(case):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            case()
            result = "no error"
        except hearth.HearthError as e:
            result = "HearthError: " + str(e)
        except BaseException as e:
            result = f"{type(e).__name__}: {e}"
        with os.fdopen(w, "w") as f:
            f.write(result)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        result = f.read()
    _, status = os.waitpid(pid, 0)
    return {"status": os.waitstatus_to_exitcode(status), "result": result}


torch.cuda.init()
assert torch.cuda.is_initialized()
report = {}
# 1. attach() recorded in a parent that initialised CUDA (libhearth not even loaded): the
#    child's first use.
lazy = hearth.attach("scale", socket=socket)
report["first_use"] = in_child(lambda: len(lazy))
# 2. The parent attached and used the model on the GPU too.
held = hearth.attach("mlp", socket=socket)
tensor = held["head.bias"]
parent_bytes = tensor.tobytes()
report["reattach"] = in_child(lambda: held["head.bias"])
report["inherited_tobytes"] = in_child(tensor.tobytes)
report["inherited_dlpack"] = in_child(tensor.__dlpack__)
report["inherited_interface"] = in_child(lambda: tensor.__cuda_array_interface__)
# The parent is unaffected.
report["parent_ok"] = (held["head.bias"].tobytes() == parent_bytes and len(lazy) == 1
                       and lazy.device.startswith("cuda"))
print(json.dumps(report))
"""


@cuda_only
def test_cuda_child_forked_after_cuda_init_gets_the_explanation(store):
    _cuda_torch()
    # A fresh interpreter does the forking: the test process's own CUDA state is not forked.
    proc = run_script(_FORK_SCRIPT, store.socket)
    assert proc.returncode == 0, f"script failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report.pop("parent_ok") is True, report
    for case, child in report.items():
        assert child["status"] == 0, f"{case}: the child died: {child}"
        message = child["result"]
        assert message.startswith("HearthError: "), f"{case}: {message}"
        assert "forked from a parent that had initialised CUDA" in message, f"{case}: {message}"
        assert "'spawn'" in message and "forkserver" in message, f"{case}: {message}"
    for case in ("inherited_tobytes", "inherited_dlpack", "inherited_interface"):
        assert "cannot be used in forked process" in report[case]["result"], report[case]


@cuda_only
def test_cuda_write_through_the_mapping_fails_in_that_process_only(store):
    _cuda_torch()
    expected = read_safetensors(store.files["scale"])["weight"][2]
    proc = run_script("""
        import sys, torch, hearth
        t = torch.from_dlpack(hearth.attach("scale", socket=sys.argv[1])["weight"])
        print("read", float(t[0]), flush=True)
        t.add_(1)  # the mapping is read-only: the GPU faults
        torch.cuda.synchronize()
        print("write succeeded", float(t[0]), flush=True)
        """, store.socket)
    assert "read " in proc.stdout, f"the child could not even read:\n{proc.stdout}\n{proc.stderr}"
    assert "write succeeded" not in proc.stdout, proc.stdout
    assert proc.returncode != 0, f"the write did not fail:\n{proc.stdout}\n{proc.stderr}"
    # The store and everybody else still see the checkpoint's bytes.
    assert store.proc.poll() is None, "the store died"
    w = hearth.attach("scale", socket=store.socket)
    assert w["weight"].tobytes() == expected.tobytes()
    torch = _cuda_torch()
    np.testing.assert_array_equal(torch.from_dlpack(w["weight"]).cpu().numpy(), expected)
    out = run_python(f"""
        import hearth
        print(hearth.attach("scale", socket={store.socket!r})["weight"].tobytes().hex())
        """)
    assert out.strip() == expected.tobytes().hex()


def _device_used(torch):
    free, total = torch.cuda.mem_get_info(_device_index())
    return total - free


def _settled_device_used(torch):
    last = _device_used(torch)
    for _ in range(100):
        time.sleep(0.05)
        now = _device_used(torch)
        if abs(now - last) < MIB:
            return now
        last = now
    return last


def _cuda_cycle(torch, socket):
    w = hearth.attach("mlp", socket=socket)
    x = torch.from_dlpack(w["encoder.weight"])  # first use: attach and map in this process
    total = float(x.sum())
    return total + len(w["head.bias"].tobytes())


@cuda_only
def test_cuda_attach_cycles_leak_no_device_memory(store):
    torch = _cuda_torch()
    for _ in range(5):
        _cuda_cycle(torch, store.socket)
    gc.collect()
    torch.cuda.synchronize()
    fds, exports = hearth_fds(), _dlpack.live_exports()
    leases = store_attached_count(store.socket, "mlp")
    before = _settled_device_used(torch)
    for _ in range(200):
        _cuda_cycle(torch, store.socket)
    gc.collect()
    torch.cuda.synchronize()
    after = _settled_device_used(torch)
    assert abs(after - before) <= 4 * MIB, (
        f"device memory in use went from {before / MIB:.1f} to {after / MIB:.1f} MiB "
        "over 200 attach/use/detach cycles")
    assert hearth_fds() == fds  # the CUDA runtime's own descriptors are not ours to count
    assert _dlpack.live_exports() == exports
    # The store sees each detach as its socket closes.
    wait_for(lambda: store_attached_count(store.socket, "mlp") == leases,
             f"the store to count {leases} leases of mlp again", timeout=10)
