"""Triton's load with overrides under `hearth serve`: a repository load whose
parameters give the model's config as JSON ("config") and its files
("file:PATH", base64 over REST, bytes over gRPC), as tritonclient's
load_model(config=..., files=...) sends them. The model is served from
them until a load without overrides goes back to its directory; bad
overrides are refused by name and the served model goes on. Workers run
/usr/bin/python3 on the CPU."""

import base64
import json
import os
import sys

import pytest
import requests

from serve_support import start_serve, stop_serve, write_model

SCALED_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

FACTOR = {factor}


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "y", (pb_utils.get_input_tensor_by_name(r, "x").as_numpy() * FACTOR).astype(np.float32))])
            for r in requests]
"""

CONFIG = """backend: python
max_batch_size: 4
input:
  - {name: x, data_type: TYPE_FP32, dims: [2]}
output:
  - {name: y, data_type: TYPE_FP32, dims: [2]}
"""


# Triton's simple_*_model_control.py load a model with a partial config
# ({"max_batch_size": 16}): the model's auto_complete_config gives the rest.
COMPLETED_PY = SCALED_PY + """
    @staticmethod
    def auto_complete_config(config):
        have = {{io["name"] for io in config.as_dict().get("input", [])}}
        if "x" not in have:
            config.add_input({{"name": "x", "data_type": "TYPE_FP32", "dims": [2]}})
            config.add_output({{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}})
        return config
