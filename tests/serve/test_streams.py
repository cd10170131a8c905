"""Many streams in one worker, and streams that outlive their worker, under `hearth serve`.

The tiny decoder (examples/generate/tiny_decoder) with float64 weights, so
that a stream decoded in a batch of 16 picks exactly what it picks alone
(float32's reduction orders could tip a near-tie; see its make_repository):

- 16 streams on one worker of max_streams 16 are held by it at once (it is
  stopped, SIGSTOP, until the server says all 16 are open on it, so that
  this holds on any machine), each equal to its prompt served alone. (That
  the model's step then gives every stream its first token before any ends
  is tested on the model itself, in tests/python/test_generate_models.py:
  the order in which 16 client threads read their streams says nothing
  sure about the order the server sent them in.)
- a stream cancelled among others (its client gone) frees its place, and
  the others stay equal;
- SIGKILL of the worker while 16 greedy and 16 seeded streams are in
  flight: all 32 complete, each equal to its uninterrupted run (no token
  twice, none missing), and /metrics counts them resumed. The worker kills
  itself (model "doomed": the tiny decoder whose step sends SIGKILL to its
  own process once, when 16 of its streams have 5 tokens), so that the kill
  lands mid-stream on any machine however fast the worker or slow the
  clients.
"""

import concurrent.futures
import json
import os
import re
import signal
import threading

import pytest
import requests

from serve_support import events as sse_events
from serve_support import metric, python_workers, start_serve, stop_serve, wait_for

torch = pytest.importorskip("torch", reason="the tiny decoder is written in torch")

import importlib.util  # noqa: E402
import pathlib  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "tiny_decoder_make_repository_streams",
    ROOT / "examples" / "generate" / "tiny_decoder" / "make_repository.py")
tiny_repository = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny_repository)


# The tiny decoder (tiny.py beside it) whose worker sends itself SIGKILL once
# (the flag file is there, and its unlink is the once), at the end of the
# first step that leaves 16 streams with 5 tokens or more: their clients have
# had tokens, and their streams are not over.
DOOMED = """import importlib.util
import os
import pathlib
import signal
import sys

_spec = importlib.util.spec_from_file_location(
    "hearth_doomed_tiny", pathlib.Path(__file__).with_name("tiny.py"))
tiny = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tiny
_spec.loader.exec_module(tiny)


class Model(tiny.Model):
    def step(self):
        super().step()
        if sum(s.count >= 5 for s in self.streams) >= 16:
            try:
                os.unlink({flag!r})
            except FileNotFoundError:
                return
            os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("streams")
    root = tmp / "repo"
    tiny_repository.write(root, "many", workers=1, max_streams=32, dtype="float64")
    tiny_repository.write(root, "pair", workers=1, max_streams=2, dtype="float64")
    doomed = tiny_repository.write(root, "doomed", workers=1, max_streams=32, dtype="float64")
    (doomed / "model.py").rename(doomed / "tiny.py")
    (doomed / "model.py").write_text(DOOMED.format(flag=str(tmp / "kill-once")))
    state = start_serve(tmp, root)
    state["kill_flag"] = tmp / "kill-once"
    for model in ("many", "pair", "doomed"):
        wait_for(lambda m=model: requests.get(f"{state['url']}/v2/models/{m}/ready").status_code
                 == 200, f"{model} ready", timeout=120)
    yield state
    code, text = stop_serve(state)
    assert code == 0, text[-3000:]


def events(response):
    """The stream's events, decoded."""
    return (json.loads(e) for e in sse_events(response))


def token_ids(event):
    ids = event.get("token_ids", [])
    return ids if isinstance(ids, list) else [ids]


