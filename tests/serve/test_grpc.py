"""`hearth serve`'s KServe v2 gRPC endpoint, driven with grpcio and stubs
generated here from proto/ (no Triton client in CI): health, metadata,
config, statistics and the repository index agree with REST and the
config; inference over raw and typed contents equals REST's answers and a
NumPy reference; errors carry REST's messages with the matching gRPC code;
streams answer every request and survive bad ones; priority levels are the
model's; classification answers the top logits; inputs and outputs go
through registered POSIX shared-memory regions; repository unload, load
and a new version's load, under load; oversize messages and compressed
ones are refused and the server goes on; --grpc-port -1 turns it off, a
port in use fails start-up clearly, and SIGTERM ends open streams with
UNAVAILABLE before the server exits 0.

Paths: $HEARTH_CLI (default build/bin/hearth). Skips, saying why, when this
hearth was built without gRPC or /usr/bin/python3 lacks grpcio/grpc_tools.
"""

import concurrent.futures
import mmap
import os
import pathlib
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest
import requests

from grpc_support import (MAX_MESSAGE, STUBS, connect, grpc, grpc_port, h2_frame, hpack_literal,
                          infer_request, mc, outputs_of, pb, rpc_error, write_repository)
from serve_support import (CLI, KIND, MLP, SCALE_N, infer_binary, infer_json, mlp_reference, read_safetensors,
                           split_binary, start_serve, stop_serve)


@pytest.fixture(scope="module")
def server():
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-grpc-test-"))
    write_repository(tmp / "repo")
    state = start_serve(tmp, tmp / "repo", ["--grpc-max-message-bytes", str(MAX_MESSAGE),
                                            "--server-name", "triton"])
    state["grpc_port"] = grpc_port(state["log"].read_text())
    state["channel"], state["stub"] = connect(state["grpc_port"])
    state["weights"] = {
        "mlp": read_safetensors(tmp / "repo" / "mlp" / "1" / "model.safetensors"),
        "scale": read_safetensors(tmp / "repo" / "scale" / "1" / "model.safetensors"),
    }
    state["tmp"] = tmp
    yield state
    state["channel"].close()
    code, text = stop_serve(state)
    shutil.rmtree(tmp, ignore_errors=True)
    assert code == 0, text[-2000:]


def test_health_and_metadata_agree_with_rest(server):
    stub, url = server["stub"], server["url"]
    assert stub.ServerLive(pb.ServerLiveRequest(), timeout=30).live
    assert stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready == (
        requests.get(f"{url}/v2/health/ready", timeout=30).status_code == 200)
    rest = requests.get(f"{url}/v2", timeout=30).json()
    meta = stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=30)
    assert (meta.name, meta.version, list(meta.extensions)) == (rest["name"], rest["version"], rest["extensions"])
    assert meta.name == "triton"  # --server-name
    for model in ("mlp", "scale"):
        rest = requests.get(f"{url}/v2/models/{model}", timeout=30).json()
        m = stub.ModelMetadata(pb.ModelMetadataRequest(name=model), timeout=30)
        assert m.name == rest["name"] and list(m.versions) == rest["versions"] and m.platform == rest["platform"]
        for got, want in ((m.inputs, rest["inputs"]), (m.outputs, rest["outputs"])):
            assert [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in got] == want
    assert stub.ModelReady(pb.ModelReadyRequest(name="mlp"), timeout=30).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name="mlp", version="1"), timeout=30).ready
    # Known but not served (REST: 503): not ready. Unknown model or version
    # (REST: 404): not ready too, with status OK, as Triton answers.
    assert requests.get(f"{url}/v2/models/broken/ready", timeout=30).status_code == 503
    assert not stub.ModelReady(pb.ModelReadyRequest(name="broken"), timeout=30).ready
    assert requests.get(f"{url}/v2/models/nope/ready", timeout=30).status_code == 404
    assert not stub.ModelReady(pb.ModelReadyRequest(name="nope"), timeout=30).ready
    assert not stub.ModelReady(pb.ModelReadyRequest(name="mlp", version="7"), timeout=30).ready
    # Unknown models and versions are worded as Triton's, which its clients match.
    e = rpc_error(stub.ModelMetadata, pb.ModelMetadataRequest(name="mlp", version="7"), timeout=30)
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert e.details() == requests.get(f"{url}/v2/models/mlp/versions/7", timeout=30).json()["error"]
    assert e.details().startswith("Request for unknown model: 'mlp' version 7 is not found"), e.details()
    e = rpc_error(stub.ModelMetadata, pb.ModelMetadataRequest(name="nope"), timeout=30)
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert e.details() == "Request for unknown model: 'nope' is not found"
    e = rpc_error(stub.ModelInfer, infer_request("nope", "x", np.ones((1, SCALE_N), np.float32)), timeout=30)
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert e.details().startswith("Request for unknown model: 'nope' is not found"), e.details()


