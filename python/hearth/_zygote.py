"""The zygote of a `backend: python` model: one process per model that has
imported what its workers import (torch, hearth, the model's model.py and
what that imports) and never touched a device, from which `hearth serve`
forks each worker. A worker forked from it skips the seconds of imports and
creates its own CUDA context after the fork.

It speaks a small protocol on its control socket (descriptor 3, a
SOCK_SEQPACKET socket; one message per packet, fields separated by NUL):

    zygote -> server   ready\\0<phase>=<seconds>...   imports done: fork requests are taken
                       refused\\0<reason>             it cannot fork safely (a device is in
                                                     use, threads run): it exits
                       failed\\0<text>                its start failed (model.py raised): it exits
    server -> zygote   fork\\0<argument>...           with two descriptors (SCM_RIGHTS): the new
                                                     worker's control socket and request slot
    zygote -> server   forked\\0<pid>                 a worker process, the server's own child
                       error\\0<text>                 this fork failed

Each worker is forked twice over: the zygote forks a short-lived child that
forks the worker and exits, so that the worker is handed to the nearest
subreaper, the server (PR_SET_CHILD_SUBREAPER), which waits for it, kills
it and reads how it ended as it does for an exec'd worker. The worker
arms PR_SET_PDEATHSIG once it is the server's child, puts its two
descriptors at 3 and 4 (replacing the zygote's socket, which it never
keeps), and goes on as a worker whose imports are done.

End-of-file on the socket: the server let the zygote go; it exits.

The zygote learns what its workers import. Much of a model's start is
imports that happen only when `initialize` first calls something (torch
imports torch._dynamo and sympy on first use of some operators, for
seconds). Each forked worker is given the write end of a pipe; once its
`initialize` has run it writes there the names of the modules it imported
since the fork, and the zygote, between two fork requests, imports those
it lacks: the workers it forks next start with them. An import that makes
the zygote unsafe to fork from (a device touched, a thread started) is
caught by the checks before the next fork, and the model's workers are
exec'd from then on.
"""

import ctypes
import importlib
import os
import re
import select
import socket
import struct
import sys
import threading
import time

# Device files whose descriptors mean that a device was initialised in this
# process: a context must never be inherited through fork.
_DEVICE_FILES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/")
_MAX_MESSAGE = 64 << 10
# What a worker tells the zygote it imported: at most a pipe's buffer, so its
# write never waits for the zygote.
_MAX_LEARNED = 60 << 10
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

# In a forked worker: the pipe to report its imports on, and the modules it
# had when it was forked.
_learn_fd = None
_forked_with = frozenset()


def _forked(learn_fd):
    global _learn_fd, _forked_with
    _learn_fd, _forked_with = learn_fd, frozenset(sys.modules)


def report_imports():
    """In a worker forked from the zygote, once its start is over: tells the
    zygote which modules it imported since the fork (and closes the pipe).
    Nothing elsewhere."""
    global _learn_fd
    if _learn_fd is None:
        return
    fd, _learn_fd = _learn_fd, None
    try:
        names = sorted(set(sys.modules) - _forked_with)
        data = b""
        for name in names:
            line = name.encode(errors="replace") + b"\n"
            if len(data) + len(line) > _MAX_LEARNED:
                break
            data += line
        os.set_blocking(fd, False)
        os.write(fd, data)
    except OSError:
        pass  # the zygote is gone, or its pipe full: it learns nothing this time
    finally:
        os.close(fd)
_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
_SIGKILL = 9


def _device_prefixes():
    """The device files, and those HEARTH_ZYGOTE_DEVICE_FILES adds (a colon-
    separated list of path prefixes; tests stand a plain file in for a GPU)."""
    extra = [p for p in os.environ.get("HEARTH_ZYGOTE_DEVICE_FILES", "").split(":") if p]
    return _DEVICE_FILES + tuple(extra)


def unsupported():
    """Why this interpreter cannot be a zygote (it lacks what forking needs), or None."""
    if not hasattr(socket, "recv_fds"):
        return f"Python {sys.version.split()[0]} has no socket.recv_fds (3.9 and later have it)"
    return None


def device_in_use():
    """Why this process must not fork workers (a device was initialised in
    it), or None."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return "torch has initialised CUDA in it"
        except AttributeError:
            pass
    prefixes = _device_prefixes()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError as e:
        return f"its descriptors cannot be listed ({e})"
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed since
        if target.startswith(prefixes):
            return f"descriptor {fd} is open on {target} (a device was initialised)"
    return None


def threads_running():
    """Why forking would be unsafe because Python threads run (started by
    model.py or what it imports), or None: a fork copies only the calling
    thread, and a lock another one held stays held for ever in the child.
    Native pools (OpenBLAS's, OpenMP's) that libraries start at load are not
    counted: they idle between calls and their libraries re-create them in a
    forked child (pthread_atfork), as every pre-forking server relies on."""
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return (f"{len(others)} Python threads run in it ({', '.join(others[:4])}), started by "
                "model.py or what it imports; a forked worker could inherit a lock one of them holds")
    return None


def native_threads():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def set_process_name(name):
    """The kernel's name of this process (/proc/PID/comm, what ps and top show)."""
    _libc().prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def process_name():
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _wait_for_reparenting(server_pid):
    """Waits until the short-lived child that forked this process has exited
    and the kernel has handed this process to the server (its subreaper).
    Its pidfd becomes readable only after the handover (a pipe's end-of-file
    would come before it: a process's files close before its children are
    handed on)."""
    parent = os.getppid()
    if parent == server_pid:
        return
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # Linux before 5.3: the loop below alone
        fd = None
    if fd is not None:
        try:
            if os.getppid() == parent:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                while not poller.poll():
                    pass
        finally:
            os.close(fd)
    # Without a pidfd: the handover follows the child's exit by microseconds.
    deadline = time.monotonic() + 10
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.001)


