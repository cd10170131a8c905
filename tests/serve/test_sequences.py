"""Sequence batching under `hearth serve`, as Triton's clients use it: a
Triton Python model with a config.pbtxt whose sequence_batching gives
control inputs (START, END, READY, CORRID) and an implicit state, served by
two workers. Requests name their sequence with the parameters sequence_id,
sequence_start and sequence_end over REST and gRPC; the server keeps each
sequence's state, so a worker SIGKILLed mid-sequence loses nothing.
Workers run /usr/bin/python3 on the CPU."""

import concurrent.futures
import os
import sys

import pytest
import requests

from serve_support import start_serve, stop_serve

# OUTPUT = the running sum of INPUT over the sequence (its state);
# CORRID_OUT and STARTED echo what the server gave. INPUT 666 takes the
# worker down the first time it is seen.
ACCUMULATE_PY = """
import os
import signal

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "killed-once")

    def execute(self, requests):
        responses = []
        for request in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            x, state = get("INPUT"), get("INPUT_STATE")
            if x[0, 0] == 666 and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            assert get("READY")[0, 0] == 1
            total = (state + x).astype(np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT", total),
                pb_utils.Tensor("OUTPUT_STATE", total),
                pb_utils.Tensor("CORRID_OUT", get("CORRID").astype(np.uint64)),
                pb_utils.Tensor("STARTED", get("START").astype(np.int32))]))
        return responses
"""