def test_version_that_is_not_a_number_is_invalid_argument(server):
    # Triton's wording and status, which its clients match: a malformed
    # version is the request's fault, not an unknown version.
    stub, url = server["stub"], server["url"]
    want = "failed to get model version from specified version string 'wrong_specification'"
    x = np.ones((1, SCALE_N), np.float32)
    calls = [(stub.ModelReady, pb.ModelReadyRequest(name="scale", version="wrong_specification")),
             (stub.ModelMetadata, pb.ModelMetadataRequest(name="scale", version="wrong_specification")),
             (stub.ModelConfig, pb.ModelConfigRequest(name="scale", version="wrong_specification")),
             (stub.ModelInfer, infer_request("scale", "x", x))]
    calls[-1][1].model_version = "wrong_specification"
    for call, request in calls:
        e = rpc_error(call, request, timeout=30)
        assert (e.code(), e.details()) == (grpc.StatusCode.INVALID_ARGUMENT, want), call
    base = f"{url}/v2/models/scale/versions/wrong_specification"
    for r in (requests.get(f"{base}/ready", timeout=30), requests.get(base, timeout=30),
              requests.get(f"{base}/config", timeout=30),
              requests.post(f"{base}/infer", json={"inputs": [{"name": "x", "datatype": "FP32",
                                                               "shape": [1, SCALE_N], "data": x.ravel().tolist()}]},
                            timeout=30)):
        assert r.status_code == 400 and r.json()["error"] == want, (r.url, r.text)
    # Numbers are versions, written as a number may be: "01" is version 1.
    assert stub.ModelReady(pb.ModelReadyRequest(name="scale", version="01"), timeout=30).ready
    for version, code in (("-1", grpc.StatusCode.NOT_FOUND), ("7", grpc.StatusCode.NOT_FOUND),
                          ("99999999999999999999", grpc.StatusCode.INVALID_ARGUMENT),
                          ("1x", grpc.StatusCode.INVALID_ARGUMENT), (" 1", grpc.StatusCode.INVALID_ARGUMENT)):
        e = rpc_error(stub.ModelMetadata, pb.ModelMetadataRequest(name="scale", version=version), timeout=30)
        assert e.code() == code, (version, e.details())
    assert requests.get(f"{url}/v2/models/scale/versions/1x", timeout=30).status_code == 400


def test_log_settings_change_live_and_agree_with_rest(server):
    stub, url = server["stub"], server["url"]
    rest = requests.get(f"{url}/v2/logging", timeout=30).json()
    assert rest == {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
                    "log_verbose_level": 0, "log_format": "default"}
    settings = stub.LogSettings(pb.LogSettingsRequest(), timeout=30).settings
    assert {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in settings.items()} == rest
    request = pb.LogSettingsRequest()
    request.settings["log_verbose_level"].uint32_param = 1
    assert stub.LogSettings(request, timeout=30).settings["log_verbose_level"].uint32_param == 1
    assert requests.get(f"{url}/v2/logging", timeout=30).json()["log_verbose_level"] == 1
    # Refused whole, on both.
    r = requests.post(f"{url}/v2/logging", json={"log_verbose_level": 0, "log_file": "/tmp/x"}, timeout=30)
    assert r.status_code == 400 and "log_file '/tmp/x' cannot be set" in r.json()["error"]
    request = pb.LogSettingsRequest()
    request.settings["log_file"].string_param = "/tmp/x"
    assert rpc_error(stub.LogSettings, request, timeout=30).code() == grpc.StatusCode.INVALID_ARGUMENT
    r = requests.post(f"{url}/v2/logging", json={"log_verbose_level": 0}, timeout=30)
    assert r.status_code == 200 and r.json() == rest


