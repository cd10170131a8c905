"""A model repository in Triton's form: `hearth serve` serves a python model
whose config is a config.pbtxt (Triton's add_sub example, its model.py
written for hearth's backend), says what its config holds, and fails alone a
model whose config.pbtxt sets a field hearth does not implement and one whose
directory holds both config.yaml and config.pbtxt.
"""

import os
import sys

import numpy as np
import pytest
import requests

from serve_support import infer_json, start_serve, stop_serve, write_model

if os.environ.get("HEARTH_PROTOBUF_BUILT", "ON").upper() in ("OFF", "FALSE", "0"):
    pytest.skip("this hearth was built without protobuf: config.pbtxt is refused",
                allow_module_level=True)

ADD_SUB_PBTXT = f"""name: "add_sub"
backend: "python"
max_batch_size: 4

input [
  {{
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }}
]
input [
  {{
    name: "INPUT1"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }}
]
output [
  {{
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }}
]
output [
  {{
    name: "OUTPUT1"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }}
]

instance_group [{{ count: 1 kind: KIND_CPU }}]
parameters {{ key: "python" value: {{ string_value: "{sys.executable}" }} }}
"""

ADD_SUB_PY = """
import numpy as np

class Model:
    def initialize(self, args):
        pass

    def execute(self, inputs):
        a = np.asarray(inputs["INPUT0"])
        b = np.asarray(inputs["INPUT1"])
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("config_pbtxt")
    root = tmp / "repo"
    # write_model writes a config.yaml: each config.pbtxt takes its place.
    write_model(root, "add_sub", "", ADD_SUB_PY)
    (root / "add_sub" / "config.yaml").unlink()
    (root / "add_sub" / "config.pbtxt").write_text(ADD_SUB_PBTXT)
    write_model(root, "warmup", "", ADD_SUB_PY)
    (root / "warmup" / "config.yaml").unlink()
    (root / "warmup" / "config.pbtxt").write_text(
        ADD_SUB_PBTXT.replace('"add_sub"', '"warmup"') +
        "model_warmup [ { name: \"w\" batch_size: 1 } ]\n")
    write_model(root, "both", "backend: python\n", ADD_SUB_PY)
    (root / "both" / "config.pbtxt").write_text(ADD_SUB_PBTXT.replace('"add_sub"', '"both"'))
    state = start_serve(tmp, root)
    yield state
    code, text = stop_serve(state)
    assert code == 0, text[-3000:]


def test_a_python_model_with_a_config_pbtxt_answers(served):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 4)).astype(np.float32)
    b = rng.standard_normal((2, 4)).astype(np.float32)
    r = infer_json(served["url"], "add_sub", [
        {"name": "INPUT0", "datatype": "FP32", "shape": [2, 4], "data": a.ravel().tolist()},
        {"name": "INPUT1", "datatype": "FP32", "shape": [2, 4], "data": b.ravel().tolist()}])
    assert r.status_code == 200, r.text
    outputs = {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"])
               for o in r.json()["outputs"]}
    np.testing.assert_allclose(outputs["OUTPUT0"], a + b, rtol=1e-6)
    np.testing.assert_allclose(outputs["OUTPUT1"], a - b, rtol=1e-6)


def test_the_model_config_says_what_config_pbtxt_says(served):
    r = requests.get(served["url"] + "/v2/models/add_sub/config", timeout=30)
    assert r.status_code == 200, r.text
    config = r.json()
    assert config["name"] == "add_sub" and config["backend"] == "python"
    assert config["max_batch_size"] == 4
    assert [(i["name"], i["data_type"], [int(d) for d in i["dims"]]) for i in config["input"]] == \
        [("INPUT0", "TYPE_FP32", [4]), ("INPUT1", "TYPE_FP32", [4])]
    assert [o["name"] for o in config["output"]] == ["OUTPUT0", "OUTPUT1"]


def test_models_whose_config_pbtxt_is_refused_fail_alone(served):
    r = requests.post(served["url"] + "/v2/repository/index", timeout=30)
    assert r.status_code == 200, r.text
    index = {m["name"]: m for m in r.json()}
    assert index["add_sub"]["state"] == "READY"
    assert index["warmup"]["state"] == "UNAVAILABLE"
    assert "config.pbtxt:36:1: model_warmup: hearth does not implement" in \
        index["warmup"]["reason"], index["warmup"]["reason"]
    assert index["both"]["state"] == "UNAVAILABLE"
    assert "config.yaml and" in index["both"]["reason"] and "not both" in index["both"]["reason"]
