"""Hostile clients against a `hearth store` (bench/results/2026-12-01-hostile-clients.md):
a flood of connections past its descriptor limit, 200 connections each holding an unfinished
16 MiB message, and 20 connections sending attach requests without reading the answers.

    /usr/bin/python3 bench/hostile/store_flood.py CLI LABEL [--new]

CLI is the `hearth` binary; LABEL names the rows printed; --new for a store with the limits
(it then also waits for the partial-message peers to be dropped).
"""
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time

CLI, LABEL = sys.argv[1], sys.argv[2]
NEW = "--new" in sys.argv
MAGIC = 0x48545248


def frame(type_, total, offset, payload):
    return struct.pack("<IHHII", MAGIC, 1, type_, total, offset) + payload


def attach_frame(model="m"):
    p = struct.pack("<I", len(model)) + model.encode() + struct.pack("<Q", 0)
    return frame(4, len(p), 0, p)


def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_kib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def nfds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def start(d, extra, prefix=()):
    model = os.path.join(d, "m.safetensors")
    if not os.path.exists(model):
        subprocess.run([CLI, "make-model", "scale", "--dims", "1000", "--out", model], check=True,
                       capture_output=True)
    sock = os.path.join(d, "run", "s.sock")
    log = open(os.path.join(d, "store.log"), "wb")
    p = subprocess.Popen([*prefix, CLI, "store", "--socket", sock, "--device", "cpu",
                          "--model", f"m={model}", *extra], stdout=log, stderr=log)
    deadline = time.time() + 30
    while b"hearth store ready" not in open(log.name, "rb").read():
        assert p.poll() is None and time.time() < deadline, open(log.name, "rb").read()
        time.sleep(0.02)
    return p, sock, log.name


def connect(sock, blocking=True):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setblocking(blocking)
    try:
        s.connect(sock)
    except (BlockingIOError, ConnectionRefusedError):
        pass
    return s


def served(sock):
    t0 = time.time()
    while time.time() - t0 < 30:
        r = subprocess.run([CLI, "list", "--socket", sock], capture_output=True)
        if r.returncode == 0:
            return time.time() - t0
        time.sleep(0.01)
    return None


def flood_emfile():
    with tempfile.TemporaryDirectory() as d:
        p, sock, log = start(d, ["--max-connections", "1000"] if NEW else [],
                             ["prlimit", "--nofile=64", "--"])
        conns = [connect(sock, False) for _ in range(300)]
        time.sleep(1)
        c0, t0, l0 = cpu(p.pid), time.time(), os.path.getsize(log)
        time.sleep(10)
        c1, t1, l1 = cpu(p.pid), time.time(), os.path.getsize(log)
        for c in conns:
            c.close()
        after = served(sock)
        p.terminate()
        p.wait()
        print(f"{LABEL} emfile flood (nofile 64, 300 connections held 10 s): "
              f"store CPU {c1 - c0:.2f} s in {t1 - t0:.1f} s, log {(l1 - l0) / 1e6:.2f} MB, "
              f"a client served {after if after is None else round(after, 2)} s after the flood closed")


def partial(count=200, each=16 << 20):
    with tempfile.TemporaryDirectory() as d:
        p, sock, log = start(d, [])
        rss0 = status_kib(p.pid, "VmRSS")
        conns, dropped = [], 0
        payload = b"\0" * 32768
        for _ in range(count):
            s = connect(sock)
            conns.append(s)
            try:
                for off in range(0, each - 32768, 32768):
                    s.send(frame(4, 16 << 20, off, payload))
            except OSError:
                dropped += 1
        time.sleep(1)
        hwm, rss = status_kib(p.pid, "VmHWM"), status_kib(p.pid, "VmRSS")
        t = served(sock)
        for s in conns:
            s.close()
        p.terminate()
        p.wait()
        print(f"{LABEL} {count} connections x unfinished {each >> 20} MiB messages: store RSS "
              f"{rss0 / 1024:.0f} -> {rss / 1024:.0f} MiB (peak {hwm / 1024:.0f} MiB), "
              f"{dropped} connections dropped, list answered in {t if t is None else round(t, 3)} s")


def non_readers(count=20):
    with tempfile.TemporaryDirectory() as d:
        p, sock, log = start(d, [])
        fds0 = nfds(p.pid)
        with open("/proc/sys/fs/file-nr") as fn:
            files0 = int(fn.read().split()[0])
        conns, sent = [], 0
        f = attach_frame()
        for _ in range(count):
            s = connect(sock)
            s.setblocking(False)
            conns.append(s)
            try:
                for _ in range(5000):
                    s.send(f)
                    sent += 1
            except BlockingIOError:
                pass
        time.sleep(2)
        fds1 = nfds(p.pid)
        import fcntl, termios, array
        unread = 0
        for s in conns:
            buf = array.array("i", [0])
            fcntl.ioctl(s, termios.FIONREAD, buf)
            unread += buf[0]
        one = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        one.connect(sock)
        one.send(f)
        msg, anc, _, _ = one.recvmsg(65536, socket.CMSG_SPACE(4))
        for level, kind, data in anc:
            os.close(struct.unpack("i", data[:4])[0])
        one.close()
        with open("/proc/sys/fs/file-nr") as fn:
            files_now = int(fn.read().split()[0])
        t = served(sock)
        for s in conns:
            s.close()
        p.terminate()
        p.wait()
        print(f"{LABEL} {count} connections sending {sent} attach requests, never reading: store "
              f"descriptors {fds0} -> {fds1}, answers waiting unread {unread // len(msg)} "
              f"(each with a descriptor), system file handles +{files_now - files0}, "
              f"list answered in {t if t is None else round(t, 3)} s")


flood_emfile()
partial()
non_readers()
