"""Ensembles under `hearth serve`, from a Triton-style repository: Triton
Python models (preprocess, a classifier, stats, postprocess) with
config.pbtxt files, joined by an ensemble (platform "ensemble") whose steps
fan out (classifier and stats both take preprocess's FEATURES) and fan in
(postprocess joins them). Requests over REST and gRPC ask for all outputs
or a subset; a failing step fails its request with the step's model and
cause; ensembles whose steps disagree with their models are not served,
the rest is. Workers run /usr/bin/python3 on the CPU."""

import os
import sys

import numpy as np
import pytest
import requests

from serve_support import start_serve, stop_serve

W = np.array([[1, 0, 0], [0, 2, 0], [0, 0, 3], [1, 1, 1]], np.float32)

MODEL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

W = np.array([[1, 0, 0], [0, 2, 0], [0, 0, 3], [1, 1, 1]], np.float32)


def run(name, get):
    if name == "preprocess":
        return {"FEATURES": (get("RAW") * 2).astype(np.float32)}
    if name == "classifier":
        return {"LOGITS": (get("X") @ W).astype(np.float32)}
    if name == "stats":
        return {"TOTAL": get("X").sum(axis=1, keepdims=True).astype(np.float32)}
    logits, total = get("LOGITS"), get("TOTAL")
    if (total > 1000).any():
        raise ValueError("a total over 1000 is out of this model's range")
    return {"LABEL": logits.argmax(axis=1).reshape(-1, 1).astype(np.int64),
            "SCORE": (logits.max(axis=1, keepdims=True) + total).astype(np.float32)}


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            try:
                out = run(self.name, get)
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()]))
        return responses
"""


def python_model(name, inputs, outputs):
    ios = lambda ts: ",\n  ".join(f'{{ name: "{n}" data_type: {t} dims: [ {d} ] }}' for n, t, d in ts)
    return f"""name: "{name}"
