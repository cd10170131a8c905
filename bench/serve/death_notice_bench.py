"""How soon a supervisor can know that a SIGKILLed process is dead, by the
size of the process's private memory.

    python3 bench/serve/death_notice_bench.py --mib 10,1000,4000 --repeat 3

A child touches --mib MiB of private memory and waits; the parent SIGKILLs
it and times three signs of its death:

    socket EOF    the end of a socketpair the child holds (how hearth's
                  HangupWatcher learns that a worker died)
    pidfd         the child's pidfd becoming readable (its exit)
    robust mutex  a process-shared robust pthread mutex the child holds,
                  returned to a waiting thread with EOWNERDEAD

The kernel tears down a dying process's memory before it closes its
descriptors and before it exits, so the first two wait for that teardown;
a robust mutex is released when the owning thread leaves, before it.
Prints one line per size and, with --json, writes every time.
"""
import argparse
import ctypes
import json
import mmap
import os
import select
import signal
import socket
import statistics
import threading
import time

EOWNERDEAD = 130


def robust_mutex(libc):
    """A process-shared robust mutex in a shared anonymous page."""
    page = mmap.mmap(-1, 4096, mmap.MAP_SHARED)
    address = ctypes.addressof((ctypes.c_char * 4096).from_buffer(page))
    attr = ctypes.create_string_buffer(64)
    libc.pthread_mutexattr_init(attr)
    libc.pthread_mutexattr_setpshared(attr, 1)
    libc.pthread_mutexattr_setrobust(attr, 1)
    if libc.pthread_mutex_init(ctypes.c_void_p(address), attr) != 0:
        raise SystemExit("pthread_mutex_init failed")
    return page, ctypes.c_void_p(address)


def once(libc, mib):
    page, mutex = robust_mutex(libc)
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        parent.close()
        if libc.pthread_mutex_lock(mutex) != 0:
            os._exit(1)
        memory = bytearray(mib << 20)
        for i in range(0, len(memory), 4096):
            memory[i] = 1
        child.send(b"r")
        time.sleep(3600)
        os._exit(0)
    child.close()
    if parent.recv(1) != b"r":
        raise SystemExit("the child did not start")
    got = {}

    def wait_mutex():
        rc = libc.pthread_mutex_lock(mutex)
        got["mutex"] = time.perf_counter()
        got["rc"] = rc

    waiter = threading.Thread(target=wait_mutex)
    waiter.start()
    time.sleep(0.1)  # the waiter is blocked in the lock (a head start, not a synchronisation)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(parent, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while "eof" not in got or "pidfd" not in got:
        for fd, _ in poller.poll():
            if fd == parent.fileno() and "eof" not in got:
                got["eof"] = time.perf_counter()
                poller.unregister(parent)
            elif fd == pidfd and "pidfd" not in got:
                got["pidfd"] = time.perf_counter()
                poller.unregister(pidfd)
    waiter.join()
    if got["rc"] != EOWNERDEAD:
        raise SystemExit(f"the mutex came back with {got['rc']}, not EOWNERDEAD")
    os.waitpid(pid, 0)
    os.close(pidfd)
    parent.close()
    page.close()
    return {k: (got[k] - killed) * 1e3 for k in ("eof", "pidfd", "mutex")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="10,1000,4000", help="private memory the child touches, MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write every time here")
    a = ap.parse_args()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    rows = []
    for mib in [int(m) for m in a.mib.split(",")]:
        runs = [once(libc, mib) for _ in range(a.repeat)]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append({"mib": mib, "runs_ms": runs, "median_ms": median})
        print(f"{mib} MiB: socket EOF {median['eof']:.2f} ms, pidfd {median['pidfd']:.2f} ms, "
              f"robust mutex {median['mutex']:.2f} ms (medians of {a.repeat})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