class Zygote:
    """The zygote's end of its control socket."""

    def __init__(self, control_fd, server_pid):
        self.sock = socket.socket(fileno=control_fd)
        self.server_pid = server_pid
        self.learning = {}  # a forked worker's pipe -> what it has written so far

    def send(self, *fields):
        self.sock.send(b"\0".join(f if isinstance(f, bytes) else str(f).encode(errors="replace")
                                  for f in fields)[:_MAX_MESSAGE])

    def serve(self, run_worker):
        """Forks a worker for each request until the server lets the zygote
        go. `run_worker(args)` runs in each worker and returns its exit code.
        Returns the zygote's exit code."""
        while True:
            if not self._wait_for_request():
                continue
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, _MAX_MESSAGE, 2)
            except InterruptedError:
                continue
            except OSError as e:
                print(f"hearth.backend_worker zygote: {e}", file=sys.stderr)
                return 1
            if not data and not fds:
                return 0  # end-of-file: the server let it go
            try:
                fields = data.split(b"\0")
                if fields[0] != b"fork" or len(fds) != 2:
                    self.send("error", f"not a fork request ({len(fds)} descriptors, "
                              f"{fields[0][:32]!r})")
                    continue
                why = device_in_use() or threads_running()
                if why is not None:
                    self.send("refused", why)
                    return 0
                args = [f.decode(errors="replace") for f in fields[1:]]
                try:
                    pid = self._fork(fds[0], fds[1], args, run_worker)
                except OSError as e:
                    self.send("error", f"fork: {e}")
                    continue
                self.send("forked", pid)
            finally:
                for fd in fds:
                    os.close(fd)

    def _wait_for_request(self):
        """Waits until the socket is readable, meanwhile reading what forked
        workers report of their imports and importing it. True once a
        request (or the socket's end) is there."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        for fd in self.learning:
            poller.register(fd, select.POLLIN)
        try:
            ready = poller.poll()
        except InterruptedError:
            return False
        request = False
        for fd, _ in ready:
            if fd == self.sock.fileno():
                request = True
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if chunk and len(self.learning[fd]) < _MAX_LEARNED:
                self.learning[fd] += chunk
                continue
            self._learn(bytes(self.learning.pop(fd)))
            os.close(fd)
        return request

    def _learn(self, data):
        """Imports the modules a worker reported that this process lacks."""
        names = [n for n in data.decode(errors="replace").split("\n")
                 if _MODULE_NAME.fullmatch(n) and n not in sys.modules]
        if not names:
            return
        began = time.monotonic()
        imported = 0
        for name in sorted(names, key=lambda n: n.count(".")):  # parents first
            if name in sys.modules:
                continue
            try:
                importlib.import_module(name)
                imported += 1
            except Exception:  # noqa: BLE001  a module that imports only in its context
                pass
        print(f"hearth.backend_worker zygote {os.getpid()}: imported {imported} of the {len(names)} "
              f"modules its workers import while they start, in {time.monotonic() - began:.3f} s",
              file=sys.stderr, flush=True)

    def _fork(self, control, slot, args, run_worker):
        """Forks the worker through a child that exits at once; returns the
        worker's pid once the worker is the server's child."""
        sys.stdout.flush()
        sys.stderr.flush()
        report_r, report_w = os.pipe()
        learn_r, learn_w = os.pipe()
        try:
            child = os.fork()
        except OSError:
            for fd in (report_r, report_w, learn_r, learn_w):
                os.close(fd)
            raise
        if child == 0:  # the short-lived child
            code = 1
            try:
                os.close(report_r)
                os.close(learn_r)
                for fd in self.learning:
                    os.close(fd)
                worker = os.fork()
                if worker == 0:
                    os.close(report_w)
                    _forked(learn_w)
                    self._become_worker(control, slot, args, run_worker)  # never returns
                os.write(report_w, struct.pack("<q", worker))
                code = 0
            finally:
                os._exit(code)
        os.close(report_w)
        os.close(learn_w)
        os.set_blocking(learn_r, False)
        self.learning[learn_r] = bytearray()
        try:
            raw = b""
            while len(raw) < 8:
                got = os.read(report_r, 8 - len(raw))
                if not got:
                    break
                raw += got
        finally:
            os.close(report_r)
            os.waitpid(child, 0)
        if len(raw) != 8:
            raise OSError("the forking child exited before it forked the worker")
        return struct.unpack("<q", raw)[0]

    def _become_worker(self, control, slot, args, run_worker):
        code = 1
        try:
            _wait_for_reparenting(self.server_pid)
            _libc().prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
            if os.getppid() != self.server_pid:
                print(f"hearth.backend_worker {os.getpid()}: forked for a server (pid "
                      f"{self.server_pid}) that is not its parent (pid {os.getppid()}): the server "
                      "is gone, or is not a subreaper", file=sys.stderr, flush=True)
                return
            # The zygote's socket is never the worker's: descriptor 3 becomes
            # the worker's control socket, 4 its slot.
            self.sock.detach()
            os.dup2(control, 3)
            os.dup2(slot, 4)
            for fd in (control, slot):
                if fd not in (3, 4):
                    os.close(fd)
            code = run_worker(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001  the worker must never return into the zygote
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