def test_trace_settings_say_tracing_is_off_and_stays_off(server):
    stub, url = server["stub"], server["url"]
    rest = requests.get(f"{url}/v2/trace/setting", timeout=30).json()
    assert rest["trace_level"] == ["OFF"]
    settings = stub.TraceSetting(pb.TraceSettingRequest(), timeout=30).settings
    assert {k: list(v.value) for k, v in settings.items()} == \
        {k: v if isinstance(v, list) else [v] for k, v in rest.items()}
    request = pb.TraceSettingRequest(model_name="mlp")
    request.settings["trace_level"].value.append("TIMESTAMPS")
    e = rpc_error(stub.TraceSetting, request, timeout=30)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "hearth does not trace requests" in e.details()
    r = requests.post(f"{url}/v2/models/mlp/trace/setting", json={"trace_level": ["TIMESTAMPS"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"] == e.details()


def test_mlp_matches_rest_and_numpy(server):
    rng = np.random.default_rng(21)
    x = rng.standard_normal((5, MLP[0])).astype(np.float32)
    response = server["stub"].ModelInfer(infer_request("mlp", "input", x, id="g-1"), timeout=30)
    assert (response.model_name, response.model_version, response.id) == ("mlp", "1", "g-1")
    out = outputs_of(response)
    assert [o.datatype for o in response.outputs] == ["FP32", "INT64"]
    ref_logits, ref_argmax = mlp_reference(server["weights"]["mlp"], x)
    np.testing.assert_allclose(out["logits"], ref_logits, rtol=1e-4, atol=1e-4)
    assert out["argmax"].shape == (5, 1) and out["argmax"].ravel().tolist() == ref_argmax.tolist()
    # REST's binary answer to the same input: the same bytes.
    r = infer_binary(server["url"], "mlp", "input", x, outputs=["logits", "argmax"])
    assert r.status_code == 200, r.text
    _, parts = split_binary(r)
    assert parts["logits"] == out["logits"].tobytes() and parts["argmax"] == out["argmax"].tobytes()
    # Typed contents give the same answer as raw bytes.
    typed = outputs_of(server["stub"].ModelInfer(infer_request("mlp", "input", x, typed=True), timeout=30))
    assert typed["logits"].tobytes() == out["logits"].tobytes()


def test_scale_and_requested_outputs(server):
    rng = np.random.default_rng(22)
    x = rng.standard_normal((3, SCALE_N)).astype(np.float32)
    response = server["stub"].ModelInfer(infer_request("scale", "x", x, outputs=["y"]), timeout=30)
    assert [o.name for o in response.outputs] == ["y"] and list(response.outputs[0].shape) == [3, 1]
    ref = x.astype(np.float64) @ server["weights"]["scale"]["weight"].astype(np.float64)
    np.testing.assert_allclose(outputs_of(response)["y"].ravel(), ref.ravel(), rtol=1e-4, atol=1e-3)
    only_argmax = server["stub"].ModelInfer(
        infer_request("mlp", "input", np.zeros((1, MLP[0]), np.float32), outputs=["argmax"]), timeout=30)
    assert [o.name for o in only_argmax.outputs] == ["argmax"] and len(only_argmax.raw_output_contents) == 1


def test_concurrent_calls_each_get_their_own_answer(server):
    """64 concurrent calls of 1 to 3 rows on one channel: the outputs are
    borrowed from the worker's slot while they are copied into each
    response, so each must carry the result of its own input."""
    rng = np.random.default_rng(23)
    xs = [rng.standard_normal((1 + i % 3, MLP[0])).astype(np.float32) for i in range(64)]

    def one(x):
        return outputs_of(server["stub"].ModelInfer(infer_request("mlp", "input", x), timeout=60))["logits"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, xs))
    for x, got in zip(xs, results):
        np.testing.assert_allclose(got, mlp_reference(server["weights"]["mlp"], x)[0], rtol=1e-4, atol=1e-4)


BAD = [
    ("unknown input", lambda: ("mlp", [("nope", "FP32", [1, MLP[0]], np.zeros(MLP[0], "<f4").tobytes())])),
    ("wrong datatype", lambda: ("mlp", [("input", "INT32", [1, MLP[0]], np.zeros(MLP[0], "<i4").tobytes())])),
    ("shape vs config", lambda: ("mlp", [("input", "FP32", [1, MLP[0] + 1], np.zeros(MLP[0] + 1, "<f4").tobytes())])),
    ("batch over max", lambda: ("mlp", [("input", "FP32", [9, MLP[0]], np.zeros(9 * MLP[0], "<f4").tobytes())])),
    ("missing input", lambda: ("mlp", [])),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_errors_are_rests_with_the_matching_code(server, case):
    name, make = case
    model, inputs = make()
    request = pb.ModelInferRequest(model_name=model)
    rest_inputs = []
    for input_name, datatype, shape, raw in inputs:
        request.inputs.add(name=input_name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
        dtype = "<f4" if datatype == "FP32" else "<i4"
        rest_inputs.append({"name": input_name, "datatype": datatype, "shape": shape,
                            "data": np.frombuffer(raw, dtype).tolist()})
    e = rpc_error(server["stub"].ModelInfer, request, timeout=30)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.details())
    r = infer_json(server["url"], model, rest_inputs)
    assert r.status_code == 400
    assert e.details() == r.json()["error"], name
    # Nothing changed: the next request is answered right.
    test_scale_and_requested_outputs(server)


def test_unknown_models_versions_and_wrong_data_sizes(server):
    stub = server["stub"]
    x = np.zeros((1, MLP[0]), np.float32)
    e = rpc_error(stub.ModelInfer, infer_request("nope", "input", x), timeout=30)
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert e.details() == infer_json(server["url"], "nope", [{"name": "input", "datatype": "FP32", "shape": [1, MLP[0]],
                                                               "data": x.ravel().tolist()}]).json()["error"]
    versioned = infer_request("mlp", "input", x)
    versioned.model_version = "9"
    assert rpc_error(stub.ModelInfer, versioned, timeout=30).code() == grpc.StatusCode.NOT_FOUND
    short = infer_request("mlp", "input", x)
    short.raw_input_contents[0] = short.raw_input_contents[0][:-4]
    e = rpc_error(stub.ModelInfer, short, timeout=30)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == f'input "input": raw_input_contents has {4 * MLP[0] - 4} bytes but shape [1,{MLP[0]}] of FP32 needs {4 * MLP[0]}'
    sequence = infer_request("mlp", "input", x)
    sequence.parameters["sequence_id"].uint64_param = 3
    e = rpc_error(stub.ModelInfer, sequence, timeout=30)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "has no sequence_batching" in e.details()


def test_timeout_parameter_answers_deadline_exceeded_as_rest_answers_504(server):
    x = np.zeros((1, MLP[0]), dtype=np.float32)
    e = rpc_error(server["stub"].ModelInfer, infer_request("batched", "input", x, parameters={"timeout": 50000}),
                  timeout=30)
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    r = infer_json(server["url"], "batched", [{"name": "input", "datatype": "FP32", "shape": [1, MLP[0]],
                                               "data": x.ravel().tolist()}], parameters={"timeout": 50000})
    assert r.status_code == 504 and "timed out" in e.details()


def test_stream_answers_every_request_and_survives_bad_ones(server):
    rng = np.random.default_rng(24)
    xs = {f"m{i}": rng.standard_normal((1 + i % 2, MLP[0])).astype(np.float32) for i in range(6)}
    requests_ = [infer_request("mlp", "input", x, id=k) for k, x in xs.items()]
    bad = infer_request("mlp", "input", np.zeros((1, MLP[0] + 1), np.float32), id="bad")
    requests_.insert(3, bad)
    requests_.append(infer_request("scale", "x", np.ones((2, SCALE_N), np.float32), id="s"))
    answers = {}
    for message in server["stub"].ModelStreamInfer(iter(requests_), timeout=60):
        answers[message.infer_response.id] = message
    assert set(answers) == set(xs) | {"bad", "s"}
    assert answers["bad"].error_message == f'input "input": shape [1,{MLP[0] + 1}] does not match the model\'s [-1,{MLP[0]}]'
    for k, x in xs.items():
        response = answers[k].infer_response
        assert answers[k].error_message == ""
        assert response.parameters["triton_final_response"].bool_param
        np.testing.assert_allclose(outputs_of(response)["logits"], mlp_reference(server["weights"]["mlp"], x)[0],
                                   rtol=1e-4, atol=1e-4)
    ref = np.ones((2, SCALE_N)) @ server["weights"]["scale"]["weight"].astype(np.float64)
    np.testing.assert_allclose(outputs_of(answers["s"].infer_response)["y"].ravel(), ref.ravel(), rtol=1e-4, atol=1e-3)


def test_model_config_says_what_config_yaml_says(server):
    config = server["stub"].ModelConfig(pb.ModelConfigRequest(name="scale"), timeout=30).config
    assert config.name == "scale" and config.backend == "scale" and config.max_batch_size == 4
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("x", mc.TYPE_FP32, [SCALE_N])]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [("y", mc.TYPE_FP32, [1])]
    kind = mc.ModelInstanceGroup.KIND_GPU if KIND == "KIND_GPU" else mc.ModelInstanceGroup.KIND_CPU
    assert [(g.count, g.kind) for g in config.instance_group] == [(2, kind)]
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    assert list(config.dynamic_batching.preferred_batch_size) == [2, 4]
    assert config.parameters["note"].string_value == "seen by gRPC"
    assert not config.model_transaction_policy.decoupled
    assert list(config.version_policy.specific.versions) == [1]
    # Where REST serves the config too, both say the same.
    r = requests.get(f"{server['url']}/v2/models/scale/config", timeout=30)
    if r.status_code == 200:
        rest = r.json()
        assert rest["max_batch_size"] == config.max_batch_size and rest["name"] == config.name
    e = rpc_error(server["stub"].ModelConfig, pb.ModelConfigRequest(name="nope"), timeout=30)
    assert e.code() == grpc.StatusCode.NOT_FOUND


def test_statistics_count_this_tests_requests(server):
    stub = server["stub"]

    def scale_stats():
        stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="scale"), timeout=30).model_stats
        assert len(stats) == 1 and stats[0].name == "scale" and stats[0].version == "1"
        return stats[0]

    before = scale_stats()
    for rows in (1, 2, 3):
        stub.ModelInfer(infer_request("scale", "x", np.ones((rows, SCALE_N), np.float32)), timeout=30)
    after = scale_stats()
    assert after.inference_count - before.inference_count == 6
    assert after.inference_stats.success.count - before.inference_stats.success.count == 3
    assert 1 <= after.execution_count - before.execution_count <= 3
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    assert after.last_inference >= before.last_inference > 0
    assert sum(b.compute_infer.count for b in after.batch_stats) == after.execution_count
    everything = stub.ModelStatistics(pb.ModelStatisticsRequest(), timeout=30).model_stats
    assert {"mlp", "scale", "batched"} <= {s.name for s in everything}
    r = requests.get(f"{server['url']}/v2/models/scale/stats", timeout=30)
    if r.status_code == 200:  # where REST serves statistics too
        rest = r.json()["model_stats"][0]
        assert int(rest["inference_count"]) >= after.inference_count
    e = rpc_error(stub.ModelStatistics, pb.ModelStatisticsRequest(name="nope"), timeout=30)
    assert e.code() == grpc.StatusCode.NOT_FOUND


