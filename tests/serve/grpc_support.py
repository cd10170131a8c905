"""What the gRPC tests of `hearth serve` share: grpcio, and stubs generated
from this repository's proto/ when first imported; a server's gRPC port and
a channel to it; their repository; requests and their answers as arrays;
HTTP/2 frames written by hand.

Importing it skips the importing test module (or the fixture that imports
it), saying why, when this hearth was built without gRPC or
/usr/bin/python3 lacks grpcio/grpc_tools.
"""

import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

try:
    import grpc
    from grpc_tools import protoc
except ImportError as e:  # pragma: no cover: CMake registers a skip instead
    pytest.skip(f"needs grpcio and grpc_tools (Debian: python3-grpcio python3-grpc-tools): {e}",
                allow_module_level=True)

if os.environ.get("HEARTH_GRPC_BUILT", "ON").upper() in ("OFF", "0", "FALSE"):
    pytest.skip("this hearth was built without gRPC (HEARTH_GRPC=OFF, or grpc++ was not found)",
                allow_module_level=True)

from serve_support import CLI, MLP, ROOT, SCALE_N, mlp_config, scale_config  # noqa: E402

PROTO = ROOT / "proto"
MAX_MESSAGE = 1 << 20  # the servers' --grpc-max-message-bytes here


def generate_stubs():
    """grpc_service_pb2 and grpc_service_pb2_grpc, generated from proto/ into a
    temporary directory."""
    out = tempfile.mkdtemp(prefix="hearth-grpc-stubs-")
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO}", f"--python_out={out}", f"--grpc_python_out={out}",
                      str(PROTO / "grpc_service.proto"), str(PROTO / "model_config.proto")])
    assert rc == 0, "grpc_tools.protoc could not compile proto/"
    sys.path.insert(0, out)
    return (importlib.import_module("grpc_service_pb2"), importlib.import_module("grpc_service_pb2_grpc"),
            importlib.import_module("model_config_pb2"), out)


pb, pb_grpc, mc, STUBS = generate_stubs()


def grpc_port(log_text):
    m = re.search(r"KServe v2 gRPC on 127\.0\.0\.1:(\d+)", log_text)
    if m is None and "built without gRPC" in log_text:
        pytest.skip("this hearth was built without gRPC")
    assert m, "the server did not log its gRPC port:\n" + log_text[-2000:]
    return int(m.group(1))


def connect(port):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", -1),
                                                                  ("grpc.max_send_message_length", -1)])
    return channel, pb_grpc.GRPCInferenceServiceStub(channel)


def write_repository(root):
    for name in ("mlp", "scale", "batched", "broken", "prio", "swap"):
        (root / name / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "mlp", "--dims", ",".join(map(str, MLP)), "--seed", "5",
                    "--out", str(root / "mlp" / "1" / "model.safetensors")], check=True, capture_output=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "6",
                    "--out", str(root / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    shutil.copy(root / "mlp" / "1" / "model.safetensors", root / "batched" / "1" / "model.safetensors")
    for name in ("broken", "prio", "swap"):
        shutil.copy(root / "scale" / "1" / "model.safetensors", root / name / "1" / "model.safetensors")
    (root / "mlp" / "config.yaml").write_text(mlp_config(count=2))
    (root / "scale" / "config.yaml").write_text(scale_config(count=2, extra="""dynamic_batching:
  max_queue_delay_microseconds: 100
  preferred_batch_size: [2, 4]
parameters:
  note: "seen by gRPC"
"""))
    # One worker that waits up to 300 ms to fill batches of 8: a short
    # timeout expires while a lone request waits.
    (root / "batched" / "config.yaml").write_text(mlp_config(count=1, extra="""dynamic_batching:
  max_queue_delay_microseconds: 300000
  preferred_batch_size: [8]
"""))
    (root / "prio" / "config.yaml").write_text(scale_config(count=1, extra="""dynamic_batching:
  priority_levels: 2
  default_priority_level: 2
"""))
    # Unloaded, loaded and given a new version by test_repository_control.
    (root / "swap" / "config.yaml").write_text(scale_config(count=1))
    # dims disagree with the checkpoint: not served, the rest is.
    (root / "broken" / "config.yaml").write_text(scale_config(count=1).replace(f"dims: [{SCALE_N}]", "dims: [9]"))


def infer_request(model, name, x, id="", outputs=(), parameters=None, typed=False):
    inputs = [pb.ModelInferRequest.InferInputTensor(name=name, datatype="FP32", shape=list(x.shape))]
    request = pb.ModelInferRequest(model_name=model, id=id, inputs=inputs,
                                   outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name=o) for o in outputs])
    if typed:
        request.inputs[0].contents.fp32_contents.extend(x.ravel().tolist())
    else:
        request.raw_input_contents.append(x.astype("<f4").tobytes())
    for key, value in (parameters or {}).items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        elif isinstance(value, float):
            request.parameters[key].double_param = value
        else:
            request.parameters[key].string_param = value
    return request


def outputs_of(response):
    """{name: array} from raw_output_contents, as tritonclient reads them."""
    dtypes = {"FP32": "<f4", "INT64": "<i8", "INT32": "<i4", "UINT64": "<u8"}
    return {o.name: np.frombuffer(raw, dtype=dtypes[o.datatype]).reshape(list(o.shape))
            for o, raw in zip(response.outputs, response.raw_output_contents)}


def rpc_error(call, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kwargs)
    return e.value


def h2_frame(kind, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def hpack_literal(name, value):
    """A header field as an HPACK literal without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    def string(text):
        b = text.encode()
        assert len(b) < 127
        return bytes([len(b)]) + b
    return b"\x00" + string(name) + string(value)
