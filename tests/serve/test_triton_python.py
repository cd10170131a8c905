"""Triton Python-backend models (`TritonPythonModel`, `import
triton_python_backend_utils as pb_utils`) under `hearth serve`, unchanged:
models written here from the behaviour Triton's python_backend examples
document (add_sub, the decoupled repeat and square), an error response
failing only its request, a model without weights, auto_complete_config,
and what hearth lacks (BLS) failing with its name. Workers run
/usr/bin/python3 on the CPU."""

import concurrent.futures
import json
import os
import sys

import pytest
import requests

from serve_support import KIND, events, write_model

ADD_SUB_PY = """
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        out0 = pb_utils.get_output_config_by_name(self.model_config, "OUTPUT0")
        out1 = pb_utils.get_output_config_by_name(self.model_config, "OUTPUT1")
        self.out0_dtype = pb_utils.triton_string_to_numpy(out0["data_type"])
        self.out1_dtype = pb_utils.triton_string_to_numpy(out1["data_type"])
        seen = {k: v for k, v in args.items() if isinstance(v, str)}
        seen["weights"] = sorted(args["weights"])
        with open(os.path.join(args["model_repository"], "args-" + str(os.getpid())), "w") as f:
            json.dump(seen, f)
        pb_utils.Logger.log_info("add_sub initialized")

    def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if (in0 < 0).any():
                error = pb_utils.TritonError("INPUT0 holds a negative number",
                                             pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            if (in0 == 99).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("99 broke it")))
                continue
            out0 = pb_utils.Tensor("OUTPUT0", (in0 + in1).astype(self.out0_dtype))
            out1 = pb_utils.Tensor("OUTPUT1", (in0 - in1).astype(self.out1_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out0, out1]))
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("add_sub finalized")
"""


def add_sub_config(max_batch, extra=""):
    return f"""backend: python
max_batch_size: {max_batch}
input:
  - {{name: INPUT0, data_type: TYPE_FP32, dims: [4]}}
  - {{name: INPUT1, data_type: TYPE_FP32, dims: [4]}}
output:
  - {{name: OUTPUT0, data_type: TYPE_FP32, dims: [4]}}
  - {{name: OUTPUT1, data_type: TYPE_FP32, dims: [4]}}
instance_group:
  - {{count: 1, kind: {KIND}}}
""" + extra


# Triton's repeat example: a response per element of IN (OUT = IN[i], IDX =
# i), each after DELAY[i] ms, sent from a thread of the model's after
# execute has returned; then the final flag alone.
REPEAT_PY = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().copy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy().copy()
            if values.shape != delays.shape:
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "IN and DELAY differ in shape", pb_utils.TritonError.INVALID_ARG)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            t = threading.Thread(target=self.respond, daemon=True,
                                 args=(request.get_response_sender(), values, delays))
            t.start()
            self.threads.append(t)
        return None

    def respond(self, sender, values, delays):
        for i, (v, d) in enumerate(zip(values, delays)):
            time.sleep(int(d) / 1000)
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", np.array([v], dtype=np.int32)),
                pb_utils.Tensor("IDX", np.array([i], dtype=np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for t in self.threads:
            t.join()
"""

REPEAT_CONFIG = """backend: python
max_batch_size: 0
model_transaction_policy: {decoupled: true}
input:
  - {name: IN, data_type: TYPE_INT32, dims: [-1]}
  - {name: DELAY, data_type: TYPE_UINT32, dims: [-1]}
output:
  - {name: OUT, data_type: TYPE_INT32, dims: [1]}
  - {name: IDX, data_type: TYPE_INT32, dims: [1]}
parameters:
  max_streams: "8"
"""

# Triton's square example: IN = n gets n responses, each OUT = n, then the
# final flag; sent here inside execute. n < 0 is an error response.
SQUARE_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            if n < 0:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"IN is {n}: a count is 0 or more", pb_utils.TritonError.INVALID_ARG)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            for _ in range(n):
                sender.send(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            try:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except pb_utils.TritonModelException as e:
                assert "closed" in str(e)
            else:
                raise AssertionError("a sender sent past its final flag")
"""

SQUARE_CONFIG = """backend: python
max_batch_size: 0
model_transaction_policy: {decoupled: true}
input:
  - {name: IN, data_type: TYPE_INT32, dims: [1]}
output:
  - {name: OUT, data_type: TYPE_INT32, dims: [1]}
"""

BLS_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "INPUT0")
        request = pb_utils.InferenceRequest(model_name="add_sub", inputs=[x],
                                            requested_output_names=["OUTPUT0"])
        return [request.exec()]
"""

AUTO_COMPLETE_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32",
                                              "dims": [4]})
        auto_complete_model_config.set_max_batch_size(MAX_BATCH)
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 2)]))
        return responses
"""


# hearth's own Model, in a version directory without a checkpoint.
PLAIN_PY = """
import numpy as np


class Model:
    def initialize(self, args):
        assert dict(args["weights"]) == {}, args["weights"]
        self.device = args["device"]

    def execute(self, inputs):
        return {"OUTPUT0": np.asarray(inputs["INPUT0"]) + 1}
"""


def one_input_config(max_batch):
    return f"""backend: python
max_batch_size: {max_batch}
input:
  - {{name: INPUT0, data_type: TYPE_FP32, dims: [4]}}
output:
  - {{name: OUTPUT0, data_type: TYPE_FP32, dims: [4]}}
"""


def infer(url, model, in0, in1, batched):
    shape = [1, 4] if batched else [4]
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": shape, "data": in0},
                       {"name": "INPUT1", "datatype": "FP32", "shape": shape, "data": in1}]}
    return requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)