def test_repository_index(server):
    index = {m.name: m for m in server["stub"].RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30).models}
    assert set(index) == {"mlp", "scale", "batched", "broken", "prio", "swap"}
    assert (index["mlp"].state, index["mlp"].version) == ("READY", "1")
    assert index["broken"].state == "UNAVAILABLE" and "dims" in index["broken"].reason
    ready = [m.name for m in server["stub"].RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=30).models]
    assert ready == ["batched", "mlp", "prio", "scale", "swap"]


def test_there_are_no_cuda_shared_memory_regions(server):
    # perf_analyzer --shared-memory system unregisters all CUDA regions too, and stops if that fails.
    stub = server["stub"]
    assert dict(stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(), timeout=30).regions) == {}
    stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(), timeout=30)
    for call, request in ((stub.CudaSharedMemoryStatus, pb.CudaSharedMemoryStatusRequest(name="c")),
                          (stub.CudaSharedMemoryUnregister, pb.CudaSharedMemoryUnregisterRequest(name="c"))):
        e = rpc_error(call, request, timeout=30)
        assert e.code() == grpc.StatusCode.NOT_FOUND and "'c'" in e.details(), e.details()
    # A handle of the wrong size is refused on any server (the rest is test_cuda_shm.py's).
    e = rpc_error(stub.CudaSharedMemoryRegister, pb.CudaSharedMemoryRegisterRequest(name="r", byte_size=64),
                  timeout=30)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "of 64 bytes, not 0" in e.details(), e.details()