def alone(served, model, prompt, **parameters):
    """The prompt served alone (joined): (text, token ids)."""
    r = requests.post(f"{served['url']}/v2/models/{model}/generate",
                      json={"text_input": prompt, "parameters": parameters}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body.get("token_ids", [])
    return body["text_output"], ids if isinstance(ids, list) else [ids]


def open_stream(served, model, prompt, **parameters):
    r = requests.post(f"{served['url']}/v2/models/{model}/generate_stream",
                      json={"text_input": prompt, "parameters": parameters}, stream=True,
                      timeout=120)
    assert r.status_code == 200, r.text
    return r


def streams_held(served, model):
    r = requests.get(f"{served['url']}/v2/hearth/workers", timeout=10)
    r.raise_for_status()
    for m in r.json()["models"]:
        if m["name"] == model:
            return sum(w["streams"] for p in m["placements"] for w in p["workers"])
    return 0


PROMPTS = [f"stream {i}: " + "abcdefghij"[: i % 10] for i in range(32)]


def test_sixteen_streams_on_one_worker_are_decoded_together(served):
    expected = [alone(served, "many", p, max_tokens=24) for p in PROMPTS[:16]]
    [pid] = python_workers(served["proc"].pid, "many")
    order, lock = [], threading.Lock()

    def run(i):
        # The response's head comes with its first event.
        response = open_stream(served, "many", PROMPTS[i], max_tokens=24)
        text, ids = "", []
        for e in events(response):
            assert "error" not in e, e
            with lock:
                if not text and not ids:
                    order.append(("first", i))
            text += e.get("text_output", "")
            ids += token_ids(e)
        with lock:
            order.append(("end", i))
        return text, ids

    os.kill(pid, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        try:
            futures = [pool.submit(run, i) for i in range(16)]
            # All 16 are open on the stopped worker before it decodes a step.
            wait_for(lambda: streams_held(served, "many") == 16, "16 streams open", timeout=30)
        finally:
            os.kill(pid, signal.SIGCONT)
        got = [f.result(timeout=120) for f in futures]
    assert got == expected
    assert sorted(i for k, i in order if k == "first") == list(range(16))


def test_a_cancelled_stream_frees_its_place_and_the_others_stay_equal(served):
    keep_prompt, other_prompt = "keep going: ", "after the cancel: "
    expected_keep = alone(served, "pair", keep_prompt, max_tokens=200)
    expected_other = alone(served, "pair", other_prompt, max_tokens=8)
    [pid] = python_workers(served["proc"].pid, "pair")

    def read(prompt, max_tokens, leave=False):
        response = open_stream(served, "pair", prompt, max_tokens=max_tokens)
        if leave:
            response.close()  # its client goes away after the first event
            return None
        text, ids = "", []
        for e in events(response):
            assert "error" not in e, e
            text += e.get("text_output", "")
            ids += token_ids(e)
        return text, ids

    os.kill(pid, signal.SIGSTOP)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        keep = pool.submit(read, keep_prompt, 200)
        gone = pool.submit(read, "cancelled: ", 400, True)
        wait_for(lambda: streams_held(served, "pair") == 2, "2 streams open", timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    gone.result(timeout=60)
    # Its place is free again while the other still streams (capacity 2).
    wait_for(lambda: streams_held(served, "pair") <= 1, "the cancelled stream's place freed",
             timeout=60)
    assert alone(served, "pair", other_prompt, max_tokens=8) == expected_other
    assert keep.result(timeout=120) == expected_keep
    pool.shutdown()


def test_streams_go_on_after_their_worker_is_killed(served):
    greedy = [dict(max_tokens=60) for _ in range(16)]
    seeded = [dict(max_tokens=60, temperature=0.8, seed=1000 + i) for i in range(16)]
    parameters = greedy + seeded
    expected = [alone(served, "doomed", p, **k) for p, k in zip(PROMPTS, parameters)]
    # At least 16 of them outlast 5 tokens, so the worker's kill below will come.
    assert sum(len(ids) > 5 for _, ids in expected) >= 16
    resumed_before = metric(served["url"], "hearth_streams_resumed_total", "doomed")
    [pid] = python_workers(served["proc"].pid, "doomed")

    def run(i):
        response = open_stream(served, "doomed", PROMPTS[i], **parameters[i])
        text, ids = "", []
        for e in events(response):
            assert "error" not in e, e
            text += e.get("text_output", "")
            ids += token_ids(e)
        return text, ids

    served["kill_flag"].write_text("")
    os.kill(pid, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        try:
            futures = [pool.submit(run, i) for i in range(32)]
            # All 32 are open on the stopped worker before it decodes a step.
            wait_for(lambda: streams_held(served, "doomed") == 32, "32 streams open", timeout=30)
        finally:
            os.kill(pid, signal.SIGCONT)
        got = [f.result(timeout=300) for f in futures]
    assert not served["kill_flag"].exists(), "the worker never killed itself"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"stream {i} ({parameters[i]}): {g!r} != {e!r}"
    assert python_workers(served["proc"].pid, "doomed") != [pid]
    # Those still streaming when the worker died went on elsewhere.
    assert metric(served["url"], "hearth_streams_resumed_total", "doomed") > resumed_before


# ---- a C++ engine (backends/engine.h): the built-in "count" ---------------------


COUNT_CONFIG = """backend: count
max_batch_size: 0
model_transaction_policy: {decoupled: true}
input:
  - {name: n, data_type: TYPE_INT64, dims: [1]}
output:
  - {name: token_ids, data_type: TYPE_INT64, dims: [-1]}
instance_group:
  - {count: 1, kind: KIND_CPU}
parameters:
  max_streams: "8"
  resumable: "true"
"""


# On the CPU, the engine is hearth-worker's own; for a KIND_GPU model the
# worker gets it from libhearth_backends_cuda.so's hearth_create_engine.
@pytest.fixture(scope="module", params=["KIND_CPU", "KIND_GPU"])
def counted(request, tmp_path_factory):
    from serve_support import ON_GPU, write_model
    kind = request.param
    if kind == "KIND_GPU" and not ON_GPU:
        pytest.skip("the KIND_GPU count model runs the CUDA library's count engine: it needs a "
                    "GPU and HEARTH_TEST_DEVICE=cuda")
    tmp = tmp_path_factory.mktemp("count")
    write_model(tmp / "repo", "count", COUNT_CONFIG.replace("KIND_CPU", kind))
    state = start_serve(tmp, tmp / "repo")
    wait_for(lambda: requests.get(f"{state['url']}/v2/models/count/ready").status_code == 200,
             "count ready", timeout=60)
    # The worker says where it runs the model.
    device = "cuda:" if kind == "KIND_GPU" else "cpu"
    assert re.search(rf"count worker 0 ready: pid \d+ on {device}", state["log"].read_text()), \
        state["log"].read_text()[-3000:]
    yield state
    code, text = stop_serve(state)
    assert code == 0, text[-3000:]


def count(served, n, start):
    """A count answered once: the numbers joined (token_ids, piece after piece)."""
    body = {"inputs": [{"name": "n", "datatype": "INT64", "shape": [1], "data": [n]}],
            "parameters": {"start": start}}
    r = requests.post(f"{served['url']}/v2/models/count/infer", json=body, timeout=300)
    assert r.status_code == 200, r.text[:300]
    [out] = [o for o in r.json()["outputs"] if o["name"] == "token_ids"]
    return out["data"]


def test_a_cpp_engine_holds_many_streams_and_they_outlive_its_worker(counted):
    from serve_support import model_workers
    # Long enough (a response a number) that none ends before the kill below.
    asked = [(100_000 * i, 200_000) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(count, counted, n, s) for s, n in asked]
        wait_for(lambda: streams_held(counted, "count") == 8,
                 lambda: f"8 streams open (held: {streams_held(counted, 'count')}, done: "
                 f"{[repr(f.exception())[:200] for f in futures if f.done()]})", timeout=60)
        [pid] = model_workers(counted["proc"].pid, "count")
        os.kill(pid, signal.SIGKILL)
        got = [f.result(timeout=300) for f in futures]
    # Each counted on from where it was, on the replacement: none twice, none missing.
    for (s, n), g in zip(asked, got):
        assert g == list(range(s, s + n))
    assert metric(counted["url"], "hearth_streams_resumed_total", "count") > 0
    # Each stream's first response timed once (a resumed one not again).
    assert metric(counted["url"], "hearth_stream_first_response_seconds_count", "count") == 8
    # Triton's statistics extension, with hearth's own stream counts beside its fields.
    r = requests.get(f"{counted['url']}/v2/models/count/stats", timeout=10)
    [stats] = r.json()["model_stats"]
    streams = stats["hearth_streams"]
    assert streams["resumed"] > 0 and streams["opened"] >= 8 + streams["resumed"]
    assert streams["tokens"] == sum(n for _, n in asked) and len(streams["in_flight"]) == 1
