"""`hearth serve`'s gRPC endpoint against hostile clients, over real sockets:
gzip bombs (messages of zeros that inflate a thousandfold) and a flood of
HTTP/2 streams written frame by frame on one connection. The tests share a
server and read what the server process holds from /proc (VmRSS, and
VmHWM after resetting it through /proc/PID/clear_refs), never how long
something takes.

Paths: $HEARTH_CLI (default build/bin/hearth). Skips, saying why, when this
hearth was built without gRPC or /usr/bin/python3 lacks grpcio/grpc_tools.
"""

import pathlib
import socket
import threading

import numpy as np
import pytest

from grpc_support import (MAX_MESSAGE, connect, grpc, grpc_port, h2_frame, hpack_literal, infer_request,
                          outputs_of, pb, rpc_error, write_repository)
from serve_support import SCALE_N, memory_fields, start_serve, stop_serve, wait_for


MIB = 1 << 20


def memory(pid):
    """(VmRSS, VmHWM) of process `pid`, in bytes."""
    return tuple(memory_fields(pid, "VmRSS", "VmHWM"))


def reset_peak(pid):
    pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpc-hostile")
    write_repository(tmp / "repo")
    state = start_serve(tmp, tmp / "repo", ["--grpc-max-message-bytes", str(MAX_MESSAGE)])
    state["grpc_port"] = grpc_port(state["log"].read_text())
    state["channel"], state["stub"] = connect(state["grpc_port"])
    yield state
    state["channel"].close()
    code, text = stop_serve(state)
    assert code == 0, text[-2000:]


def assert_served(stub):
    x = np.ones((1, SCALE_N), np.float32)
    y = outputs_of(stub.ModelInfer(infer_request("scale", "x", x), timeout=60))["y"]
    assert y.shape == (1, 1) and np.isfinite(y).all()


def test_a_gzip_bomb_is_refused_before_it_is_inflated(served):
    pid, stub = served["proc"].pid, served["stub"]
    assert_served(stub)
    # 256 MiB of zeros: a few hundred KiB gzipped, 256 times the message limit inflated.
    bomb = infer_request("scale", "x", np.zeros((256 * MIB // (4 * SCALE_N), SCALE_N), np.float32))
    reset_peak(pid)
    rss_before, _ = memory(pid)
    errors = [None] * 8
    # Eight at once, each on its own connection.
    def send(i):
        channel, own = connect(served["grpc_port"])
        try:
            errors[i] = rpc_error(own.ModelInfer, bomb, timeout=120, compression=grpc.Compression.Gzip)
        finally:
            channel.close()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, peak = memory(pid)
    # Measured while inflating, never held: the peak stays far below the 2 GiB they would take.
    assert peak - rss_before < 2 * MAX_MESSAGE + 100 * MIB, f"peak RSS grew by {(peak - rss_before) / MIB:.0f} MiB"
    for e in errors:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
        assert f"(gzip) inflates past the limit of {MAX_MESSAGE} bytes" in e.details(), e.details()
    # Uncompressed calls go on being served.
    assert_served(stub)


def test_compressed_requests_within_the_limit_are_served(served):
    stub = served["stub"]
    x = np.zeros((4, SCALE_N), np.float32)
    x[:, 0] = [1, 2, 3, 4]
    for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):
        y = outputs_of(stub.ModelInfer(infer_request("scale", "x", x), timeout=60, compression=compression))["y"]
        plain = outputs_of(stub.ModelInfer(infer_request("scale", "x", x), timeout=60))["y"]
        assert y.shape == (4, 1) and np.array_equal(y, plain)


class Flood:
    """One raw HTTP/2 connection that opens ModelInfer streams without a
    message (HEADERS with END_STREAM), or opens and at once resets them
    (HEADERS, then RST_STREAM CANCEL: CVE-2023-44487's rapid reset). It never
    acknowledges the server's SETTINGS, as an attacker need not, and a thread
    reads and discards what the server sends."""

    def __init__(self, port, reset):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(4, 0, 0))
        self.headers = b"".join(hpack_literal(n, v) for n, v in (
            (":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
            (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"), ("te", "trailers")))
        self.reset = reset
        self.next_stream = 1
        self.reader = threading.Thread(target=self._discard, daemon=True)
        self.reader.start()

    def _discard(self):
        self.closed_by_server = False
        try:
            while self.sock.recv(1 << 20):
                pass
            self.closed_by_server = True  # end of file
        except ConnectionResetError:
            self.closed_by_server = True
        except OSError:
            pass

    def send(self, streams):
        """Opens `streams` streams; returns how many were written before the server closed the connection."""
        sent = 0
        try:
            while sent < streams:
                batch = []
                for _ in range(min(500, streams - sent)):
                    sid = self.next_stream
                    self.next_stream += 2
                    if self.reset:
                        batch.append(h2_frame(1, 0x4, sid, self.headers) + h2_frame(3, 0, sid, (8).to_bytes(4, "big")))
                    else:
                        batch.append(h2_frame(1, 0x5, sid, self.headers))
                self.sock.sendall(b"".join(batch))
                sent += len(batch)
        except OSError:
            pass
        return sent

    def close(self):
        self.sock.close()
        self.reader.join()


@pytest.mark.parametrize("reset", [False, True], ids=["end-stream", "rapid-reset"])
def test_memory_a_stream_flood_took_is_given_back_after_the_connection_closes(served, reset):
    pid, stub = served["proc"].pid, served["stub"]
    assert_served(stub)
    rss_before, _ = memory(pid)
    flood = Flood(served["grpc_port"], reset)
    # Enough streams that what gRPC held for them (about 17 KiB each) is far past the margin below.
    flood.send(40_000)
    flood.close()
    _, peak = memory(pid)
    limit = rss_before + 100 * MIB
    wait_for(lambda: memory(pid)[0] < limit,
             lambda: (f"the RSS to fall below {limit / MIB:.0f} MiB after the flood's connection closed: "
                      f"{memory(pid)[0] / MIB:.0f} MiB (peak {peak / MIB:.0f} MiB, {rss_before / MIB:.0f} MiB before)"),
             timeout=120)
    assert_served(stub)
    e = rpc_error(stub.ModelInfer, pb.ModelInferRequest(model_name="nope"), timeout=60)
    assert e.code() == grpc.StatusCode.NOT_FOUND


def test_a_rapid_reset_flood_is_closed_by_the_server(served):
    """HEADERS+RST_STREAM pairs past the reset rate: the server closes that connection (and
    says why in its log), its memory stays bounded meanwhile, other clients are served."""
    pid, stub = served["proc"].pid, served["stub"]
    assert_served(stub)
    rss_before, _ = memory(pid)
    reset_peak(pid)
    flood = Flood(served["grpc_port"], reset=True)
    flood.send(40_000)
    # The reader ends when the server closes the connection; the test never closed it.
    flood.reader.join(timeout=120)
    closed_by_server = not flood.reader.is_alive() and flood.closed_by_server
    _, peak = memory(pid)
    flood.close()
    assert closed_by_server, "the server kept the flooding connection open"
    assert "resets streams faster than" in served["log"].read_text()
    assert peak < rss_before + 100 * MIB, f"peak {peak / MIB:.0f} MiB, {rss_before / MIB:.0f} MiB before"
    assert_served(stub)