def test_sequences_are_refused_not_ignored(server):
    stub = server["stub"]
    for key, set_value in (("sequence_id", lambda p: setattr(p, "int64_param", 7)),
                           ("sequence_start", lambda p: setattr(p, "bool_param", True)),
                           ("sequence_end", lambda p: setattr(p, "bool_param", True))):
        request = infer_request("mlp", "input", np.zeros((1, MLP[0]), np.float32))
        set_value(request.parameters[key])
        e = rpc_error(stub.ModelInfer, request, timeout=30)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "has no sequence_batching" in e.details() \
            and f"this one sets {key}" in e.details(), (key, e.details())


def scale_reference(server, x):
    return x.astype(np.float64) @ server["weights"]["scale"]["weight"].astype(np.float64)


def test_priority_levels_are_the_models(server):
    stub = server["stub"]
    x = np.random.default_rng(31).standard_normal((1, SCALE_N)).astype(np.float32)
    for level in (1, 2):
        y = outputs_of(stub.ModelInfer(infer_request("prio", "x", x, parameters={"priority": level}), timeout=30))["y"]
        np.testing.assert_allclose(y.ravel(), scale_reference(server, x).ravel(), rtol=1e-4, atol=1e-3)
    as_tritonclient = infer_request("prio", "x", x)  # it sends uint64_param
    as_tritonclient.parameters["priority"].uint64_param = 1
    stub.ModelInfer(as_tritonclient, timeout=30)
    e = rpc_error(stub.ModelInfer, infer_request("prio", "x", x, parameters={"priority": 3}), timeout=30)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority 3 is outside" in e.details() and "[1, 2]" in e.details(), e.details()
    e = rpc_error(stub.ModelInfer, infer_request("prio", "x", x, parameters={"priority": -1}), timeout=30)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "non-negative" in e.details()
    # 0 is the model's default level; a model without levels takes any.
    stub.ModelInfer(infer_request("prio", "x", x, parameters={"priority": 0}), timeout=30)
    stub.ModelInfer(infer_request("scale", "x", x, parameters={"priority": 9}), timeout=30)


def bytes_elements(raw):
    """The elements of a serialised BYTES tensor (4-byte little-endian length, then the bytes)."""
    out, at = [], 0
    while at < len(raw):
        (n,) = np.frombuffer(raw[at:at + 4], "<u4")
        out.append(raw[at + 4:at + 4 + int(n)])
        at += 4 + int(n)
    return out


def test_classification_is_the_top_n_of_the_logits(server):
    stub = server["stub"]
    x = np.random.default_rng(32).standard_normal((3, MLP[0])).astype(np.float32)
    logits = outputs_of(stub.ModelInfer(infer_request("mlp", "input", x, outputs=["logits"]), timeout=30))["logits"]
    np.testing.assert_allclose(logits, mlp_reference(server["weights"]["mlp"], x)[0], rtol=1e-4, atol=1e-4)
    for n in (3, MLP[2] + 5):
        request = infer_request("mlp", "input", x, outputs=["logits", "argmax"])
        request.outputs[0].parameters["classification"].int64_param = n
        response = stub.ModelInfer(request, timeout=30)
        classes, argmax = response.outputs
        width = min(n, MLP[2])
        assert (classes.name, classes.datatype, list(classes.shape)) == ("logits", "BYTES", [3, width])
        assert argmax.datatype == "INT64" and len(response.raw_output_contents) == 2
        elements = bytes_elements(response.raw_output_contents[0])
        assert len(elements) == 3 * width
        for row in range(3):
            pairs = [e.decode().split(":") for e in elements[row * width:(row + 1) * width]]
            indices = [int(i) for _, i in pairs]
            assert indices == np.argsort(-logits[row], kind="stable")[:width].tolist()
            np.testing.assert_allclose([float(v) for v, _ in pairs], logits[row][indices], rtol=1e-4, atol=1e-4)
        # Its top class is the model's own argmax of the same run.
        top = [int(elements[row * width].decode().split(":")[1]) for row in range(3)]
        assert top == np.frombuffer(response.raw_output_contents[1], "<i8").tolist()
    for bad in (0, -2):
        request = infer_request("mlp", "input", x, outputs=["logits"])
        request.outputs[0].parameters["classification"].int64_param = bad
        e = rpc_error(stub.ModelInfer, request, timeout=30)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "'classification'" in e.details()


class PosixShm:
    """A POSIX shared-memory object of this user, created in /dev/shm with
    `mode` and mapped here; unlinked by close()."""

    def __init__(self, name, size, mode=0o600):
        self.key = "/" + name
        self.path = "/dev/shm/" + name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            os.fchmod(fd, mode)  # whatever the umask
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def close(self):
        self.map.close()
        os.unlink(self.path)


def shm_input(request, index, region, offset, byte_size):
    p = request.inputs[index].parameters
    p["shared_memory_region"].string_param = region
    p["shared_memory_offset"].int64_param = offset
    p["shared_memory_byte_size"].int64_param = byte_size


def shm_output(request, name, region, offset, byte_size):
    output = request.outputs.add(name=name)
    output.parameters["shared_memory_region"].string_param = region
    output.parameters["shared_memory_offset"].int64_param = offset
    output.parameters["shared_memory_byte_size"].int64_param = byte_size


