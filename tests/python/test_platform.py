"""Tests of python/hearth/_platform.py: the package's Linux and Windows branches.

There is no Windows interpreter here. The Windows branch is picked by setting
sys.platform to "win32" (what `_platform.current()` reads) or by building
`_platform.Windows(...)` with a fake file tree, PATH and loader; what it
chooses (the library's name and places, how it is loaded, the store's pipe
name and its checks, the errors) is checked on Linux. Loading a real
hearth.dll and attaching through it are not run here; the real attach is
tested on Linux in test_hearth.py.
"""

import ctypes
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))

import hearth  # noqa: E402
import hearth.backend_worker  # noqa: E402
from hearth import _capi, _platform  # noqa: E402


@pytest.fixture
def windows(monkeypatch):
    """This interpreter seen as Windows by the package (sys.platform only)."""
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.delenv("HEARTH_SOCKET", raising=False)
    monkeypatch.delenv("HEARTH_LIBRARY", raising=False)


def touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


class Recorder:
    def __init__(self, result=None, error=None):
        self.calls = []
        self.result = result
        self.error = error

    def __call__(self, *args):
        self.calls.append(args)
        if self.error:
            raise self.error
        return self.result


# ---- which platform --------------------------------------------------------


@pytest.mark.parametrize("name, kind", [("win32", _platform.Windows), ("linux", _platform.Linux),
                                        ("darwin", _platform.Linux)])
def test_the_platform_follows_sys_platform(monkeypatch, name, kind):
    monkeypatch.setattr(sys, "platform", name)
    assert isinstance(_platform.current(), kind)


# ---- finding and loading the library ---------------------------------------


def test_windows_searches_hearth_dll_in_order(tmp_path):
    repo_build = touch(tmp_path / "repo" / "build-windows" / "bin" / "hearth.dll")
    target_folder = touch(tmp_path / "repo" / "build-windows" / "src" / "capi" / "hearth.dll")
    native_build = touch(tmp_path / "repo" / "build" / "bin" / "hearth.dll")
    package = touch(tmp_path / "site" / "hearth" / "hearth.dll").parent
    beside_exe = touch(tmp_path / "Program Files" / "hearth" / "hearth.dll")
    touch(beside_exe.parent / "hearth.exe")
    which = Recorder(str(beside_exe.parent / "hearth.exe"))
    find_library = Recorder("C:\\Windows\\System32\\hearth.dll")
    w = _platform.Windows(root=tmp_path / "repo", package=package, which=which,
                          find_library=find_library)
    assert w.library_candidates() == [
        ("repository build", str(repo_build)),
        ("repository build", str(target_folder)),
        ("repository build", str(native_build)),
        ("package folder", str(package / "hearth.dll")),
        ("beside hearth.exe on PATH", str(beside_exe)),
        ("PATH", "C:\\Windows\\System32\\hearth.dll"),
    ]
    assert which.calls == [("hearth.exe",)]
    assert find_library.calls == [("hearth",)]  # ctypes looks for hearth.dll on PATH


def test_windows_never_takes_the_linux_library(tmp_path):
    touch(tmp_path / "build" / "src" / "capi" / "libhearth.so")
    w = _platform.Windows(root=tmp_path, package=tmp_path / "pkg", which=Recorder(None),
                          find_library=Recorder(None))
    assert w.library_candidates() == []
    assert w.library_name == "hearth.dll"
    message = w.not_found()
    assert str(tmp_path / "build-windows" / "bin" / "hearth.dll") in message
    assert "HEARTH_LIBRARY" in message and "PATH" in message


def test_linux_search_is_unchanged(tmp_path):
    so = touch(tmp_path / "build" / "src" / "capi" / "libhearth.so")
    touch(tmp_path / "build-windows" / "bin" / "hearth.dll")
    find_library = Recorder("libhearth.so.1")
    linux = _platform.Linux(root=tmp_path, find_library=find_library)
    assert linux.library_candidates() == [("repository build", str(so)),
                                          ("system library path", "libhearth.so.1")]
    assert find_library.calls == [("hearth",)]
    repository = _platform.Linux().repository_library()
    assert repository == ROOT / "build" / "src" / "capi" / "libhearth.so"


def test_windows_loads_the_dll_by_its_path_with_cdll():
    loader = Recorder("the library")
    w = _platform.Windows(loader=loader, pointer_bytes=8)
    assert w.load("C:\\hearth\\build-windows\\bin\\hearth.dll") == "the library"
    assert loader.calls == [("C:\\hearth\\build-windows\\bin\\hearth.dll",)]
    assert _platform.Windows()._loader is ctypes.CDLL  # cdecl: x64's one convention


