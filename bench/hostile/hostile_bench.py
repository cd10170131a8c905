#!/usr/bin/python3
"""Hostile clients against a real `hearth serve`; prints a table per scenario.

  stall  The server's peak RSS (VmHWM) while --stalled connections (200) send
         a head declaring a --body-bytes body (64 MiB) and then nothing,
         with and without `Expect: 100-continue` (and, to load the budget,
         the whole body but its last byte), and a normal client sends
         requests meanwhile: the peak against the goal
         1.2 x --max-inflight-bytes + 100 MiB, and the normal client's worst
         latency against 1 s. Once per --budgets value.
  fds    --attempts (20,000) connection attempts (from --flood-procs
         processes), held open, against a server
         whose descriptor limit is --nofile (4,096): the latency of normal
         clients (on a connection opened before, and on new connections), and
         the time from SIGKILLing the (only) worker until a request is
         answered again.

--old runs a server that lacks this change's flags (the baseline at
959bbb4): only flags it knows are passed, and the stall scenario stops
opening connections once the server's RSS passes --rss-cap-gib (that server
allocates each declared body up front).

Only the standard library. Run as root for the fds scenario (it raises its
own descriptor limit past 20,000).
"""

import argparse
import json
import multiprocessing
import os
import pathlib
import re
import resource
import selectors
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import tempfile
import time

MIB = 1 << 20
GIB = 1 << 30
SCALE_N = 500


# ---- the server ---------------------------------------------------------------

def write_repository(hearth, root, workers):
    (root / "scale" / "1").mkdir(parents=True)
    subprocess.run([hearth, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "6",
                    "--out", str(root / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    (root / "scale" / "config.yaml").write_text(f"""backend: scale
max_batch_size: 4
input:
  - {{name: x, data_type: TYPE_FP32, dims: [{SCALE_N}]}}
output:
  - {{name: y, data_type: TYPE_FP32, dims: [1]}}
instance_group:
  - {{count: {workers}, kind: KIND_CPU}}
""")


class Server:
    def __init__(self, hearth, args, workers=2, nofile=None):
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="hostile-bench-"))
        write_repository(hearth, self.tmp / "repo", workers)
        self.log_path = self.tmp / "serve.log"
        log = open(self.log_path, "w")

        def limits():
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen([hearth, "serve", "--model-repository", str(self.tmp / "repo"),
                                      "--http-port", "0", "--device", "cpu", *args],
                                     stdout=log, stderr=subprocess.STDOUT, preexec_fn=limits,
                                     start_new_session=True)
        deadline = time.time() + 120
        self.port = None
        while time.time() < deadline and self.port is None:
            m = re.search(r"ready on http://127\.0\.0\.1:(\d+)", self.log_path.read_text())
            if m:
                self.port = int(m.group(1))
            elif self.proc.poll() is not None:
                break
            else:
                time.sleep(0.05)
        if self.port is None:
            self.close()
            raise SystemExit("server did not start:\n" + self.log_path.read_text()[-2000:])

    def status(self, field):
        for line in pathlib.Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self):
        fields = pathlib.Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def workers(self):
        pids = []
        for task in pathlib.Path(f"/proc/{self.proc.pid}/task").iterdir():
            for c in (task / "children").read_text().split():
                try:
                    if b"hearth-worker" in pathlib.Path(f"/proc/{c}/cmdline").read_bytes():
                        pids.append(int(c))
                except FileNotFoundError:
                    pass
        return pids

    def log(self):
        return self.log_path.read_text(errors="replace")

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---- a normal client ------------------------------------------------------------

def infer_request(connection_close=False):
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, SCALE_N],
                                     "parameters": {"binary_data_size": SCALE_N * 4}}]}).encode()
    body = header + struct.pack(f"<{SCALE_N}f", *([1.0] * SCALE_N))
    head = (f"POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n")
    if connection_close:
        head += "Connection: close\r\n"
    return head.encode() + b"\r\n" + body


def read_response(s):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed before a response")
        data += chunk
    head, data = data.split(b"\r\n\r\n", 1)
    status = int(head.split(b" ", 2)[1])
    m = re.search(rb"(?i)content-length:\s*(\d+)", head)
    length = int(m.group(1)) if m else 0
    while len(data) < length:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside a response")
        data += chunk
    return status


def _normal_client(conn, port, keep_alive, pause):
    """A child process: one request after another until told to stop, then
    sends back [(start, latency)] and [(start, failure)]."""
    def connect():
        s = socket.create_connection(("127.0.0.1", port), timeout=120)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    latencies, failures = [], []
    request = infer_request(connection_close=not keep_alive)
    sock = connect() if keep_alive else None
    conn.send("ready")
    while not conn.poll(pause):
        start = time.monotonic()
        try:
            s = sock if keep_alive else connect()
            s.sendall(request)
            status = read_response(s)
            if not keep_alive:
                s.close()
            if status == 200:
                latencies.append((start, time.monotonic() - start))
            else:
                failures.append((start, f"status {status}"))
        except OSError as e:
            failures.append((start, repr(e)))
            if keep_alive:
                try:
                    sock = connect()
                except OSError:
                    pass
    conn.send((latencies, failures))