def test_system_shared_memory(server):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here for POSIX shared memory")
    stub = server["stub"]
    tag = f"hearth-grpc-{os.getpid()}"
    rows = 3
    x = np.random.default_rng(33).standard_normal((rows, SCALE_N)).astype(np.float32)
    objects = []
    try:
        inputs = PosixShm(tag + "-in", 4096 + x.nbytes)
        outputs = PosixShm(tag + "-out", 256)
        objects += [inputs, outputs]
        # "in" starts 4096 bytes into its object, "out" 64 into its own.
        stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
            name="in", key=inputs.key, offset=4096, byte_size=x.nbytes), timeout=30)
        stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
            name="out", key=outputs.key, offset=64, byte_size=128), timeout=30)
        regions = stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=30).regions
        assert {k: (r.name, r.key, r.offset, r.byte_size) for k, r in regions.items()} == {
            "in": ("in", inputs.key, 4096, x.nbytes), "out": ("out", outputs.key, 64, 128)}
        one = stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(name="out"), timeout=30).regions
        assert list(one) == ["out"]

        inputs.map[4096:4096 + x.nbytes] = x.tobytes()
        request = pb.ModelInferRequest(model_name="scale", id="shm-1", inputs=[
            pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[rows, SCALE_N])])
        shm_input(request, 0, "in", 0, x.nbytes)
        shm_output(request, "y", "out", 16, 4 * rows)
        response = stub.ModelInfer(request, timeout=30)
        (y,) = response.outputs
        assert (y.name, y.datatype, list(y.shape)) == ("y", "FP32", [rows, 1])
        assert y.parameters["shared_memory_region"].string_param == "out"
        assert y.parameters["shared_memory_offset"].int64_param == 16
        assert y.parameters["shared_memory_byte_size"].int64_param == 4 * rows
        assert list(response.raw_output_contents) == [b""]  # the bytes did not travel
        in_region = np.frombuffer(outputs.map[64 + 16:64 + 16 + 4 * rows], "<f4")
        inline = outputs_of(stub.ModelInfer(infer_request("scale", "x", x), timeout=30))["y"]
        np.testing.assert_allclose(in_region, inline.ravel(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(in_region, scale_reference(server, x).ravel(), rtol=1e-4, atol=1e-3)

        # The same on a stream.
        outputs.map[64:192] = bytes(128)
        answer = next(iter(stub.ModelStreamInfer(iter([request]), timeout=60)))
        assert answer.error_message == "" and list(answer.infer_response.raw_output_contents) == [b""]
        np.testing.assert_allclose(np.frombuffer(outputs.map[80:80 + 4 * rows], "<f4"), in_region)

        # Errors, each naming what is wrong; the server goes on.
        def infer_error(spoil):
            bad = pb.ModelInferRequest()
            bad.CopyFrom(request)
            spoil(bad)
            return rpc_error(stub.ModelInfer, bad, timeout=30)

        e = infer_error(lambda r: r.inputs[0].parameters["shared_memory_region"].__setattr__("string_param", "nope"))
        assert e.code() == grpc.StatusCode.NOT_FOUND and "no shared-memory region named 'nope'" in e.details()
        e = infer_error(lambda r: r.inputs[0].parameters["shared_memory_offset"].__setattr__("int64_param", 4))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "lies outside region 'in'" in e.details(), e.details()
        e = infer_error(lambda r: r.inputs[0].parameters["shared_memory_byte_size"].__setattr__("int64_param", 12))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.details() == f'input "x": shared_memory_byte_size is 12 but shape [{rows},{SCALE_N}] of FP32 needs {x.nbytes}'
        e = infer_error(lambda r: r.outputs[0].parameters["shared_memory_byte_size"].__setattr__("int64_param", 4))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not fit" in e.details(), e.details()
        e = infer_error(lambda r: r.outputs[0].parameters["shared_memory_offset"].__setattr__("int64_param", 126))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "lies outside region 'out'" in e.details(), e.details()

        def register_error(**fields):
            return rpc_error(stub.SystemSharedMemoryRegister, pb.SystemSharedMemoryRegisterRequest(**fields), timeout=30)

        e = register_error(name="in", key=inputs.key, byte_size=8)
        assert e.code() == grpc.StatusCode.ALREADY_EXISTS
        e = register_error(name="other", key="/" + tag + "-absent", byte_size=8)
        assert e.code() == grpc.StatusCode.NOT_FOUND
        e = register_error(name="other", key=outputs.key, offset=200, byte_size=100)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "lies outside" in e.details()
        e = register_error(name="other", key="not/a/key", byte_size=8)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        shared = PosixShm(tag + "-open", 64, mode=0o666)
        objects.append(shared)
        e = register_error(name="other", key=shared.key, byte_size=8)
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e.details()
        assert "writable by nobody else" in e.details()

        # Unregistered: gone for requests and for the status.
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name="in"), timeout=30)
        e = rpc_error(stub.ModelInfer, request, timeout=30)
        assert e.code() == grpc.StatusCode.NOT_FOUND and "'in'" in e.details()
        e = rpc_error(stub.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest(name="in"), timeout=30)
        assert e.code() == grpc.StatusCode.NOT_FOUND
        e = rpc_error(stub.SystemSharedMemoryUnregister, pb.SystemSharedMemoryUnregisterRequest(name="in"), timeout=30)
        assert e.code() == grpc.StatusCode.NOT_FOUND
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), timeout=30)  # all
        assert not stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=30).regions
        test_scale_and_requested_outputs(server)
    finally:
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), timeout=30)
        for o in objects:
            o.close()


