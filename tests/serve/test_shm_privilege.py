"""System shared memory cannot cross a privilege boundary.

`hearth serve` may run as root and open objects that its clients cannot. A
client of another user (run with setpriv) asks it to register a root-only
object, over REST and gRPC: refused (403 / PERMISSION_DENIED), logged, the
object untouched. Allowed users name only their own objects; links,
directories and FIFOs get a 4xx naming why; `--shared-memory-users none`
turns it off. Needs root (to be two users) and setpriv (util-linux).
"""
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import urllib.error
import urllib.request

import pytest

from serve_support import SCALE_N, Server

OTHER = 12345
SETPRIV = shutil.which("setpriv")

if os.geteuid() != 0 or SETPRIV is None:
    pytest.skip("needs root and setpriv to run a client as another user", allow_module_level=True)


def as_other(code, *args):
    """Runs Python `code` as uid/gid OTHER; its stdout parsed as JSON."""
    out = subprocess.run([SETPRIV, f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups",
                          "/usr/bin/python3", "-c", code, *map(str, args)],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# A POST as the other user: [status, body].
POST = r"""
import json, sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), method="POST",
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, e.read().decode()]))
"""

# SystemSharedMemoryRegister over gRPC as the other user, the request
# encoded by hand (name=1, key=2, offset=3, byte_size=4): [code, details].
GRPC_REGISTER = r"""
import json, sys, grpc
def varint(n):
    out = b""
    while True:
        b = n & 0x7f; n >>= 7
        out += bytes([b | (0x80 if n else 0)])
        if not n: return out
def field(number, data):
    return varint(number << 3 | 2) + varint(len(data)) + data
name, key, size = sys.argv[2], sys.argv[3], int(sys.argv[4])
body = field(1, name.encode()) + field(2, key.encode()) + varint(4 << 3) + varint(size)
call = grpc.insecure_channel(sys.argv[1]).unary_unary(
    "/inference.GRPCInferenceService/SystemSharedMemoryRegister")
try:
    call(body, timeout=60)
    print(json.dumps(["OK", ""]))
except grpc.RpcError as e:
    print(json.dumps([e.code().name, e.details()]))
"""

# Makes the other user's own object (0600), `size` bytes of float32 1.0.
MAKE_OBJECT = r"""
import json, os, sys
fd = os.open("/dev/shm" + sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, (b"\x00\x00\x80\x3f") * (int(sys.argv[2]) // 4))
os.close(fd)
print(json.dumps(os.stat("/dev/shm" + sys.argv[1]).st_uid))
"""


@pytest.fixture
def victim():
    """A root-only object: what uid OTHER cannot open."""
    key = f"/hearth-victim-{os.getpid()}"
    path = pathlib.Path("/dev/shm" + key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"ROOT" * 1024)
    os.close(fd)
    yield key, path
    path.unlink(missing_ok=True)


def register_body(key, size):
    return json.dumps({"key": key, "offset": 0, "byte_size": size})


def grpc_port(server):
    m = re.search(r"KServe v2 gRPC on [^:]+:(\d+)", server.text())
    assert m, server.text()
    return int(m.group(1))


def test_another_user_cannot_register_roots_object(tmp_path, victim):
    key, path = victim
    assert subprocess.run([SETPRIV, f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", "cat",
                           str(path)], capture_output=True).returncode != 0  # EACCES for OTHER
    server = Server(tmp_path, args=("--grpc-port", "0"))
    try:
        url = f"http://127.0.0.1:{server.port}/v2/systemsharedmemory/region/steal/register"
        status, body = as_other(POST, url, register_body(key, 4096))
        assert status == 403, body
        assert f"uid {OTHER}) may not use shared memory" in body, body
        # Nothing was registered, the refusal is in the log.
        status, body = post_json(f"http://127.0.0.1:{server.port}/v2/systemsharedmemory/status", None)
        assert status == 200 and json.loads(body) == [], body
        assert re.search(r"system shared-memory region 'steal' \(" + re.escape(key) + r"\) from uid "
                         + str(OTHER) + " refused", server.text()), server.text()
    finally:
        server.stop()
    assert path.read_bytes() == b"ROOT" * 1024


def test_an_allowed_user_names_only_its_own_objects(tmp_path, victim):
    key, path = victim
    mine = f"/hearth-mine-{os.getpid()}"
    server = Server(tmp_path, args=("--shared-memory-users", f"root,{OTHER}", "--grpc-port", "0"))
    try:
        url = f"http://127.0.0.1:{server.port}"
        status, body = as_other(POST, f"{url}/v2/systemsharedmemory/region/steal/register",
                                register_body(key, 4096))
        assert status == 403, body
        assert f"belongs to uid 0, not to the client's user (uid {OTHER})" in body, body

        # Its own object: registered, read and written as Triton's clients do.
        assert as_other(MAKE_OBJECT, mine, 4096) == OTHER
        status, body = as_other(POST, f"{url}/v2/systemsharedmemory/region/mine/register",
                                register_body(mine, 4096))
        assert status == 200, body
        request = {"inputs": [{"name": "x", "shape": [1, SCALE_N], "datatype": "FP32",
                               "parameters": {"shared_memory_region": "mine",
                                              "shared_memory_byte_size": SCALE_N * 4}}],
                   "outputs": [{"name": "y", "parameters": {"shared_memory_region": "mine",
                                                            "shared_memory_offset": 2048,
                                                            "shared_memory_byte_size": 4}}]}
        status, body = as_other(POST, f"{url}/v2/models/scale/infer", json.dumps(request))
        assert status == 200, body
        (y,) = struct.unpack("<f", pathlib.Path("/dev/shm" + mine).read_bytes()[2048:2052])
        assert y == pytest.approx(sum(server.weights["scale"]), rel=1e-4)
    finally:
        server.stop()
        pathlib.Path("/dev/shm" + mine).unlink(missing_ok=True)
    assert path.read_bytes() == b"ROOT" * 1024


def other_has_grpc():
    """Whether uid OTHER's Python can import grpc (an interpreter's packages may be root's alone)."""
    return subprocess.run([SETPRIV, f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups",
                           "/usr/bin/python3", "-c", "import grpc"], capture_output=True, cwd="/").returncode == 0


def test_over_grpc_another_user_is_refused_too(tmp_path, victim):
    if not other_has_grpc():
        pytest.skip(f"uid {OTHER}'s /usr/bin/python3 cannot import grpc")
    key, path = victim
    server = Server(tmp_path, args=("--grpc-port", "0"))
    try:
        port = f"127.0.0.1:{grpc_port(server)}"
        code, details = as_other(GRPC_REGISTER, port, "steal", key, 4096)
        assert code == "PERMISSION_DENIED", details
        assert f"uid {OTHER}) may not use shared memory" in details, details
    finally:
        server.stop()
    (tmp_path / "allowed").mkdir()
    allowed = Server(tmp_path / "allowed", args=("--shared-memory-users", f"root,{OTHER}", "--grpc-port", "0"))
    try:
        code, details = as_other(GRPC_REGISTER, f"127.0.0.1:{grpc_port(allowed)}", "steal", key, 4096)
        assert code == "PERMISSION_DENIED" and "belongs to uid 0" in details, details
    finally:
        allowed.stop()
    assert path.read_bytes() == b"ROOT" * 1024


def test_links_directories_and_shared_memory_off(tmp_path, victim):
    key, _ = victim
    base = f"/dev/shm/hearth-odd-{os.getpid()}"
    os.symlink("/dev/shm" + key, base + "-link")
    os.mkdir(base + "-dir", 0o700)
    try:
        server = Server(tmp_path)
        try:
            url = f"http://127.0.0.1:{server.port}/v2/systemsharedmemory/region"
            status, body = post_json(f"{url}/a/register", register_body(base[8:] + "-link", 64))
            assert status == 403 and "symbolic link" in body, body
            status, body = post_json(f"{url}/a/register", register_body(base[8:] + "-dir", 64))
            assert status == 400 and "is a directory" in body, body
            # The server's own user registers its own object.
            status, body = post_json(f"{url}/a/register", register_body(key, 64))
            assert status == 200, body
        finally:
            server.stop()
        (tmp_path / "off").mkdir()
        off = Server(tmp_path / "off", args=("--shared-memory-users", "none"))
        try:
            status, body = post_json(
                f"http://127.0.0.1:{off.port}/v2/systemsharedmemory/region/a/register", register_body(key, 64))
            assert status == 403 and "shared memory is off" in body, body
        finally:
            off.stop()
    finally:
        os.unlink(base + "-link")
        os.rmdir(base + "-dir")


def post_json(url, body):
    """A POST of `body` as this process's user (a GET when it is None): [status, body]."""
    req = urllib.request.Request(url, data=None if body is None else body.encode(),
                                 method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
