"""triton_python_backend_utils as hearth provides it: tensors, the type
helpers, responses and errors, the config lookups, auto_complete_config's
check, and what hearth does not offer failing with its name. No server:
the serve tests (tests/serve/test_triton_python.py) run such models."""

import json
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))

import triton_python_backend_utils as pb_utils  # noqa: E402
from hearth import _triton  # noqa: E402


def test_type_names_and_numbers_map_both_ways():
    for name, t in [("TYPE_BOOL", np.bool_), ("TYPE_UINT8", np.uint8), ("TYPE_INT8", np.int8),
                    ("TYPE_INT16", np.int16), ("TYPE_INT32", np.int32), ("TYPE_INT64", np.int64),
                    ("TYPE_FP16", np.float16), ("TYPE_FP32", np.float32),
                    ("TYPE_FP64", np.float64), ("TYPE_STRING", np.object_)]:
        assert pb_utils.triton_string_to_numpy(name) is t, name
        number = pb_utils.numpy_to_triton_type(t)
        assert pb_utils.triton_to_numpy_type(number) is t, name
    # Triton's numbers (TRITONSERVER_DataType).
    assert pb_utils.numpy_to_triton_type(np.float32) == 11
    assert pb_utils.numpy_to_triton_type(np.int64) == 9
    assert pb_utils.numpy_to_triton_type(np.bytes_) == 13
    assert pb_utils.numpy_to_triton_type(np.complex64) is None
    assert pb_utils.triton_to_numpy_type(pb_utils.TYPE_BF16) is None
    with pytest.raises(pb_utils.TritonModelException, match="TYPE_NOPE"):
        pb_utils.triton_string_to_numpy("TYPE_NOPE")
    with pytest.raises(pb_utils.TritonModelException, match="TYPE_BF16 has no NumPy type"):
        pb_utils.triton_string_to_numpy("TYPE_BF16")


def test_a_tensor_holds_its_array_and_goes_through_dlpack():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = pb_utils.Tensor("x", x)
    assert t.name() == "x" and t.as_numpy() is x and t.is_cpu()
    assert t.shape() == [2, 3] and t.triton_dtype() == pb_utils.TYPE_FP32
    back = pb_utils.Tensor.from_dlpack("y", t.to_dlpack())  # a capsule
    assert back.name() == "y"
    np.testing.assert_array_equal(back.as_numpy(), x)
    np.testing.assert_array_equal(pb_utils.Tensor.from_dlpack("z", x).as_numpy(), x)
    s = pb_utils.Tensor("s", np.array(["a", "bc"]))  # str arrays become object arrays
    assert s.as_numpy().dtype == object
    with pytest.raises(pb_utils.TritonModelException, match="BYTES"):
        s.to_dlpack()
    with pytest.raises(pb_utils.TritonModelException, match="numpy.ndarray, not list"):
        pb_utils.Tensor("x", [1, 2])


def test_bytes_tensors_serialize_as_triton_does():
    raw = pb_utils.serialize_byte_tensor(np.array([b"ab", b"", "c"], dtype=object))
    assert bytes(raw) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00\x01\x00\x00\x00c"
    assert list(pb_utils.deserialize_bytes_tensor(raw)) == [b"ab", b"", b"c"]


def test_requests_responses_and_lookups():
    a, b = pb_utils.Tensor("A", np.zeros(2)), pb_utils.Tensor("B", np.ones(2))
    request = pb_utils.InferenceRequest(inputs=[a, b], requested_output_names=["C"],
                                        request_id="r1", parameters={"k": 1})
    assert pb_utils.get_input_tensor_by_name(request, "B") is b
    assert pb_utils.get_input_tensor_by_name(request, "Q") is None
    assert request.request_id() == "r1" and json.loads(request.parameters()) == {"k": 1}
    assert request.requested_output_names() == ["C"] and not request.is_cancelled()
    response = pb_utils.InferenceResponse(output_tensors=[a])
    assert pb_utils.get_output_tensor_by_name(response, "A") is a
    assert pb_utils.get_output_tensor_by_name(response, "B") is None
    assert not response.has_error() and response.error() is None
    failed = pb_utils.InferenceResponse(error=pb_utils.TritonError("no", pb_utils.TritonError.INVALID_ARG))
    assert failed.has_error() and failed.error().message() == "no" and failed.error().code() == 3
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL
    with pytest.raises(pb_utils.TritonModelException, match="not pb_utils.Tensor"):
        pb_utils.InferenceResponse(output_tensors=[np.zeros(1)])
    config = {"input": [{"name": "A", "data_type": "TYPE_FP32", "dims": [2]}],
              "output": [{"name": "C", "data_type": "TYPE_INT64", "dims": [1]}]}
    for given in (config, json.dumps(config)):
        assert pb_utils.get_input_config_by_name(given, "A")["dims"] == [2]
        assert pb_utils.get_output_config_by_name(given, "C")["data_type"] == "TYPE_INT64"
        assert pb_utils.get_output_config_by_name(given, "A") is None


def test_what_hearth_lacks_fails_naming_it():
    request = pb_utils.InferenceRequest(model_name="other", inputs=[],
                                        requested_output_names=["y"])
    with pytest.raises(pb_utils.TritonModelException, match="BLS"):
        request.exec()
    with pytest.raises(pb_utils.TritonModelException, match="BLS"):
        request.async_exec()
    with pytest.raises(pb_utils.TritonModelException, match="rescheduling"):
        request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    with pytest.raises(pb_utils.TritonModelException, match="response sender"):
        request.get_response_sender()


def test_the_logger_writes_to_the_workers_log(capsys):
    pb_utils.Logger.log_info("one")
    pb_utils.Logger.log_warn("two")
    pb_utils.Logger.log("three", pb_utils.Logger.LogLevel.ERROR)
    err = capsys.readouterr().err
    assert "INFO: one" in err and "WARNING: two" in err and "ERROR: three" in err


CONFIG = {"name": "m", "max_batch_size": 8,
          "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": [4]}],
          "output": [{"name": "C", "data_type": "TYPE_FP32", "dims": [4]}]}


def test_auto_complete_config_may_confirm_but_not_change():
    class Confirms:
        @staticmethod
        def auto_complete_config(config):
            config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [4]})
            config.set_max_batch_size(8)
            return config

    _triton._check_auto_complete(Confirms, CONFIG, "m/1/model.py")

    class Grows:
        @staticmethod
        def auto_complete_config(config):
            config.add_output({"name": "D", "data_type": "TYPE_INT32", "dims": [1]})
            config.set_max_batch_size(16)
            return config

    with pytest.raises(pb_utils.TritonModelException) as e:
        _triton._check_auto_complete(Grows, CONFIG, "m/1/model.py")
    assert "max_batch_size: 8 -> 16" in str(e.value) and "'D'" in str(e.value)

    class Conflicts:
        @staticmethod
        def auto_complete_config(config):
            config.add_input({"name": "A", "data_type": "TYPE_INT32", "dims": [4]})
            return config

    with pytest.raises(ValueError, match="input 'A' has data_type 'TYPE_FP32'"):
        _triton._check_auto_complete(Conflicts, CONFIG, "m/1/model.py")