"""


def config_json(**changes):
    config = {"name": "scaled", "backend": "python", "max_batch_size": 4,
              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [2]}],
              "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}]}
    config.update(changes)
    return json.dumps(config)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overrides")
    repo = tmp / "repo"
    write_model(repo, "scaled", CONFIG, SCALED_PY.format(factor=1), weights=False)
    write_model(repo, "completed", CONFIG, COMPLETED_PY.format(factor=5), weights=False)
    state = start_serve(tmp, repo, env={**os.environ, "HEARTH_PYTHON": sys.executable})
    state["repo"] = repo
    yield state
    code, text = stop_serve(state)
    assert code == 0, text[-3000:]


def infer(url, model="scaled"):
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    r = requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["outputs"][0]["data"]


def load(url, parameters=None, model="scaled"):
    body = {} if parameters is None else {"parameters": parameters}
    return requests.post(f"{url}/v2/repository/models/{model}/load", json=body, timeout=120)


def test_files_and_config_override_the_directory_until_the_next_load(served):
    url = served["url"]
    assert infer(url) == [1, 2]
    code = SCALED_PY.format(factor=10).encode()
    r = load(url, {"config": config_json(), "file:1/model.py": base64.b64encode(code).decode()})
    assert r.status_code == 200, r.text
    assert infer(url) == [10, 20]
    # A load without overrides goes back to the model's directory.
    assert load(url).status_code == 200
    assert infer(url) == [1, 2]


def test_a_config_override_alone_keeps_the_directorys_files(served):
    url = served["url"]
    r = load(url, {"config": config_json(max_batch_size=2)})
    assert r.status_code == 200, r.text
    config = requests.get(f"{url}/v2/models/scaled/config", timeout=10).json()
    assert config["max_batch_size"] == 2
    assert infer(url) == [1, 2]
    assert load(url).status_code == 200
    assert requests.get(f"{url}/v2/models/scaled/config", timeout=10).json()["max_batch_size"] == 4


def test_bad_overrides_are_refused_and_the_model_goes_on(served):
    url = served["url"]
    code = base64.b64encode(b"x = 1\n").decode()
    cases = [
        ({"file:1/model.py": code}, "file overrides need the model's config too"),
        ({"config": config_json(), "file:../escape.py": code}, "'..'"),
        ({"config": config_json(), "file:1/model.py": "not base64!"}, "is not base64"),
        ({"config": config_json(optimization={})}, "optimization"),
        ({"config": "{"}, "the config override is not a model configuration"),
        ({"config": config_json(backend="Not-A-Name")}, "backend"),
        ({"config": 5}, "must be a string"),
        ({"unload_dependents": True}, "is not one a load takes"),
    ]
    for parameters, says in cases:
        r = load(url, parameters)
        assert r.status_code == 400, (parameters, r.text)
        assert says in r.json()["error"], (says, r.text)
        assert infer(url) == [1, 2]


def test_overrides_over_grpc(served):
    from grpc_support import connect, grpc_port, pb
    channel, stub = connect(grpc_port(served["log"].read_text()))
    try:
        request = pb.RepositoryModelLoadRequest(model_name="scaled")
        request.parameters["config"].string_param = config_json()
        request.parameters["file:1/model.py"].bytes_param = SCALED_PY.format(factor=3).encode()
        stub.RepositoryModelLoad(request, timeout=120)
        assert infer(served["url"]) == [3, 6]
        bad = pb.RepositoryModelLoadRequest(model_name="scaled")
        bad.parameters["file:1/model.py"].string_param = "x = 1"
        from grpc_support import grpc, rpc_error
        e = rpc_error(stub.RepositoryModelLoad, bad, timeout=60)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "must be a bytes_param" in e.details()
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="scaled"), timeout=120)
        assert infer(served["url"]) == [1, 2]
    finally:
        channel.close()


def test_a_partial_config_override_is_completed_by_the_model(served):
    # No backend (model.py says python), no input or output (the model's
    # auto_complete_config adds them), as Triton completes it.
    url = served["url"]
    r = load(url, {"config": json.dumps({"max_batch_size": "3"})}, model="completed")
    assert r.status_code == 200, r.text
    config = requests.get(f"{url}/v2/models/completed/config", timeout=10).json()
    assert config["max_batch_size"] == 3 and config["backend"] == "python"
    assert [(io["name"], io["data_type"], io["dims"]) for io in config["input"] + config["output"]] == [
        ("x", "TYPE_FP32", [2]), ("y", "TYPE_FP32", [2])]
    meta = requests.get(f"{url}/v2/models/completed", timeout=10).json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]
    assert infer(url, "completed") == [5, 10]
    # A model without the hook cannot be completed: refused, the model goes on.
    r = load(url, {"config": json.dumps({"max_batch_size": 2})})
    assert r.status_code != 200 and r.json()["error"].startswith("failed to load 'scaled': "), r.text
    assert "auto_complete_config" in r.json()["error"], r.text
    assert infer(url) == [1, 2]
    assert load(url, model="completed").status_code == 200
    assert requests.get(f"{url}/v2/models/completed/config", timeout=10).json()["max_batch_size"] == 4


def test_load_failures_are_worded_as_tritons_without_the_servers_paths(served):
    url, repo, run_dir = served["url"], str(served["repo"]), str(served["run_dir"])
    r = load(url, {"config": '"parameters": {"config": {{"max_batch_size": "16"}}}'})
    assert r.status_code == 400 and r.json()["error"].startswith("failed to load 'scaled': "), r.text
    r = load(url, model="wrong_model_name")
    assert r.status_code == 404, r.text
    assert r.json()["error"] == "failed to load 'wrong_model_name': no model directory " \
        "'wrong_model_name' in the repository", r.text
    # The override's errors name the override, not the model's config file.
    for config, says in ((config_json(optimization={}), "the config override is not a model "
                                                         "configuration hearth reads: optimization"),
                         (config_json(backend="Not-A-Name"), "the load's config override: backend: "),
                         (config_json(max_batch_size=5000), "the load's config override: max_batch_size: "),
                         (config_json(version_policy={"all": {}}), "the load's config override: "
                                                                   "version_policy.all: ")):
        r = load(url, {"config": config})
        error = r.json()["error"]
        assert r.status_code == 400 and error.startswith("failed to load 'scaled': "), r.text
        assert says in error and "config.pbtxt" not in error and "config.yaml" not in error, r.text
    # A file override's path component over NAME_MAX, refused before anything
    # is written, with Triton's status (500) and words.
    r = load(url, {"config": "{}", "file:" + "A" * 256: base64.b64encode(b"a").decode()})
    error = r.json()["error"]
    assert r.status_code == 500 and "failed to poll from model repository" in error, r.text
    assert "over NAME_MAX" in error, r.text
    assert requests.get(f"{url}/v2/health/live").status_code == 200
    # The config is checked before any file is written.
    r = load(url, {"config": config_json(optimization={}), "file:1/model.py": base64.b64encode(b"x").decode()})
    assert r.status_code == 400 and "the config override is not a model configuration hearth reads: " \
        "optimization" in r.json()["error"], r.text
    # A model.py that fails: its path is said inside the model's directory.
    r = load(url, {"config": config_json(), "file:1/model.py": base64.b64encode(b"raise ValueError('no')\n").decode()})
    assert r.status_code != 200, r.text
    error = r.json()["error"]
    assert error.startswith("failed to load 'scaled': ") and "ValueError" in error, r.text
    for path in (repo, run_dir):
        assert path not in error, (path, error)
    assert infer(url) == [1, 2]
    assert requests.get(f"{url}/v2/health/live", timeout=10).status_code == 200


def test_name_max_over_grpc_is_internal_in_tritons_words(served):
    from grpc_support import connect, grpc, grpc_port, pb, rpc_error
    channel, stub = connect(grpc_port(served["log"].read_text()))
    try:
        request = pb.RepositoryModelLoadRequest(model_name="scaled")
        request.parameters["config"].string_param = "{}"
        request.parameters["file:" + "A" * 256].bytes_param = b"a"
        e = rpc_error(stub.RepositoryModelLoad, request, timeout=60)
        # Triton's status and words, which its clients check.
        assert e.code() == grpc.StatusCode.INTERNAL, e.details()
        assert e.details().startswith("failed to load 'scaled': failed to poll from model "
                                      "repository: file override 'AAAA"), e.details()
        assert str(served["run_dir"]) not in e.details()
        assert infer(served["url"]) == [1, 2]
    finally:
        channel.close()