def outputs(r):
    return {o["name"]: o["data"] for o in r.json()["outputs"]}


def stream(url, model, inputs):
    """A decoupled model's responses over generate_stream: (events, error)."""
    r = requests.post(f"{url}/v2/models/{model}/generate_stream", json=inputs, stream=True,
                      timeout=60)
    if r.status_code == 400:  # failed (INVALID_ARG) before any response: the whole answer
        return [], r.json()["error"]
    assert r.status_code == 200, r.text
    got, error = [], None
    for payload in events(r):
        event = json.loads(payload)
        if "error" in event:
            error = event["error"]
        else:
            got.append(event)
    return got, error


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from serve_support import start_serve, stop_serve
    tmp = tmp_path_factory.mktemp("triton")
    repo = tmp / "repo"
    write_model(repo, "add_sub", add_sub_config(0), ADD_SUB_PY)
    # Batched: four requests wait for each other (preferred batch 4) and run as one batch.
    write_model(repo, "add_sub_batched", add_sub_config(8, """dynamic_batching:
  preferred_batch_size: [4]
  max_queue_delay_microseconds: 5000000
"""), ADD_SUB_PY)
    write_model(repo, "repeat", REPEAT_CONFIG, REPEAT_PY, weights=False)
    write_model(repo, "square", SQUARE_CONFIG, SQUARE_PY, weights=False)
    write_model(repo, "bls", one_input_config(0), BLS_PY, weights=False)
    write_model(repo, "confirms", one_input_config(8), AUTO_COMPLETE_PY.replace("MAX_BATCH", "8"),
                weights=False)
    write_model(repo, "changes", one_input_config(8), AUTO_COMPLETE_PY.replace("MAX_BATCH", "4"),
                weights=False)
    write_model(repo, "plain_weightless", one_input_config(4), PLAIN_PY, weights=False)
    write_model(repo, "scale_weightless", """backend: scale
max_batch_size: 4
input:
  - {name: x, data_type: TYPE_FP32, dims: [4]}
output:
  - {name: y, data_type: TYPE_FP32, dims: [1]}
""", PLAIN_PY, weights=False)
    # The workers run this interpreter (numpy), whatever python3 PATH finds.
    state = start_serve(tmp, repo, env={**os.environ, "HEARTH_PYTHON": sys.executable})
    state["repo"] = repo
    yield state
    code, text = stop_serve(state)
    assert code == 0, text[-3000:]


def test_add_sub_gives_the_sum_and_the_difference(served):
    r = infer(served["url"], "add_sub", [1, 2, 3, 4], [0.5, 0.5, 0.5, 0.5], batched=False)
    assert r.status_code == 200, r.text
    assert outputs(r) == {"OUTPUT0": [1.5, 2.5, 3.5, 4.5], "OUTPUT1": [0.5, 1.5, 2.5, 3.5]}


def test_initialize_gets_tritons_args_and_hearths_weights(served):
    [args_file] = list((served["repo"] / "add_sub").glob("args-*"))
    args = json.loads(args_file.read_text())
    config = json.loads(args["model_config"])
    assert config["name"] == "add_sub" and config["input"][0]["name"] == "INPUT0"
    assert args["model_name"] == "add_sub" and args["model_version"] == "1"
    assert args["model_repository"] == str(served["repo"] / "add_sub")
    assert args["model_instance_kind"] == ("GPU" if KIND == "KIND_GPU" else "CPU")
    assert args["model_instance_device_id"] == "0"
    assert args["model_instance_name"].startswith("add_sub_0_")
    assert args["weights"] == ["weight"]  # the scale checkpoint, from the store
    assert "add_sub: INFO: add_sub initialized" in served["log"].read_text()