class NormalClient:
    """A normal client in a process of its own (so that the attack's Python
    does not delay it): one request after another; keep_alive: on one
    connection made at start, else on a new connection each (its connect
    counts in the latency)."""

    def __init__(self, port, keep_alive, pause=0.02):
        self.conn, child = multiprocessing.Pipe()
        self.proc = multiprocessing.Process(target=_normal_client, args=(child, port, keep_alive, pause),
                                            daemon=True)
        self.latencies, self.failures = [], []

    def start(self):
        self.proc.start()
        assert self.conn.recv() == "ready"

    def stop(self):
        self.conn.send("stop")
        if self.conn.poll(180):
            self.latencies, self.failures = self.conn.recv()
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()

    def first_answer_after(self, t):
        """When the first request sent after `t` was answered."""
        after = [s + l for s, l in self.latencies if s > t]
        return min(after) if after else None

    def summary(self, since=0.0, until=float("inf")):
        """Requests sent in [since, until), however long they took."""
        lat = [l for t, l in self.latencies if since <= t < until]
        fails = [f for t, f in self.failures if since <= t < until]
        if not lat:
            return {"n": 0, "p50_ms": None, "max_ms": None, "failures": len(fails), "fail_kinds": sorted(set(fails))[:3]}
        return {"n": len(lat), "p50_ms": statistics.median(lat) * 1e3, "max_ms": max(lat) * 1e3,
                "failures": len(fails), "fail_kinds": sorted(set(fails))[:3]}


# ---- scenario: stalled bodies -------------------------------------------------

def stall(args, budget, variant):
    """variant: "head" (a head, then nothing), "continue" (the same with
    Expect: 100-continue), "body" (the whole body but its last byte, as fast
    as the server takes it)."""
    expect_continue = variant == "continue"
    flags = ["--max-body-bytes", str(args.body_bytes)]
    if not args.old:
        flags += ["--max-inflight-bytes", str(budget), "--head-timeout-ms", "600000",
                  "--body-timeout-ms", "600000"]
    server = Server(args.hearth, flags)
    try:
        clients = [NormalClient(server.port, True), NormalClient(server.port, False)]
        for c in clients:
            c.start()
        time.sleep(1.0)  # warm: the server's own footprint before the attack
        base_rss = server.status("VmRSS")
        start = time.monotonic()
        stalled, capped = [], False
        head = (f"POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {args.body_bytes}\r\n"
                + ("Expect: 100-continue\r\n" if expect_continue else "") + "\r\n").encode()
        peak_seen = 0
        for _ in range(args.stalled):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
            s.sendall(head)
            stalled.append(s)
            rss = server.status("VmRSS")
            peak_seen = max(peak_seen, rss)
            if args.old and rss > args.rss_cap_gib * GIB:
                capped = True
                break
        unsent = {}
        if variant == "body":
            for s in stalled:
                s.setblocking(False)
                unsent[s] = args.body_bytes - 1
        chunk = bytes(MIB)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            for s, left in list(unsent.items()):
                try:
                    sent = s.send(memoryview(chunk)[:min(left, MIB)])
                except BlockingIOError:
                    continue
                except OSError:
                    del unsent[s]
                    continue
                unsent[s] = left - sent
                if unsent[s] == 0:
                    del unsent[s]
            peak_seen = max(peak_seen, server.status("VmRSS"))
            if args.old and peak_seen > args.rss_cap_gib * GIB:
                capped = True
                break
            time.sleep(0.05 if not unsent else 0.001)
        hwm = server.status("VmHWM")
        window_end = time.monotonic()
        for c in clients:
            c.stop()
        for s in stalled:
            s.close()
        return {"budget": None if args.old else budget, "variant": variant,
                "stalled": len(stalled), "capped": capped, "base_rss": base_rss, "peak_rss": hwm,
                "goal": None if args.old else 1.2 * budget + 100 * MIB,
                "keep_alive": clients[0].summary(start, window_end),
                "new_connections": clients[1].summary(start, window_end)}
    finally:
        server.close()


# ---- scenario: descriptor exhaustion ------------------------------------------

