"""Tests of the Python worker's start: the CUDA context an exec'd worker makes
through libcuda on a thread while it imports (hearth.backend_worker's
_EarlyContext). libcuda is replaced by a fake that records its calls, so the
calls, their order and the handling of a failure are checked without a GPU;
tests/serve's GPU runs start real workers with it."""

import ctypes
import pathlib
import sys
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))

from hearth import backend_worker  # noqa: E402


class FakeCuda:
    """libcuda.so.1's three calls: each records (name, thread) and returns
    `fail.get(name, 0)` as its CUresult; cuDeviceGet records the ordinal."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail or {}

    def _call(self, name, *args):
        self.calls.append((name, threading.current_thread().name, args))
        return self.fail.get(name, 0)

    def cuInit(self, flags):  # noqa: N802  libcuda's names
        return self._call("cuInit", flags)

    def cuDeviceGet(self, dev, ordinal):  # noqa: N802
        return self._call("cuDeviceGet", ordinal)

    def cuDevicePrimaryCtxRetain(self, ctx, dev):  # noqa: N802
        return self._call("cuDevicePrimaryCtxRetain")


@pytest.fixture
def fake_cuda(monkeypatch):
    made = {}

    def cdll(name):
        assert name == "libcuda.so.1"
        return made.setdefault("lib", FakeCuda(made.get("fail")))

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    return made


@pytest.mark.parametrize("device, ordinal", [("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), ("cpu", None),
                                             ("cuda:x", None), ("cuda:-1", None), ("", None)])
def test_only_a_cuda_device_gets_an_early_context(device, ordinal, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert backend_worker._EarlyContext.ordinal(device) == ordinal
    monkeypatch.setattr(sys, "platform", "win32")
    assert backend_worker._EarlyContext.ordinal(device) is None


def test_the_context_is_made_on_its_own_thread_for_the_devices_ordinal(fake_cuda, capsys):
    early = backend_worker._EarlyContext(3)
    early.join()
    lib = fake_cuda["lib"]
    assert [name for name, _, _ in lib.calls] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    assert {thread for _, thread, _ in lib.calls} == {"hearth-context"}
    assert lib.calls[1][2] == (3,)
    assert early.error is None
    assert capsys.readouterr().err == ""


def test_a_failed_call_is_logged_and_stops_there(fake_cuda, capsys):
    fake_cuda["fail"] = {"cuDeviceGet": 101}  # CUDA_ERROR_INVALID_DEVICE
    early = backend_worker._EarlyContext(7)
    early.join()
    assert [name for name, _, _ in fake_cuda["lib"].calls] == ["cuInit", "cuDeviceGet"]
    assert early.error == "cuDeviceGet: CUresult 101"
    err = capsys.readouterr().err
    assert "the CUDA context made beside the imports: cuDeviceGet: CUresult 101" in err, err
    assert "torch makes it instead" in err, err


def test_no_driver_is_logged(monkeypatch, capsys):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    early = backend_worker._EarlyContext(0)
    early.join()
    assert "libcuda.so.1: cannot open shared object file" in early.error
    assert "libcuda.so.1: cannot open shared object file" in capsys.readouterr().err