ACCUMULATE_PBTXT = """name: "accumulate"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [
  { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "CORRID_OUT" data_type: TYPE_UINT64 dims: [ 1 ] },
  { name: "STARTED" data_type: TYPE_INT32 dims: [ 1 ] }
]
instance_group [ { count: 2 kind: KIND_CPU } ]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  oldest { max_candidate_sequences: 64 max_queue_delay_microseconds: 1000 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [ {
    input_name: "INPUT_STATE"
    output_name: "OUTPUT_STATE"
    data_type: TYPE_FP32
    dims: [ 1 ]
    initial_state { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "zeros" }
  } ]
}
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sequences")
    repo = tmp / "repo"
    version = repo / "accumulate" / "1"
    version.mkdir(parents=True)
    (repo / "accumulate" / "config.pbtxt").write_text(ACCUMULATE_PBTXT)
    (version / "model.py").write_text(ACCUMULATE_PY)
    state = start_serve(tmp, repo, env={**os.environ, "HEARTH_PYTHON": sys.executable})
    state["repo"] = repo
    yield state
    code, text = stop_serve(state)
    assert code == 0, text[-3000:]


def step(url, sequence, value, start=False, end=False, outputs=None):
    parameters = {"sequence_id": sequence}
    if start:
        parameters["sequence_start"] = True
    if end:
        parameters["sequence_end"] = True
    body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 1], "data": [value]}],
            "parameters": parameters}
    if outputs is not None:
        body["outputs"] = [{"name": o} for o in outputs]
    return requests.post(f"{url}/v2/models/accumulate/infer", json=body, timeout=60)


def outputs(r):
    assert r.status_code == 200, r.text
    return {o["name"]: o["data"] for o in r.json()["outputs"]}


def test_the_metadata_lists_the_requests_own_tensors_only(served):
    meta = requests.get(f"{served['url']}/v2/models/accumulate", timeout=10).json()
    assert [t["name"] for t in meta["inputs"]] == ["INPUT"]
    assert [t["name"] for t in meta["outputs"]] == ["OUTPUT", "CORRID_OUT", "STARTED"]


def test_a_sequence_accumulates_in_the_servers_state(served):
    url = served["url"]
    got = outputs(step(url, 11, 2, start=True))
    assert got == {"OUTPUT": [2.0], "CORRID_OUT": [11], "STARTED": [1]}
    assert outputs(step(url, 11, 3))["OUTPUT"] == [5.0]
    # Asked for one output, the state still flows and is not answered.
    assert outputs(step(url, 11, 4, outputs=["OUTPUT"])) == {"OUTPUT": [9.0]}
    last = outputs(step(url, 11, 1, end=True))
    assert last["OUTPUT"] == [10.0] and last["STARTED"] == [0]
    r = step(url, 11, 1)
    assert r.status_code == 400 and "must specify the START flag" in r.json()["error"], r.text


def test_live_sequences_are_counted_in_metrics(served):
    url = served["url"]
    outputs(step(url, 51, 1, start=True))
    metrics = requests.get(f"{url}/metrics", timeout=10).text
    live = [line for line in metrics.splitlines()
            if line.startswith("hearth_live_sequences{") and 'model="accumulate"' in line]
    assert live and float(live[0].rsplit(" ", 1)[1]) >= 1, metrics[-2000:]
    outputs(step(url, 51, 1, end=True))


def test_a_correlation_id_beyond_63_bits_reaches_the_model(served):
    big = 2**64 - 5
    got = outputs(step(served["url"], big, 1, start=True, end=True))
    assert got["CORRID_OUT"] == [big]


def test_interleaved_sequences_keep_apart(served):
    url = served["url"]

    def run(sequence):
        total = []
        for i in range(6):
            r = step(url, sequence, sequence * 100 + i, start=i == 0, end=i == 5)
            total.append(outputs(r)["OUTPUT"][0])
        return total

    sequences = list(range(1, 9))
    with concurrent.futures.ThreadPoolExecutor(len(sequences)) as pool:
        results = dict(zip(sequences, pool.map(run, sequences)))
    for sequence, totals in results.items():
        expect, running = [], 0
        for i in range(6):
            running += sequence * 100 + i
            expect.append(float(running))
        assert totals == expect, sequence


def test_a_worker_killed_mid_sequence_loses_nothing(served):
    url = served["url"]
    assert outputs(step(url, 21, 1, start=True))["OUTPUT"] == [1.0]
    # This step takes its worker down; the server runs it again on the
    # other, with the state it holds.
    assert outputs(step(url, 21, 666))["OUTPUT"] == [667.0]
    assert (served["repo"] / "accumulate" / "killed-once").exists()
    assert outputs(step(url, 21, 1, end=True))["OUTPUT"] == [668.0]


def test_bad_sequence_requests_are_refused_by_name(served):
    url = served["url"]
    body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 1], "data": [1]}]}
    r = requests.post(f"{url}/v2/models/accumulate/infer", json=body, timeout=60)
    assert r.status_code == 400 and "non-zero or non-empty correlation ID" in r.json()["error"]
    r = step(url, "a-string", 1, start=True)
    assert r.status_code == 400 and "give sequence_id as an integer" in r.json()["error"]
    r = step(url, 31, 1)
    assert r.status_code == 400 and "must specify the START flag" in r.json()["error"]
    body["parameters"] = {"sequence_id": 5, "sequence_start": True}
    body["inputs"].append({"name": "INPUT_STATE", "datatype": "FP32", "shape": [1, 1],
                           "data": [100]})
    r = requests.post(f"{url}/v2/models/accumulate/infer", json=body, timeout=60)
    assert r.status_code == 400 and "unknown input \"INPUT_STATE\"" in r.json()["error"], r.text
    body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [2, 1], "data": [1, 2]}],
            "parameters": {"sequence_id": 5, "sequence_start": True}}
    r = requests.post(f"{url}/v2/models/accumulate/infer", json=body, timeout=60)
    assert r.status_code == 400 and "of batch 1, not 2" in r.json()["error"], r.text


def test_sequences_over_grpc(served):
    from grpc_support import connect, grpc_port, infer_request, outputs_of
    import numpy as np
    port = grpc_port(served["log"].read_text())
    channel, stub = connect(port)
    try:
        def grpc_step(value, **parameters):
            request = infer_request("accumulate", "INPUT", np.array([[value]], np.float32),
                                    parameters={"sequence_id": 41, **parameters})
            return stub.ModelInfer(request, timeout=60)

        grpc_step(5, sequence_start=True)
        grpc_step(6)
        response = grpc_step(7, sequence_end=True)
        got = outputs_of(response)
        assert got["OUTPUT"].ravel().tolist() == [18.0]
        assert got["CORRID_OUT"].ravel().tolist() == [41]
    finally:
        channel.close()


def test_a_grpc_streams_sequence_steps_run_in_the_order_sent(served):
    # Every step of 6 interleaved sequences is written at once on one
    # ModelStreamInfer stream; each answer must be its sequence's running
    # total so far, as if the steps had run one by one in the order sent.
    from grpc_support import connect, grpc_port, infer_request, outputs_of
    import numpy as np
    port = grpc_port(served["log"].read_text())
    channel, stub = connect(port)
    steps = 8
    try:
        # Rounds of new sequences: a request answered while the stream hands
        # the next one to the service must not let a later one overtake it.
        for first in range(9001, 9001 + 5 * 6, 6):
            sequences = [first + i for i in range(6)]
            sent = []  # (sequence, value, request id, request), in the order written
            for n in range(steps):
                for s in sequences:
                    parameters = {"sequence_id": s, "sequence_start": n == 0,
                                  "sequence_end": n == steps - 1}
                    value = float(s % 7 + n)
                    request = infer_request("accumulate", "INPUT", np.array([[value]], np.float32),
                                            id=f"{s}-{n}", outputs=("OUTPUT",),
                                            parameters=parameters)
                    sent.append((s, value, f"{s}-{n}", request))
            answers = {}
            for message in stub.ModelStreamInfer(iter([r for *_, r in sent]), timeout=120):
                assert message.error_message == "", message.error_message
                answers[message.infer_response.id] = \
                    outputs_of(message.infer_response)["OUTPUT"].ravel().tolist()
            totals = {s: 0.0 for s in sequences}
            for s, value, request_id, _ in sent:
                totals[s] += value
                assert answers[request_id] == [totals[s]], \
                    (request_id, answers[request_id], totals[s])
    finally:
        channel.close()