def test_repository_control(server):
    """swap: unloaded (not ready, requests UNAVAILABLE), loaded again, then a
    version 2 written here is loaded while requests keep coming: none fails,
    and afterwards metadata and answers are version 2's."""
    stub, repo = server["stub"], server["tmp"] / "repo"
    x = np.random.default_rng(34).standard_normal((2, SCALE_N)).astype(np.float32)

    def y_of():
        return outputs_of(stub.ModelInfer(infer_request("swap", "x", x), timeout=60))["y"].ravel()

    def ready():
        return stub.ModelReady(pb.ModelReadyRequest(name="swap"), timeout=30).ready

    v1 = scale_reference(server, x).ravel()
    np.testing.assert_allclose(y_of(), v1, rtol=1e-4, atol=1e-3)
    stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="swap"), timeout=120)
    assert not ready()
    e = rpc_error(stub.ModelInfer, infer_request("swap", "x", x), timeout=30)
    assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
    index = {m.name: m for m in stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30).models}
    assert index["swap"].state != "READY"
    stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="swap"), timeout=120)
    assert ready()
    np.testing.assert_allclose(y_of(), v1, rtol=1e-4, atol=1e-3)

    (repo / "swap" / "2").mkdir()
    subprocess.run([CLI, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "7",
                    "--out", str(repo / "swap" / "2" / "model.safetensors")], check=True, capture_output=True)
    w2 = read_safetensors(repo / "swap" / "2" / "model.safetensors")["weight"].astype(np.float64)
    v2 = (x.astype(np.float64) @ w2).ravel()
    assert not np.allclose(v1, v2, rtol=1e-4, atol=1e-3)
    done, answers, failures = threading.Event(), [], []

    def keep_asking():
        while not done.is_set():
            try:
                answers.append(y_of())
            except grpc.RpcError as error:
                failures.append((error.code(), error.details()))

    clients = [threading.Thread(target=keep_asking) for _ in range(4)]
    for c in clients:
        c.start()
    try:
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="swap"), timeout=120)
    finally:
        done.set()
        for c in clients:
            c.join()
    assert failures == [], failures[:5]
    assert answers
    for y in answers:  # each is one version's answer
        assert np.allclose(y, v1, rtol=1e-4, atol=1e-3) or np.allclose(y, v2, rtol=1e-4, atol=1e-3)
    assert list(stub.ModelMetadata(pb.ModelMetadataRequest(name="swap"), timeout=30).versions) == ["2"]
    np.testing.assert_allclose(y_of(), v2, rtol=1e-4, atol=1e-3)

    e = rpc_error(stub.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name="nope"), timeout=60)
    assert e.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.details()
    e = rpc_error(stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name="nope"), timeout=60)
    assert e.code() == grpc.StatusCode.NOT_FOUND
    request = pb.RepositoryModelLoadRequest(model_name="swap")
    request.parameters["file:1/model.safetensors"].bytes_param = b"x"
    e = rpc_error(stub.RepositoryModelLoad, request, timeout=60)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "need the model's config" in e.details()


def test_oversize_messages_are_refused_and_the_server_goes_on(server):
    stub = server["stub"]
    rows = MAX_MESSAGE // (4 * SCALE_N) + 1
    big = infer_request("scale", "x", np.zeros((rows, SCALE_N), np.float32))
    assert big.ByteSize() > MAX_MESSAGE
    e = rpc_error(stub.ModelInfer, big, timeout=30)
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
    # Compressed, the same zeros are small on the wire and still past the limit once inflated;
    # a small request is served whether compressed or not.
    small = infer_request("scale", "x", np.ones((1, SCALE_N), np.float32))
    ref = np.ones((1, SCALE_N)) @ server["weights"]["scale"]["weight"].astype(np.float64)
    for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):
        e = rpc_error(stub.ModelInfer, big, timeout=30, compression=compression)
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
        assert f"inflates past the limit of {MAX_MESSAGE} bytes" in e.details(), e.details()
        y = outputs_of(stub.ModelInfer(small, timeout=30, compression=compression))["y"]
        np.testing.assert_allclose(y.ravel(), ref.ravel(), rtol=1e-4, atol=1e-3)
    # Uncompressed requests within the limit are served, and so is everything else.
    y = outputs_of(stub.ModelInfer(small, timeout=30))["y"]
    np.testing.assert_allclose(y.ravel(), ref.ravel(), rtol=1e-4, atol=1e-3)
    test_mlp_matches_rest_and_numpy(server)


