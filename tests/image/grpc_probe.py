"""Run inside the image test's network namespace (nsenter): asks the server
on 127.0.0.1:PORT over KServe v2 gRPC whether it is ready and infers MODEL
(an FP32 input named INPUT) on the rows of a .npy file; prints
{"ready": bool, "outputs": {name: nested list}} as JSON."""

import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "serve"))
from grpc_support import connect, infer_request, outputs_of, pb  # noqa: E402

port, model, name, rows = int(sys.argv[1]), sys.argv[2], sys.argv[3], np.load(sys.argv[4])
channel, stub = connect(port)
ready = stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready
outputs = outputs_of(stub.ModelInfer(infer_request(model, name, rows), timeout=60))
print(json.dumps({"ready": ready, "outputs": {k: v.tolist() for k, v in outputs.items()}}))