def test_an_error_response_fails_its_request_alone(served):
    url = served["url"]
    rows = [([1, 1, 1, 1], [1, 2, 3, 4]), ([-1, 0, 0, 0], [0, 0, 0, 0]),
            ([2, 2, 2, 2], [1, 1, 1, 1]), ([99, 0, 0, 0], [0, 0, 0, 0])]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda r: infer(url, "add_sub_batched", [r[0]], [r[1]], True), rows))
    assert got[0].status_code == 200, got[0].text
    assert outputs(got[0]) == {"OUTPUT0": [2, 3, 4, 5], "OUTPUT1": [0, -1, -2, -3]}
    assert got[2].status_code == 200, got[2].text
    assert outputs(got[2]) == {"OUTPUT0": [3, 3, 3, 3], "OUTPUT1": [1, 1, 1, 1]}
    # INVALID_ARG is the client's fault (400); any other code the model's (500).
    assert got[1].status_code == 400 and "INPUT0 holds a negative number" in got[1].text, got[1].text
    assert got[3].status_code == 500 and "99 broke it" in got[3].text, got[3].text
    # Unbatched, the same.
    r = infer(url, "add_sub", [-3, 0, 0, 0], [0, 0, 0, 0], batched=False)
    assert r.status_code == 400 and "INPUT0 holds a negative number" in r.text, r.text


def test_repeat_sends_a_response_per_element_from_its_threads(served):
    got, error = stream(served["url"], "repeat", {"IN": [4, 2, 0, 1], "DELAY": [1, 5, 0, 2]})
    assert error is None
    assert [(e["OUT"], e["IDX"]) for e in got] == [(4, 0), (2, 1), (0, 2), (1, 3)]
    # Several at once, each its own.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        many = list(pool.map(lambda n: stream(served["url"], "repeat",
                                              {"IN": list(range(n, n + 5)), "DELAY": [1] * 5}),
                             [10, 20, 30, 40]))
    for n, (got, error) in zip([10, 20, 30, 40], many):
        assert error is None and [e["OUT"] for e in got] == list(range(n, n + 5))
    got, error = stream(served["url"], "repeat", {"IN": [1, 2], "DELAY": [1]})
    assert got == [] and "IN and DELAY differ in shape" in error


def test_square_sends_n_responses_then_the_final_flag(served):
    for n in (0, 1, 5):
        got, error = stream(served["url"], "square", {"IN": [n]})
        assert error is None and [e["OUT"] for e in got] == [n] * n
    got, error = stream(served["url"], "square", {"IN": [-2]})
    assert got == [] and "IN is -2: a count is 0 or more" in error
    # Answered once (/infer), the responses are joined.
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [3]}]}
    r = requests.post(f"{served['url']}/v2/models/square/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_bls_fails_the_request_naming_it(served):
    r = requests.post(f"{served['url']}/v2/models/bls/infer", timeout=60, json={
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}]})
    assert r.status_code == 500 and "BLS" in r.text, r.text


def test_auto_complete_config_may_confirm_but_not_change_the_config(served):
    url = served["url"]
    r = requests.post(f"{url}/v2/models/confirms/infer", timeout=60, json={
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
    assert r.status_code == 200 and outputs(r)["OUTPUT0"] == [2, 4, 6, 8], r.text
    r = requests.get(f"{url}/v2/models/changes/ready", timeout=10)
    assert r.status_code != 200
    assert "auto_complete_config changed the model's config" in served["log"].read_text()
    assert "max_batch_size: 8 -> 4" in served["log"].read_text()


def test_python_models_without_weights_are_served_and_no_other_backend_is(served):
    url = served["url"]
    # The decoupled models above (repeat, square) have no checkpoint either.
    r = requests.post(f"{url}/v2/models/plain_weightless/infer", timeout=60, json={
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]})
    assert r.status_code == 200 and outputs(r)["OUTPUT0"] == [2, 3, 4, 5], r.text
    r = requests.get(f"{url}/v2/models/scale_weightless/ready", timeout=10)
    assert r.status_code == 503
    assert "no version directory holding model.safetensors" in r.text, r.text
    assert "model.py" not in r.text.split("no version directory")[1].split("(")[0], r.text
