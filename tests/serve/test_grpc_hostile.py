"""`hearth serve`'s gRPC endpoint against hostile clients, over real sockets:
a gzip bomb (a message of zeros that inflates a thousandfold). The tests
share a server and read what the server process holds from /proc (VmRSS, and
VmHWM after resetting it through /proc/PID/clear_refs), never how long
something takes.

Paths: $HEARTH_CLI (default build/bin/hearth). Skips, saying why, when this
hearth was built without gRPC or /usr/bin/python3 lacks grpcio/grpc_tools.
"""

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_grpc import (MAX_MESSAGE, connect, grpc, grpc_port, infer_request,  # noqa: E402
                       outputs_of, rpc_error, write_repository)
from test_serve import SCALE_N, start_serve, stop_serve  # noqa: E402

MIB = 1 << 20


def memory(pid):
    """(VmRSS, VmHWM) of process `pid`, in bytes."""
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


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
    e = rpc_error(stub.ModelInfer, bomb, timeout=120, compression=grpc.Compression.Gzip)
    _, peak = memory(pid)
    del bomb
    # Never inflated: the peak stays far below the 256 MiB it would take.
    assert peak - rss_before < 2 * MAX_MESSAGE + 100 * MIB, f"peak RSS grew by {(peak - rss_before) / MIB:.0f} MiB"
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED and "'gzip' is disabled" in e.details(), e.details()
    # Uncompressed calls go on being served.
    assert_served(stub)
