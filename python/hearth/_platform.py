"""What the Python package does differently on Linux and on Windows.

The rest of the package asks `current()` and never reads sys.platform itself:

- the library: libhearth.so on Linux, hearth.dll on Windows, where each is
  searched for and how it is loaded;
- the store's address: on Linux a Unix socket path; on Windows a pipe name
  (1 to 64 of [A-Za-z0-9._-]), the pipe being \\\\.\\pipe\\hearth-<user SID>-<name>;
- a device's store among several (device_address), and what each system lacks
  (trusting a store of another uid; `hearth serve`'s Python workers, which
  receive descriptors and fork).

Nothing here attaches: the library does, through the same C ABI on both
systems. A Windows section handle is duplicated into this process by
hearth.dll and stays inside it; Python holds only the opaque
hearth_attachment pointer, as on Linux.

`current()` reads sys.platform at each call, so tests on Linux pick the
Windows branch by setting sys.platform to "win32", or build `Windows(...)`
with fakes for the file system, PATH and the loader.
"""

import ctypes
import ctypes.util
import os
import pathlib
import re
import shutil
import struct
import sys

# python/hearth/_platform.py -> the repository root is three levels up.
_PACKAGE = pathlib.Path(__file__).resolve().parent
_ROOT = _PACKAGE.parent.parent


def current():
    """The platform of this interpreter: Windows() on win32, Linux() elsewhere."""
    return Windows() if sys.platform == "win32" else Linux()


def _device_suffixed(name, suffix):
    # The store's rule (DeviceSocketPath): before a final ".sock", else at the end.
    if name.endswith(".sock") and len(name) > len(".sock"):
        return name[:-len(".sock")] + suffix + ".sock"
    return name + suffix


class Linux:
    """libhearth.so, Unix socket paths, descriptors over SCM_RIGHTS, fork."""

    library_name = "libhearth"

    def __init__(self, root=_ROOT, find_library=None, loader=None):
        self._root = pathlib.Path(root)
        self._find_library = find_library or ctypes.util.find_library
        self._loader = loader or ctypes.CDLL

    def library_candidates(self):
        """The places searched when $HEARTH_LIBRARY is unset, as (source, path) pairs."""
        found = []
        repo = self.repository_library()
        if repo.exists():
            found.append(("repository build", str(repo)))
        system = self._find_library("hearth")
        if system:
            found.append(("system library path", system))
        return found

    def repository_library(self):
        return self._root / "build" / "src" / "capi" / "libhearth.so"

    def not_found(self):
        return (f"$HEARTH_LIBRARY is unset, {self.repository_library()} does not exist, "
                "and ctypes.util.find_library('hearth') found nothing")

    def build_advice(self):
        return ("Build it with `cmake --build build --target hearth` or set HEARTH_LIBRARY to "
                "libhearth.so")

    def load(self, path):
        return self._loader(path)

    def check_address(self, address, source):
        """The store's address as a str; a socket path is any path."""
        return os.fspath(address)

    def describe_address(self, address):
        return address

    def device_address(self, address, device_name):
        """`device_name`'s store among several: store.sock -> store-cuda1.sock."""
        address = os.fspath(address)
        head, sep, name = address.rpartition("/")
        return head + sep + _device_suffixed(name, "-" + device_name.replace(":", ""))

    def store_uid_unsupported(self):
        return None

    def serve_worker_unsupported(self):
        return None


_PIPE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PIPE_PREFIX = "\\\\.\\pipe\\"