def test_windows_refuses_a_32_bit_python():
    loader = Recorder("the library")
    with pytest.raises(OSError, match="64-bit Windows; this Python is 32-bit"):
        _platform.Windows(loader=loader, pointer_bytes=4).load("C:\\h\\hearth.dll")
    assert loader.calls == []


def test_windows_load_failure_says_where_dependencies_go():
    loader = Recorder(error=FileNotFoundError("Could not find module 'C:\\h\\hearth.dll' "
                                              "(or one of its dependencies)"))
    with pytest.raises(OSError) as info:
        _platform.Windows(loader=loader, pointer_bytes=8).load("C:\\h\\hearth.dll")
    assert "Could not find module" in str(info.value)
    assert "os.add_dll_directory" in str(info.value)


def test_library_error_on_windows_names_hearth_dll(windows, monkeypatch):
    monkeypatch.setattr(_capi, "_lib", None)
    monkeypatch.setenv("HEARTH_LIBRARY", "C:\\nowhere\\hearth.dll")
    with pytest.raises(OSError) as info:
        _capi.library()
    message = str(info.value)
    assert message.startswith("hearth: cannot load hearth.dll "
                              "($HEARTH_LIBRARY C:\\nowhere\\hearth.dll:")
    assert "make windows" in message and "HEARTH_LIBRARY" in message
    assert "libhearth.so" not in message
    assert _capi._lib is None