class StalledGrpcClient:
    """A raw HTTP/2 client that sends ModelInfer calls and never lets the server
    send it a byte of data (its streams' window is 0): each call's answer is
    handed to gRPC, which cannot finish sending it, so gRPC keeps the call (no
    OnDone) for as long as the connection lives."""

    def __init__(self, port):
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        settings = (4).to_bytes(2, "big") + (0).to_bytes(4, "big")  # SETTINGS_INITIAL_WINDOW_SIZE = 0
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(4, 0, 0, settings))
        self.buffer = b""

    def infer(self, stream, request):
        headers = b"".join(hpack_literal(n, v) for n, v in (
            (":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
            (":authority", f"127.0.0.1:{self.port}"), ("content-type", "application/grpc"), ("te", "trailers")))
        message = request.SerializeToString()
        data = b"\x00" + len(message).to_bytes(4, "big") + message
        self.sock.sendall(h2_frame(1, 0x4, stream, headers) + h2_frame(0, 0x1, stream, data))

    def wait_for_headers(self, stream, deadline_s=30):
        """Reads frames (acknowledging the server's SETTINGS) until the server
        sends the response headers of `stream`: it has answered the call."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            while len(self.buffer) >= 9:
                length = int.from_bytes(self.buffer[:3], "big")
                if len(self.buffer) < 9 + length:
                    break
                kind, flags, sid = self.buffer[3], self.buffer[4], int.from_bytes(self.buffer[5:9], "big") & 0x7FFFFFFF
                self.buffer = self.buffer[9 + length:]
                if kind == 4 and not flags & 0x1:
                    self.sock.sendall(h2_frame(4, 0x1, 0))
                if kind == 1 and sid == stream:
                    return
                assert kind != 7, "the server sent GOAWAY"
            chunk = self.sock.recv(65536)
            assert chunk, "the server closed the connection"
            self.buffer += chunk
        raise AssertionError(f"no response headers on stream {stream} within {deadline_s} s")

    def close(self):
        self.sock.close()


def test_answered_calls_that_grpc_still_sends_do_not_count_towards_the_call_limit(server, tmp_path):
    # perf_analyzer at concurrency 64 was refused "1024 inference calls in progress": answered
    # calls stayed counted until gRPC's OnDone, which lags under load. Here one call's answer
    # cannot be sent at all; with --grpc-max-inflight-calls 1 the next call must still be served.
    state = start_serve(tmp_path, server["tmp"] / "repo", ["--grpc-port", "0", "--grpc-max-inflight-calls", "1"],
                        name="limit")
    port = grpc_port(state["log"].read_text())
    channel, stub = connect(port)
    stalled = StalledGrpcClient(port)
    try:
        x = np.ones((1, SCALE_N), np.float32)
        stalled.infer(1, infer_request("scale", "x", x, id="stalled"))
        stalled.wait_for_headers(1)
        y = outputs_of(stub.ModelInfer(infer_request("scale", "x", x), timeout=30))["y"]
        ref = x.astype(np.float64) @ server["weights"]["scale"]["weight"].astype(np.float64)
        np.testing.assert_allclose(y.ravel(), ref.ravel(), rtol=1e-4, atol=1e-3)
        # The limit still holds for calls that are not answered: a stream is one until it ends.
        stream_calls = queue.Queue()
        stream_calls.put(infer_request("scale", "x", x, id="s1"))
        open_stream = stub.ModelStreamInfer(iter(stream_calls.get, None), timeout=60)
        assert next(open_stream).infer_response.id == "s1"  # the stream is admitted and open
        e = rpc_error(stub.ModelInfer, infer_request("scale", "x", x), timeout=30)
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 inference calls in progress" in e.details()
        stream_calls.put(None)
        assert list(open_stream) == []
    finally:
        stalled.close()
        channel.close()
        code, text = stop_serve(state)
    assert code == 0, text[-2000:]


def test_grpc_port_off_in_use_and_sigterm_with_an_open_stream(server, tmp_path):
    # -1: no gRPC, and the log says so.
    off = start_serve(tmp_path, server["tmp"] / "repo", ["--grpc-port", "-1"], name="off")
    try:
        assert "gRPC is off" in off["log"].read_text()
        assert "KServe v2 gRPC on" not in off["log"].read_text()
    finally:
        assert stop_serve(off)[0] == 0
    # Out of range: refused before anything starts.
    bad = subprocess.run([CLI, "serve", "--model-repository", str(server["tmp"] / "repo"), "--http-port", "0",
                          "--grpc-port", "70000", "--device", "cpu"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--grpc-port must be -1 (no gRPC) or in [0, 65535]" in bad.stdout + bad.stderr
    # A port in use: start-up fails, naming it.
    taken = subprocess.run([CLI, "serve", "--model-repository", str(server["tmp"] / "repo"), "--http-port", "0",
                            "--grpc-port", str(server["grpc_port"]), "--device", "cpu"],
                           capture_output=True, text=True, timeout=120)
    assert taken.returncode != 0
    assert f"cannot listen for gRPC on 127.0.0.1:{server['grpc_port']}" in taken.stdout + taken.stderr
    # SIGTERM: an open stream gets its answers, then UNAVAILABLE; exit 0.
    state = start_serve(tmp_path, server["tmp"] / "repo", ["--grpc-port", "0"], name="sigterm")
    channel, stub = connect(grpc_port(state["log"].read_text()))
    try:
        pending = queue.Queue()
        pending.put(infer_request("scale", "x", np.ones((1, SCALE_N), np.float32), id="before"))
        stream = stub.ModelStreamInfer(iter(pending.get, None), timeout=60)
        assert next(stream).infer_response.id == "before"
        state["proc"].send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        pending.put(None)
        assert state["proc"].wait(timeout=60) == 0
    finally:
        channel.close()
        code, text = stop_serve(state)
    assert code == 0, text[-2000:]
    assert "shutting down" in text


def test_stubs_are_generated_from_this_repositorys_proto():
    # The stubs this test uses are the repository's protocol, not a copy.
    assert pathlib.Path(pb.__file__).parent == pathlib.Path(STUBS)
    names = {m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    assert {"ModelInfer", "ModelStreamInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex"} <= names