class Windows:
    """hearth.dll, named pipes of one user, section handles duplicated by the store."""

    library_name = "hearth.dll"

    def __init__(self, root=_ROOT, package=_PACKAGE, find_library=None, which=None,
                 loader=None, pointer_bytes=None):
        self._root = pathlib.Path(root)
        self._package = pathlib.Path(package)
        self._find_library = find_library or ctypes.util.find_library
        self._which = which or shutil.which
        self._loader = loader or ctypes.CDLL
        self._pointer_bytes = pointer_bytes or struct.calcsize("P")

    def repository_libraries(self):
        # The cross build (make windows), then a build made on Windows: beside
        # hearth.exe in bin, or where the target's folder is (as on Linux).
        return [self._root / build / folder / "hearth.dll"
                for build in ("build-windows", "build")
                for folder in (pathlib.Path("bin"), pathlib.Path("src", "capi"))]

    def library_candidates(self):
        """The places searched when $HEARTH_LIBRARY is unset, as (source, path) pairs:
        the repository's builds, hearth.dll copied into this package's folder,
        the folder of the hearth.exe on PATH, then ctypes.util.find_library
        (which looks through PATH)."""
        found = [("repository build", str(p)) for p in self.repository_libraries() if p.exists()]
        beside = self._package / "hearth.dll"
        if beside.exists():
            found.append(("package folder", str(beside)))
        exe = self._which("hearth.exe")
        if exe:
            dll = pathlib.Path(exe).resolve().parent / "hearth.dll"
            if dll.exists():
                found.append(("beside hearth.exe on PATH", str(dll)))
        system = self._find_library("hearth")
        if system:
            found.append(("PATH", system))
        unique = []
        for source, path in found:
            if all(path != p for _, p in unique):
                unique.append((source, path))
        return unique

    def not_found(self):
        return ("$HEARTH_LIBRARY is unset, and no hearth.dll is in "
                + ", ".join(str(p) for p in self.repository_libraries())
                + f", {self._package}, beside a hearth.exe on PATH or on PATH")

    def build_advice(self):
        return ("Build it with `make windows` (hearth.dll lands in build-windows\\bin), copy it "
                "with its hearth.exe into a folder on PATH, or set HEARTH_LIBRARY to the full "
                "path of hearth.dll")

    def load(self, path):
        """Loads hearth.dll with CDLL: x64 has one C calling convention (WinDLL
        is for 32-bit stdcall). Given a path with a folder in it, Python 3.8+
        loads it by its full path and searches that folder for the DLL's
        dependencies too (a MinGW build linked without -static needs its
        runtime DLLs there); a bare name is searched in the system's folders."""
        if self._pointer_bytes != 8:
            raise OSError(f"hearth.dll is built for 64-bit Windows; this Python is "
                          f"{self._pointer_bytes * 8}-bit (install the 64-bit Python)")
        try:
            return self._loader(path)
        except OSError as e:
            raise OSError(f"{e} (hearth.dll and any DLL it needs must be in its folder, "
                          "or in one given to os.add_dll_directory)") from None

    def check_address(self, address, source):
        """The pipe name itself; ValueError naming `source` for a path or a bad name."""
        name = os.fspath(address)
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        if name == "" or _PIPE_NAME.fullmatch(name):
            return name  # "": the library's default, as on Linux
        if name.startswith(_PIPE_PREFIX):
            raise ValueError(
                f"{source} is a full pipe path ({name!r}); on Windows give only the store's "
                "pipe name, the NAME of `hearth store --socket NAME` (hearth makes the pipe "
                "\\\\.\\pipe\\hearth-<user SID>-NAME)")
        if "/" in name or "\\" in name or ":" in name:
            raise ValueError(
                f"{source} is a path ({name!r}), but on Windows the store's address is a pipe "
                "name: 1 to 64 of A-Z a-z 0-9 . _ - (e.g. 'store'), as given to "
                "`hearth store --socket NAME`")
        raise ValueError(
            f"{source} is not a pipe name: {name!r}; on Windows the store's address is 1 to "
            "64 of A-Z a-z 0-9 . _ - (e.g. 'store')")

    def describe_address(self, address):
        return f"pipe '{address}'"

    def device_address(self, address, device_name):
        """`device_name`'s store among several: store -> store-cuda1, a.sock -> a-cuda1.sock."""
        name = self.check_address(address, "the store's pipe name")
        full = _device_suffixed(name, "-" + device_name.replace(":", ""))
        if len(full) > 64:
            raise ValueError(f"the pipe name of {device_name}'s store, {full!r}, is longer than "
                             f"64 characters; give the store a shorter name than {name!r}")
        return full

    def store_uid_unsupported(self):
        return ("store_uid trusts a store of another Linux uid; on Windows a store's pipe "
                "belongs to one user (its name holds the user's SID), so attach to a store run "
                "by your own user")

    def serve_worker_unsupported(self):
        return ("hearth.backend_worker is a worker of `hearth serve`, which runs on Linux only; "
                "on Windows run `hearth store` and attach from your own workers with "
                "hearth.attach() (docs/windows.md)")