backend: "python"
max_batch_size: 8
input [
  {ios(inputs)}
]
output [
  {ios(outputs)}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
dynamic_batching {{ max_queue_delay_microseconds: 100 }}
"""


PIPELINE = """name: "pipeline"
platform: "ensemble"
max_batch_size: 4
input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "LABEL" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "SCORE" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "FEATURES" data_type: TYPE_FP32 dims: [ 4 ] }
]
ensemble_scheduling {
  step [
    {
      model_name: "preprocess"
      model_version: -1
      input_map { key: "RAW" value: "RAW" }
      output_map { key: "FEATURES" value: "FEATURES" }
    },
    {
      model_name: "classifier"
      model_version: -1
      input_map { key: "X" value: "FEATURES" }
      output_map { key: "LOGITS" value: "logits" }
    },
    {
      model_name: "stats"
      model_version: -1
      input_map { key: "X" value: "FEATURES" }
      output_map { key: "TOTAL" value: "total" }
    },
    {
      model_name: "postprocess"
      model_version: -1
      input_map { key: "LOGITS" value: "logits" }
      input_map { key: "TOTAL" value: "total" }
      output_map { key: "LABEL" value: "LABEL" }
      output_map { key: "SCORE" value: "SCORE" }
    }
  ]
}
"""

# The classifier's logits as an ensemble output, which clients may ask for as
# classes: labelled by the classifier's label_filename.
CLASSES = """name: "classes"
platform: "ensemble"
max_batch_size: 4
input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 3 ] } ]
ensemble_scheduling {
  step [
    { model_name: "preprocess" model_version: -1
      input_map { key: "RAW" value: "RAW" } output_map { key: "FEATURES" value: "features" } },
    { model_name: "classifier" model_version: -1
      input_map { key: "X" value: "features" } output_map { key: "LOGITS" value: "SCORES" } }
  ]
}
"""
LABELS = ["cat", "dog", "bird"]

# Steps that disagree with their models: each fails alone.
BROKEN = {
    "unknown_step": PIPELINE.replace('"postprocess"', '"nowhere"'),
    "wrong_input": PIPELINE.replace('key: "X" value: "FEATURES" }\n      output_map { key: "LOGITS"',
                                    'key: "Y" value: "FEATURES" }\n      output_map { key: "LOGITS"'),
    "wrong_dtype": PIPELINE.replace('"LABEL" data_type: TYPE_INT64', '"LABEL" data_type: TYPE_INT32'),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ensembles")
    repo = tmp / "repo"
    models = {
        "preprocess": python_model("preprocess", [("RAW", "TYPE_FP32", 4)], [("FEATURES", "TYPE_FP32", 4)]),
        "classifier": python_model("classifier", [("X", "TYPE_FP32", 4)], [("LOGITS", "TYPE_FP32", 3)]),
        "stats": python_model("stats", [("X", "TYPE_FP32", 4)], [("TOTAL", "TYPE_FP32", 1)]),
        "postprocess": python_model("postprocess", [("LOGITS", "TYPE_FP32", 3), ("TOTAL", "TYPE_FP32", 1)],
                                    [("LABEL", "TYPE_INT64", 1), ("SCORE", "TYPE_FP32", 1)]),
    }
    models["classifier"] = models["classifier"].replace(
        'name: "LOGITS" data_type: TYPE_FP32 dims: [ 3 ] }',
        'name: "LOGITS" data_type: TYPE_FP32 dims: [ 3 ] label_filename: "labels.txt" }')
    assert "labels.txt" in models["classifier"]
    (repo / "classifier").mkdir(parents=True)
    (repo / "classifier" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    for name, config in models.items():
        (repo / name / "1").mkdir(parents=True, exist_ok=name == "classifier")
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(MODEL_PY)
    for name, config in {"pipeline": PIPELINE, "classes": CLASSES, **BROKEN}.items():
        (repo / name / "1").mkdir(parents=True)  # empty, as Triton wants it
        (repo / name / "config.pbtxt").write_text(config.replace('name: "pipeline"', f'name: "{name}"'))
    state = start_serve(tmp, repo, env={**os.environ, "HEARTH_PYTHON": sys.executable})
    yield state
    code, text = stop_serve(state)
    assert code == 0, text[-3000:]


def expected(raw):
    features = raw * 2
    logits = features @ W
    total = features.sum(axis=1, keepdims=True)
    return {"LABEL": logits.argmax(axis=1).reshape(-1, 1),
            "SCORE": logits.max(axis=1, keepdims=True) + total,
            "FEATURES": features}


def infer(url, raw, outputs=None, model="pipeline"):
    body = {"inputs": [{"name": "RAW", "datatype": "FP32", "shape": list(raw.shape),
                        "data": raw.ravel().tolist()}]}
    if outputs is not None:
        body["outputs"] = [{"name": o} for o in outputs]
    return requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)


def outputs(r):
    assert r.status_code == 200, r.text
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}


def statistics(url, model):
    r = requests.get(f"{url}/v2/models/{model}/stats", timeout=10)
    assert r.status_code == 200, r.text
    [stats] = r.json()["model_stats"]
    return stats["inference_stats"]


RAW = np.array([[1, 2, 3, 4], [4, 3, 2, 1], [0, 5, 0, 0]], np.float32)


def test_metadata_and_config_show_the_ensemble(served):
    url = served["url"]
    meta = requests.get(f"{url}/v2/models/pipeline", timeout=10).json()
    assert meta["platform"] == "ensemble"
    assert [t["name"] for t in meta["inputs"]] == ["RAW"]
    assert [t["name"] for t in meta["outputs"]] == ["LABEL", "SCORE", "FEATURES"]
    assert meta["inputs"][0]["shape"] == [-1, 4]
    config = requests.get(f"{url}/v2/models/pipeline/config", timeout=10).json()
    assert config["platform"] == "ensemble"
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["preprocess", "classifier", "stats", "postprocess"]
    assert steps[3]["input_map"] == {"LOGITS": "logits", "TOTAL": "total"}
    assert steps[0]["model_version"] == -1
    assert requests.get(f"{url}/v2/models/pipeline/ready", timeout=10).status_code == 200


def test_a_request_runs_the_steps_and_answers_every_output(served):
    got = outputs(infer(served["url"], RAW))
    want = expected(RAW)
    assert set(got) == {"LABEL", "SCORE", "FEATURES"}
    for name in want:
        np.testing.assert_allclose(got[name], want[name])


def test_only_the_requested_outputs_are_answered(served):
    url = served["url"]
    got = outputs(infer(url, RAW[:1], ["LABEL"]))
    assert list(got) == ["LABEL"]
    np.testing.assert_array_equal(got["LABEL"], expected(RAW[:1])["LABEL"])
    got = outputs(infer(url, RAW[1:], ["FEATURES", "SCORE"]))
    assert list(got) == ["FEATURES", "SCORE"]
    np.testing.assert_allclose(got["SCORE"], expected(RAW[1:])["SCORE"])
    r = infer(url, RAW[:1], ["logits"])  # a tensor between steps, not an output
    assert r.status_code == 400 and "logits" in r.text, r.text


def test_an_output_asked_for_as_classes_is_labelled_by_the_step_that_made_it(served):
    body = {"inputs": [{"name": "RAW", "datatype": "FP32", "shape": list(RAW.shape),
                        "data": RAW.ravel().tolist()}],
            "outputs": [{"name": "SCORES", "parameters": {"classification": 2}}]}
    r = requests.post(f"{served['url']}/v2/models/classes/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    [out] = r.json()["outputs"]
    assert out["datatype"] == "BYTES" and out["shape"] == [3, 2], out
    logits = (RAW * 2) @ W
    want = []
    for row in logits:
        top = sorted(range(3), key=lambda i: (-row[i], i))[:2]
        want += [(float(row[i]), i, LABELS[i]) for i in top]
    got = [e.split(":") for e in out["data"]]
    assert [(float(v), int(i), label) for v, i, label in got] == want, out["data"]


def test_a_failing_step_fails_the_request_naming_its_model_and_cause(served):
    url = served["url"]
    r = infer(url, np.array([[1000, 0, 0, 0]], np.float32))
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert "ensemble 'pipeline' step 3 (model 'postprocess')" in error, error
    assert "a total over 1000 is out of this model's range" in error, error
    # The ensemble goes on serving.
    np.testing.assert_array_equal(outputs(infer(url, RAW[:1], ["LABEL"]))["LABEL"],
                                  expected(RAW[:1])["LABEL"])


def test_a_request_that_does_not_fit_the_ensemble_is_refused(served):
    url = served["url"]
    r = infer(url, np.zeros((5, 4), np.float32))  # max_batch_size 4
    assert r.status_code == 400, r.text
    body = {"inputs": [{"name": "RAW", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    r = requests.post(f"{url}/v2/models/pipeline/infer", json=body, timeout=60)
    assert r.status_code == 400 and "RAW" in r.text, r.text


def test_statistics_count_the_ensemble_and_its_steps(served):
    url = served["url"]
    before = {m: statistics(url, m) for m in ("pipeline", "preprocess", "postprocess")}
    for _ in range(3):
        outputs(infer(url, RAW[:2]))
    assert infer(url, np.array([[2000, 0, 0, 0]], np.float32)).status_code == 500
    after = {m: statistics(url, m) for m in ("pipeline", "preprocess", "postprocess")}
    assert after["pipeline"]["success"]["count"] - before["pipeline"]["success"]["count"] == 3
    assert after["pipeline"]["fail"]["count"] - before["pipeline"]["fail"]["count"] == 1
    # Each step was a request to its model.
    assert after["preprocess"]["success"]["count"] - before["preprocess"]["success"]["count"] == 4
    assert after["postprocess"]["success"]["count"] - before["postprocess"]["success"]["count"] == 3
    assert after["postprocess"]["fail"]["count"] - before["postprocess"]["fail"]["count"] == 1


def test_ensembles_whose_steps_disagree_with_their_models_fail_alone(served):
    url = served["url"]
    index = {m["name"]: m for m in requests.post(f"{url}/v2/repository/index", json={}, timeout=10).json()}
    assert index["pipeline"]["state"] == "READY"
    reasons = {
        "unknown_step": "ensemble_scheduling.step[3].model_name: model 'nowhere': the repository has no "
                        "such model",
        "wrong_input": "ensemble_scheduling.step[1].input_map['Y']: model 'classifier' has no input 'Y'",
        "wrong_dtype": "ensemble_scheduling.step[3].output_map['LABEL']: model 'postprocess''s output "
                       "'LABEL' is TYPE_INT64 but the ensemble's output 'LABEL' is TYPE_INT32",
    }
    for name, reason in reasons.items():
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        assert reason in index[name]["reason"], index[name]
        r = infer(url, RAW[:1], model=name)
        assert r.status_code == 503 and reason in r.text, r.text


def test_ensembles_over_grpc(served):
    from grpc_support import connect, grpc_port, infer_request, outputs_of, rpc_error
    import grpc
    port = grpc_port(served["log"].read_text())
    channel, stub = connect(port)
    pb = __import__("grpc_service_pb2")
    try:
        meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="pipeline"), timeout=10)
        assert meta.platform == "ensemble"
        config = stub.ModelConfig(pb.ModelConfigRequest(name="pipeline"), timeout=10).config
        assert config.platform == "ensemble"
        assert [s.model_name for s in config.ensemble_scheduling.step] == [
            "preprocess", "classifier", "stats", "postprocess"]
        assert dict(config.ensemble_scheduling.step[3].output_map) == {"LABEL": "LABEL", "SCORE": "SCORE"}

        got = outputs_of(stub.ModelInfer(infer_request("pipeline", "RAW", RAW), timeout=60))
        want = expected(RAW)
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name])
        got = outputs_of(stub.ModelInfer(infer_request("pipeline", "RAW", RAW, outputs=["SCORE"]), timeout=60))
        assert list(got) == ["SCORE"]
        np.testing.assert_allclose(got["SCORE"], want["SCORE"])

        e = rpc_error(stub.ModelInfer, infer_request("pipeline", "RAW", np.array([[999, 999, 0, 0]], np.float32)),
                      timeout=60)
        assert e.code() == grpc.StatusCode.INTERNAL, e
        assert "step 3 (model 'postprocess')" in e.details() and "over 1000" in e.details(), e.details()
    finally:
        channel.close()


def test_loading_an_ensemble_loads_the_models_it_uses(served):
    # As Triton's explicit model control does: the models its steps name
    # that are not served are loaded with it.
    url = served["url"]
    r = requests.post(f"{url}/v2/repository/models/stats/unload", json={}, timeout=60)
    assert r.status_code == 200, r.text
    r = infer(url, RAW[:1])
    assert r.status_code == 503, r.text
    assert "ensemble 'pipeline' step 2 (model 'stats')" in r.text and "unloaded" in r.text, r.text
    r = requests.post(f"{url}/v2/repository/models/pipeline/load", json={}, timeout=120)
    assert r.status_code == 200, r.text
    index = {m["name"]: m for m in requests.post(f"{url}/v2/repository/index", json={}, timeout=10).json()}
    assert index["stats"]["state"] == "READY" and index["pipeline"]["state"] == "READY"
    np.testing.assert_allclose(outputs(infer(url, RAW))["SCORE"], expected(RAW)["SCORE"])
    # A model the repository lacks cannot be loaded for it.
    r = requests.post(f"{url}/v2/repository/models/unknown_step/load", json={}, timeout=60)
    assert r.status_code != 200 and "loading model 'nowhere' for the ensemble" in r.text, r.text
