"""What Triton's image clients (image_client.py, grpc_image_client.py) read of
a model and ask of it, under `hearth serve`: an input's `format`
(FORMAT_NCHW, FORMAT_NHWC) and an output's `label_filename` in config.pbtxt
and config.yaml, both reported in the model's config over REST and gRPC, and
Triton's classification answering "value:index:label" from the labels file
in the model's directory. A labels file that is missing, too large or named
with a path fails its model alone, saying why. Workers run /usr/bin/python3
(or this interpreter) on the CPU."""

import os
import sys

import numpy as np
import pytest
import requests

from serve_support import infer_json, start_serve, stop_serve, write_model

if os.environ.get("HEARTH_PROTOBUF_BUILT", "ON").upper() in ("OFF", "FALSE", "0"):
    pytest.skip("this hearth was built without protobuf: config.pbtxt is refused",
                allow_module_level=True)

# scores = the first 5 values of each image (C=1, H=1, W=5 in NCHW).
CLASSIFY_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "data").as_numpy()
            out.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("scores", x.reshape(x.shape[0], -1)[:, :5].astype(np.float32))]))
        return out
"""

CLASSIFY_PBTXT = """name: "{name}"
backend: "python"
max_batch_size: 2
input [ {{ name: "data" data_type: TYPE_FP32 format: {format} dims: [ 1, 1, 5 ] }} ]
output [ {{ name: "scores" data_type: TYPE_FP32 dims: [ 5 ] label_filename: "{labels}" }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

CLASSIFY_YAML = """backend: python
max_batch_size: 2
input:
  - {name: data, data_type: TYPE_FP32, format: FORMAT_NHWC, dims: [1, 1, 5]}
output:
  - {name: scores, data_type: TYPE_FP32, dims: [5], label_filename: labels.txt}
instance_group: [{count: 1, kind: KIND_CPU}]
"""

# Index 3 has no label (an empty line), index 4 has no line at all.
LABELS = "cat\r\ndog\nbird\n\n"


def pbtxt_model(root, name, format="FORMAT_NCHW", labels="labels.txt", labels_text=LABELS):
    write_model(root, name, "", CLASSIFY_PY, weights=False)
    (root / name / "config.yaml").unlink()
    (root / name / "config.pbtxt").write_text(CLASSIFY_PBTXT.format(name=name, format=format,
                                                                    labels=labels))
    if labels_text is not None:
        (root / name / "labels.txt").write_text(labels_text)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("image_config")
    root = tmp / "repo"
    pbtxt_model(root, "classify")
    write_model(root, "classify_yaml", CLASSIFY_YAML, CLASSIFY_PY, weights=False)
    (root / "classify_yaml" / "labels.txt").write_text(LABELS)
    pbtxt_model(root, "no_labels_file", labels_text=None)
    pbtxt_model(root, "labels_path", labels="../labels.txt")
    pbtxt_model(root, "labels_too_large", labels_text="x" * (4 * 1024 * 1024 + 1))
    pbtxt_model(root, "bad_format", format="FORMAT_NCDHW")
    state = start_serve(tmp, root, env={**os.environ, "HEARTH_PYTHON": sys.executable})
    yield state
    code, text = stop_serve(state)
    assert code == 0, text[-3000:]


X = [[0.5, 3.0, 2.0, 1.0, 4.0], [1.0, 0.0, 0.0, 0.0, 0.0]]


def classify_rest(url, model, k):
    r = infer_json(url, model, [{"name": "data", "datatype": "FP32", "shape": [2, 1, 1, 5],
                                 "data": np.array(X, np.float32).ravel().tolist()}],
                   outputs=[{"name": "scores", "parameters": {"classification": k}}])
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["datatype"] == "BYTES" and out["shape"] == [2, k]
    return out["data"]


def test_the_config_reports_format_and_label_filename(served):
    for model, layout in (("classify", "FORMAT_NCHW"), ("classify_yaml", "FORMAT_NHWC")):
        config = requests.get(f"{served['url']}/v2/models/{model}/config", timeout=30).json()
        assert config["input"][0]["format"] == layout, config
        assert config["output"][0]["label_filename"] == "labels.txt", config


def test_classification_answers_value_index_and_label(served):
    for model in ("classify", "classify_yaml"):
        assert classify_rest(served["url"], model, 3) == [
            "4.000000:4", "3.000000:1:dog", "2.000000:2:bird",
            "1.000000:0:cat", "0.000000:1:dog", "0.000000:2:bird"]
    # Index 3's line is empty: no label.
    assert classify_rest(served["url"], "classify", 5)[3] == "1.000000:3"


def test_grpc_reports_the_fields_and_classifies_with_labels(served):
    from grpc_support import connect, grpc_port, infer_request, mc, pb
    channel, stub = connect(grpc_port(served["log"].read_text()))
    try:
        config = stub.ModelConfig(pb.ModelConfigRequest(name="classify"), timeout=30).config
        assert config.input[0].format == mc.ModelInput.FORMAT_NCHW
        assert config.output[0].label_filename == "labels.txt"
        request = infer_request("classify", "data", np.array(X, np.float32).reshape(2, 1, 1, 5),
                                outputs=["scores"])
        request.outputs[0].parameters["classification"].int64_param = 2
        response = stub.ModelInfer(request, timeout=60)
        assert response.outputs[0].datatype == "BYTES" and list(response.outputs[0].shape) == [2, 2]
        raw, got = response.raw_output_contents[0], []
        while raw:
            n = int.from_bytes(raw[:4], "little")
            got.append(raw[4:4 + n].decode())
            raw = raw[4 + n:]
        assert got == ["4.000000:4", "3.000000:1:dog", "1.000000:0:cat", "0.000000:1:dog"]
    finally:
        channel.close()


def test_bad_labels_and_formats_fail_their_model_alone(served):
    index = {m["name"]: m for m in requests.post(served["url"] + "/v2/repository/index",
                                                  timeout=30).json()}
    assert index["classify"]["state"] == "READY"
    says = {
        "no_labels_file": "output 'scores': label_filename: ",
        "labels_path": "output[0].label_filename: '../labels.txt' is not the name of a file in the "
                       "model's directory",
        "labels_too_large": "bytes, over the limit of 4194304 bytes for a labels file",
        "bad_format": "FORMAT_NCDHW",
    }
    for model, text in says.items():
        assert index[model]["state"] == "UNAVAILABLE", index[model]
        assert text in index[model]["reason"], (model, index[model]["reason"])
    assert "No such file" in index["no_labels_file"]["reason"], index["no_labels_file"]["reason"]