def test_library_error_on_linux_is_unchanged(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(_capi, "_lib", None)
    monkeypatch.setenv("HEARTH_LIBRARY", "/nonexistent/libhearth.so")
    with pytest.raises(OSError) as info:
        _capi.library()
    assert str(info.value).startswith("hearth: cannot load libhearth ($HEARTH_LIBRARY "
                                      "/nonexistent/libhearth.so:")
    assert str(info.value).endswith("Build it with `cmake --build build --target hearth` or set "
                                    "HEARTH_LIBRARY to libhearth.so")


# ---- the store's address ----------------------------------------------------


@pytest.mark.parametrize("name", ["store", "a.b_c-1", "x" * 64, "store.sock", ""])
def test_windows_takes_pipe_names(name):
    assert _platform.Windows().check_address(name, "socket") == name


@pytest.mark.parametrize("address, says", [
    ("C:\\Users\\me\\store.sock", "socket is a path ('C:\\\\Users"),
    ("/tmp/hearth/store.sock", "socket is a path ('/tmp/hearth/store.sock')"),
    ("data:store", "socket is a path"),
    ("\\\\.\\pipe\\hearth-S-1-5-21-1-2-3-1001-store", "socket is a full pipe path"),
    ("x" * 65, "socket is not a pipe name"),
    ("my store", "socket is not a pipe name: 'my store'"),
    ("st\u00f6re", "socket is not a pipe name"),
])
def test_windows_refuses_paths_and_bad_names(address, says):
    with pytest.raises(ValueError) as info:
        _platform.Windows().check_address(address, "socket")
    message = str(info.value)
    assert message.startswith(says)
    assert "1 to 64 of A-Z a-z 0-9 . _ -" in message or "give only the store's pipe name" in message


def test_linux_takes_any_socket_path():
    linux = _platform.Linux()
    assert linux.check_address(pathlib.Path("/run/h/store.sock"), "socket") == "/run/h/store.sock"
    assert linux.check_address("C:\\odd but a path", "socket") == "C:\\odd but a path"
    assert linux.describe_address("/run/h/store.sock") == "/run/h/store.sock"


def test_attach_on_windows_checks_the_address_at_once(windows, monkeypatch):
    with pytest.raises(ValueError, match=r"^hearth.attach: socket is a path \('C:"):
        hearth.attach("mlp", socket="C:\\hearth\\store.sock")
    with pytest.raises(ValueError, match="full pipe path"):
        hearth.attach("mlp", socket="\\\\.\\pipe\\hearth-S-1-5-21-9-store")
    assert hearth.attach("mlp", socket="demo")._socket == "demo"
    monkeypatch.setenv("HEARTH_SOCKET", "/tmp/hearth/store.sock")
    with pytest.raises(ValueError, match=r"^hearth.attach: \$HEARTH_SOCKET is a path"):
        hearth.attach("mlp")
    monkeypatch.setenv("HEARTH_SOCKET", "demo")
    assert hearth.attach("mlp")._socket == "demo"
    with pytest.raises(ValueError, match="longer than 64 characters"):
        hearth.attach("mlp", socket="n" * 60, device="cuda:1")


def test_attach_on_linux_still_takes_paths(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert hearth.attach("mlp", socket="/tmp/x/store.sock")._socket == "/tmp/x/store.sock"
    assert hearth.attach("mlp", socket=pathlib.Path("/tmp/s.sock"))._socket == "/tmp/s.sock"


def test_device_socket_on_windows_names_a_pipe(windows):
    assert hearth.device_socket("store", "cuda:1") == "store-cuda1"
    assert hearth.device_socket("store", 0) == "store-cuda0"
    assert hearth.device_socket("store.sock", "cpu") == "store-cpu.sock"
    assert hearth.device_socket("demo", "host1") == "demo-host1"
    assert hearth.device_socket("x" * 58, "cuda:1") == "x" * 58 + "-cuda1"  # 64: the most
    with pytest.raises(ValueError, match="longer than 64 characters"):
        hearth.device_socket("x" * 59, "cuda:1")
    with pytest.raises(ValueError, match="is a path"):
        hearth.device_socket("C:\\run\\store.sock", "cuda:1")
    with pytest.raises(ValueError, match="device must be"):
        hearth.device_socket("store", "gpu1")


def test_store_uid_is_refused_on_windows_saying_why(windows):
    with pytest.raises(ValueError, match="store_uid trusts a store of another Linux uid; on "
                                         "Windows a store's pipe belongs to one user"):
        hearth.attach("mlp", socket="demo", store_uid=1000)
    assert hearth.attach("mlp", socket="demo", store_uid=None)._store_uids == ()


# ---- the attach path on Windows, down to the C ABI call --------------------


class FakeLibrary:
    """Stands in for hearth.dll: records hearth_attach's arguments and fails it."""

    def __init__(self, default=b"store"):
        self.default = default
        self.attached = []

    def hearth_default_socket(self):
        return self.default

    def hearth_attach(self, address, model, version, handle):
        self.attached.append((address, model, version))
        return _capi.ERROR_UNAVAILABLE

    def hearth_last_error(self):
        return b"no store answers on the pipe"


def test_windows_attach_passes_the_pipe_name_to_the_library(windows, monkeypatch):
    lib = FakeLibrary()
    monkeypatch.setattr(_capi, "_lib", lib)
    with pytest.raises(hearth.Unavailable) as info:
        len(hearth.attach("mlp"))  # the library's default name
    assert str(info.value) == "hearth: attach mlp from pipe 'store': no store answers on the pipe"
    with pytest.raises(hearth.Unavailable, match="from pipe 'demo-cuda1'"):
        hearth.attach("mlp", socket="demo", version=3, device="cuda:1")["w"]
    monkeypatch.setenv("HEARTH_SOCKET", "envname")
    with pytest.raises(hearth.Unavailable, match="from pipe 'envname'"):
        hearth.attach("mlp").checksum
    assert lib.attached == [(b"store", b"mlp", 0), (b"demo-cuda1", b"mlp", 3),
                            (b"envname", b"mlp", 0)]


def test_windows_refuses_a_default_address_that_is_not_a_pipe_name(windows, monkeypatch):
    lib = FakeLibrary(default=b"/tmp/hearth-1000/store.sock")
    monkeypatch.setattr(_capi, "_lib", lib)
    with pytest.raises(hearth.InvalidArgument, match="the library's default store address is a "
                                                     "path"):
        len(hearth.attach("mlp"))
    assert lib.attached == []


# ---- what Windows lacks ------------------------------------------------------


def test_backend_worker_says_hearth_serve_is_linux_only(windows, capsys):
    assert hearth.backend_worker.main(["--store-socket", "x"]) == 2
    err = capsys.readouterr().err
    assert "runs on Linux only" in err and "hearth store" in err


def test_import_needs_no_fork():
    # Windows' os has no register_at_fork; importing the package must not need it
    # (random, which the standard library imports on the way, is loaded first: it needs it).
    code = ("import os, sys, random; del os.register_at_fork; sys.path.insert(0, sys.argv[1]); "
            "import hearth, hearth.torch, hearth.transformers; "
            "w = hearth.attach('mlp', socket='x'); print('imported', w.attached)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "python")], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    assert out == "imported False\n"