def _flood(conn, port, attempts, first, hold):
    """A child process: `attempts` non-blocking connects (from 127.0.0.2-5,
    for source ports), held open `hold` seconds; reports how they went."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < min(hard, attempts + 64):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, attempts + 64), hard))
    sel = selectors.DefaultSelector()
    socks = []
    failed = 0
    start = time.monotonic()
    for i in range(attempts):
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            failed += 1
            continue
        s.setblocking(False)
        s.bind((f"127.0.0.{2 + (first + i) % 4}", 0))
        err = s.connect_ex(("127.0.0.1", port))
        socks.append(s)
        if err not in (0, 115):  # EINPROGRESS
            failed += 1
            continue
        sel.register(s, selectors.EVENT_WRITE)
    conn.send(("flooded", time.monotonic() - start))
    established = refused = 0
    while time.monotonic() - start < hold:
        for key, _ in sel.select(timeout=0.1):
            sel.unregister(key.fileobj)
            if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                established += 1
            else:
                refused += 1
    conn.send({"established": established, "refused": refused + failed, "pending": len(sel.get_map())})
    for s in socks:
        s.close()


def fds(args):
    server = Server(args.hearth, args.serve_args.split(), workers=1, nofile=args.nofile)
    try:
        keep_alive = NormalClient(server.port, True, pause=0.05)
        fresh = NormalClient(server.port, False, pause=0.05)
        keep_alive.start()
        fresh.start()
        time.sleep(1.0)
        cpu_before = server.cpu_seconds()
        log_before = len(server.log())
        start = time.monotonic()
        # The flood, from processes of their own (descriptors per process).
        per = -(-args.attempts // args.flood_procs)
        floods = []
        for i in range(args.flood_procs):
            parent, child = multiprocessing.Pipe()
            proc = multiprocessing.Process(target=_flood, args=(child, server.port, min(per, args.attempts - i * per),
                                                                i * per, args.seconds), daemon=True)
            proc.start()
            floods.append((proc, parent))
        flood_done = max(conn.recv()[1] for _, conn in floods)
        # Kill the worker a few seconds in, with the flood held.
        killed_at = replaced_at = None
        victim = None
        while time.monotonic() - start < args.seconds:
            now = time.monotonic() - start
            if victim is None and now >= args.kill_after:
                workers = server.workers()
                if workers:
                    victim = workers[0]
                    os.kill(victim, signal.SIGKILL)
                    killed_at = time.monotonic()
            if victim is not None and replaced_at is None:
                workers = server.workers()
                if workers and victim not in workers:
                    replaced_at = time.monotonic()
            time.sleep(0.002 if victim is not None and replaced_at is None else 0.05)
        cpu = server.cpu_seconds() - cpu_before
        window_end = time.monotonic()
        counts = {"established": 0, "refused": 0, "pending": 0}
        for proc, conn in floods:
            if conn.poll(60):
                for k, v in conn.recv().items():
                    counts[k] += v
            proc.join(timeout=60)
        # Not replaced under the flood: is it once the flood is gone?
        flood_ended = time.monotonic()
        replaced_later = None
        while victim is not None and replaced_at is None and time.monotonic() - flood_ended < 30:
            workers = server.workers()
            if workers and victim not in workers:
                replaced_later = time.monotonic() - flood_ended
                break
            time.sleep(0.01)
        log = server.log()[log_before:]
        keep_alive.stop()
        fresh.stop()
        answered_at = keep_alive.first_answer_after(killed_at) if killed_at is not None else None
        limit = re.search(r"serving at most (\d+) connections", server.log())
        return {"attempts": args.attempts, "nofile": args.nofile, "flood_seconds": flood_done,
                "connection_limit_logged": int(limit.group(1)) if limit else None,
                "established": counts["established"], "refused": counts["refused"],
                "pending_at_end": counts["pending"],
                "server_cpu_seconds": cpu, "window_seconds": args.seconds,
                "accept_error_log_lines": len(re.findall(r"accept", log)),
                "emfile_log_lines": len(re.findall(r"Too many open files", log)),
                "killed": victim is not None,
                "worker_replaced_s": None if replaced_at is None else replaced_at - killed_at,
                "replaced_after_the_flood_ended_s": replaced_later,
                "answered_after_kill_s": None if answered_at is None else answered_at - killed_at,
                "keep_alive": keep_alive.summary(start, window_end),
                "new_connections": fresh.summary(start, window_end),
                "log_tail": log[-600:]}
    finally:
        server.close()


# ---- output -------------------------------------------------------------------

def fmt_bytes(n):
    return "-" if n is None else f"{n / MIB:,.0f} MiB"


def fmt_ms(v):
    return "-" if v is None else f"{v:,.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hearth", default=str(pathlib.Path(__file__).resolve().parents[2] / "build" / "bin" / "hearth"))
    p.add_argument("--scenario", choices=["stall", "fds", "all"], default="all")
    p.add_argument("--old", action="store_true", help="the server lacks this change's flags (baseline)")
    p.add_argument("--budgets", default=f"{GIB},{256 * MIB}", help="--max-inflight-bytes values")
    p.add_argument("--stalled", type=int, default=200)
    p.add_argument("--variants", default="head,continue,body",
                   help="stall: head (then nothing), continue (Expect: 100-continue), body (all but its last byte)")
    p.add_argument("--body-bytes", type=int, default=64 * MIB)
    p.add_argument("--seconds", type=float, default=15, help="how long each attack is held")
    p.add_argument("--rss-cap-gib", type=float, default=6, help="--old: stop the stall past this RSS")
    p.add_argument("--attempts", type=int, default=20000)
    p.add_argument("--nofile", type=int, default=4096)
    p.add_argument("--flood-procs", type=int, default=4, help="fds: processes making the attempts")
    p.add_argument("--serve-args", default="", help="fds: more `hearth serve` flags, e.g. "
                   "'--max-connections 100000' (lowered to what the descriptor limit allows)")
    p.add_argument("--kill-after", type=float, default=5, help="fds: SIGKILL the worker this far in")
    p.add_argument("--json", action="store_true", help="print the raw results as JSON too")
    args = p.parse_args()
    results = {}
    if args.scenario in ("stall", "all"):
        budgets = [None] if args.old else [int(b) for b in args.budgets.split(",")]
        rows = []
        for budget in budgets:
            for variant in args.variants.split(","):
                rows.append(stall(args, budget, variant))
        results["stall"] = rows
        print(f"\nstall: {args.stalled} connections send a head declaring {args.body_bytes:,} bytes, then "
              f"nothing (head), the same with Expect: 100-continue (continue), or the body but its last byte "
              f"(body), held {args.seconds:g} s; normal clients send one request at a time meanwhile\n")
        print("| --max-inflight-bytes | variant | stalled | server RSS before | peak RSS (VmHWM) "
              "| goal | normal: keep-alive p50 / max (ms) | new connection p50 / max (ms) | failures |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            stalled = f"{r['stalled']}" + (" (stopped: RSS cap)" if r["capped"] else "")
            ka, nc = r["keep_alive"], r["new_connections"]
            print(f"| {fmt_bytes(r['budget'])} | {r['variant']} | {stalled} "
                  f"| {fmt_bytes(r['base_rss'])} | {fmt_bytes(r['peak_rss'])} | {fmt_bytes(r['goal'])} "
                  f"| {fmt_ms(ka['p50_ms'])} / {fmt_ms(ka['max_ms'])} ({ka['n']}) "
                  f"| {fmt_ms(nc['p50_ms'])} / {fmt_ms(nc['max_ms'])} ({nc['n']}) "
                  f"| {ka['failures'] + nc['failures']} |")
    if args.scenario in ("fds", "all"):
        r = fds(args)
        results["fds"] = r
        ka, nc = r["keep_alive"], r["new_connections"]
        if r["connection_limit_logged"] is not None:
            print(f"\n(the server logged: serving at most {r['connection_limit_logged']:,} connections)")
        print(f"\nfds: {r['attempts']:,} connection attempts in {r['flood_seconds']:.1f} s, held for "
              f"{r['window_seconds']:g} s, against a server limited to {r['nofile']:,} descriptors; the "
              f"worker SIGKILLed {args.kill_after:g} s in; normal clients: requests sent while the flood "
              f"was held\n")
        print("| connects completed | refused | still pending | server CPU in the window | accept log lines "
              "| 'Too many open files' lines | worker SIGKILLed: replaced after | a request sent after the kill answered after "
              "| keep-alive p50 / max (ms), failures | new connection p50 / max (ms), failures |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        replaced = f"{r['worker_replaced_s']:.2f} s" if r["worker_replaced_s"] is not None else (
            "not while the flood lasted" + ("" if r["replaced_after_the_flood_ended_s"] is None else
                                            f"; {r['replaced_after_the_flood_ended_s']:.2f} s after it ended"))
        answered = "not within the window" if r["answered_after_kill_s"] is None else f"{r['answered_after_kill_s']:.2f} s"
        print(f"| {r['established']:,} | {r['refused']:,} | {r['pending_at_end']:,} "
              f"| {r['server_cpu_seconds']:.1f} s | {r['accept_error_log_lines']} | {r['emfile_log_lines']} "
              f"| {replaced} | {answered} "
              f"| {fmt_ms(ka['p50_ms'])} / {fmt_ms(ka['max_ms'])} ({ka['n']}), {ka['failures']} "
              f"| {fmt_ms(nc['p50_ms'])} / {fmt_ms(nc['max_ms'])} ({nc['n']}), {nc['failures']} |")
        if ka["fail_kinds"] or nc["fail_kinds"]:
            print("\nfailures:", ka["fail_kinds"], nc["fail_kinds"])
    if args.json:
        print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
