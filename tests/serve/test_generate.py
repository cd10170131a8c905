"""Text generation under `hearth serve`, over real HTTP: decoupled backend: python models.

- examples/generate/tiny_decoder: streams (generate_stream, OpenAI stream:
  true) arrive in order and equal the module run directly, token for token;
  a request that is not streamed gets the pieces joined; the generate
  extension and the OpenAI endpoints field by field (usage counts,
  finish_reason, [DONE]); a model lacking `messages` gets a 400 naming it on
  chat.
- A paced test model (PACED_PY below: numbered pieces, one every few ms):
  a client that disconnects mid-stream frees the worker (the next request on
  the 1-worker model is answered, and the generator was closed: its
  GeneratorExit wrote a marker); SIGKILL of a worker mid-stream ends that
  stream with an error event within 1 s, with no piece repeated, while
  another model's stream goes on, and the replacement serves the next
  request; an exception mid-stream ends the stream with its last line.
- examples/generate/llama (torch >= 2 and transformers in this interpreter,
  the GPU machine: HEARTH_TEST_DEVICE=cuda): 2 workers on one copy of a
  random-weight checkpoint (float32), each decoding several streams
  together, each stream token for token what transformers' generate picks
  for its prompt alone.

The workers run /usr/bin/python3 (this interpreter), which needs torch for
the tiny decoder (Debian's 1.13 is enough). Paths: $HEARTH_CLI.
"""

import concurrent.futures
import json
import os
import pathlib
import signal
import sys
import time

import pytest
import requests

from serve_support import CLI, ON_GPU, events, python_workers, start_serve, stop_serve, wait_for


torch = pytest.importorskip("torch", reason="the tiny decoder is written in torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "generate" / "tiny_decoder"


def _load(name, path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_repository = _load("tiny_decoder_make_repository", TINY / "make_repository.py")
tiny = tiny_repository.model_module()

KIND = "KIND_GPU" if ON_GPU else "KIND_CPU"

# Pieces "0 ", "1 ", ... one every pace_ms (a model slower than the test
# reacts), at most `pieces`; raise_at (or the prompt "boom") makes it fail
# there. A closed generator leaves closed-<pid>-<piece> in the version
# directory.
PACED_PY = '''
import os, time
import numpy as np

class Model:
    def initialize(self, args):
        self.dir = args["model_repository"]

    def execute(self, inputs, parameters):
        pace = float(parameters.get("pace_ms", 20)) / 1000
        # The prompt "boom" (all an OpenAI request can say) raises at piece 2.
        raise_at = parameters.get("raise_at", 2 if inputs["text_input"][0] == b"boom" else None)
        i = 0
        try:
            for i in range(int(parameters.get("pieces", 10))):
                if raise_at == i:
                    raise RuntimeError(f"the model broke at piece {i}")
                yield {"text_output": np.array([b"%d " % i], dtype=object)}
                time.sleep(pace)
        except GeneratorExit:
            open(os.path.join(self.dir, f"closed-{os.getpid()}-{i}"), "w").close()
            raise
        yield {"completion_tokens": np.array([i + 1], dtype=np.int64),
               "finish_reason": np.array([b"length"], dtype=object)}
'''

PACED_CONFIG = f"""backend: python
max_batch_size: 0
model_transaction_policy: {{decoupled: true}}
input:
  - {{name: text_input, data_type: TYPE_STRING, dims: [1]}}
output:
  - {{name: text_output, data_type: TYPE_STRING, dims: [1]}}
  - {{name: completion_tokens, data_type: TYPE_INT64, dims: [1]}}
  - {{name: finish_reason, data_type: TYPE_STRING, dims: [1]}}
instance_group:
  - {{count: 1, kind: {KIND}}}
parameters:
  python: {sys.executable}
"""


def write_paced(root, name):
    import subprocess
    version = root / name / "1"
    version.mkdir(parents=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", "4", "--out",
                    str(version / "model.safetensors")], check=True, capture_output=True)
    (version / "model.py").write_text(PACED_PY)
    (root / name / "config.yaml").write_text(PACED_CONFIG)
    return version


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("generate")
    root = tmp / "repo"
    version = tiny_repository.write(root, "tiny", workers=2, kind=KIND)
    # Both inputs, each optional: the chat and the completions endpoints both serve it.
    tiny_repository.write(root, "tiny_chat", workers=1, kind=KIND,
                          inputs=("text_input", "messages"))
    tiny_repository.write(root, "chat_only", workers=1, kind=KIND, inputs=("messages",))
    paced = {name: write_paced(root, name) for name in ("paced_a", "paced_b", "paced_one")}
    state = start_serve(tmp, root)
    for model in ("tiny", "tiny_chat", "chat_only", *paced):
        wait_for(lambda m=model: requests.get(f"{state['url']}/v2/models/{m}/ready").status_code == 200,
                 f"{model} ready", timeout=120)
    config = json.loads((version / "config.json").read_text())
    decoder = tiny.TinyDecoder.from_config(config)
    decoder.load_state_dict(tiny_repository.make_weights(config, 0))
    torch.set_num_threads(1)
    state.update(decoder=decoder.eval(), paced=paced)
    yield state
    code, text = stop_serve(state)
    assert code == 0, text[-3000:]


def direct_tokens(served, text, max_tokens, **sampling):
    return list(tiny.tokens(served["decoder"], tiny.prompt_tokens(text), max_tokens, **sampling))


def text_of(tokens):
    return bytes(t for t in tokens if t < 256).decode()


def token_ids(event):
    """An event's token_ids: a one-element output is written as its value."""
    ids = event.get("token_ids", [])
    return ids if isinstance(ids, list) else [ids]


def post(served, path, body, stream=False, timeout=120):
    return requests.post(f"{served['url']}{path}", json=body, stream=stream, timeout=timeout)


# ---- the tiny decoder: streams, joined answers, the endpoints ----------------------------


def test_a_stream_arrives_in_order_and_equals_the_direct_run(served):
    want = direct_tokens(served, "Hello", 40)
    r = post(served, "/v2/models/tiny/generate_stream",
             {"text_input": "Hello", "parameters": {"max_tokens": 40}}, stream=True)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/event-stream")
    got = [json.loads(e) for e in events(r)]
    assert all(e["model_name"] == "tiny" for e in got)
    # Every token as its own event, in order; the last event adds the counts.
    assert [t for e in got for t in token_ids(e)] == want
    assert "".join(e.get("text_output", "") for e in got) == text_of(want)
    assert sum(1 for e in got if e.get("text_output")) == len(want)  # ASCII: one piece per token
    last = got[-1]
    assert last["prompt_tokens"] == len(tiny.prompt_tokens("Hello"))
    assert last["completion_tokens"] == 40 and last["finish_reason"] == "length"


def test_concurrent_streams_are_each_their_own(served):
    prompts = [f"prompt {i}" for i in range(6)]

    def ask(prompt):
        r = post(served, "/v2/models/tiny/generate_stream",
                 {"text_input": prompt, "parameters": {"max_tokens": 24}}, stream=True)
        assert r.status_code == 200, r.text
        return [t for e in events(r) for t in token_ids(json.loads(e))]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, prompts))
    assert got == [direct_tokens(served, p, 24) for p in prompts]


def test_a_request_that_is_not_streamed_gets_the_pieces_joined(served):
    stop = text_of(direct_tokens(served, "Hello", 48))[30:33]
    want = text_of(direct_tokens(served, "Hello", 48))
    want = want[:want.find(stop)]
    r = post(served, "/v2/models/tiny/generate",
             {"text_input": "Hello", "id": "g1", "parameters": {"max_tokens": 48, "stop": stop}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == "tiny" and body["id"] == "g1"
    assert body["text_output"] == want
    assert body["finish_reason"] == "stop"
    assert body["completion_tokens"] == len(want) + len(stop)
    # Every response's token ids, one piece after another (the last
    # response, which holds the counts, has none of its own).
    assert token_ids(body) == direct_tokens(served, "Hello", 48)[:body["completion_tokens"]]
    # The KServe infer endpoint answers a decoupled model once, joined, too
    # (it passes no parameters to the model: its default max_tokens, 16).
    r = requests.post(f"{served['url']}/v2/models/tiny/infer", timeout=120, json={
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hello"]}]})
    assert r.status_code == 200, r.text
    outs = {o["name"]: o for o in r.json()["outputs"]}
    assert outs["text_output"]["data"] == [text_of(direct_tokens(served, "Hello", 16))]
    assert outs["completion_tokens"]["data"] == [16]


def test_sampling_with_a_seed_repeats_itself_over_http(served):
    body = {"text_input": "Hello", "parameters": {"max_tokens": 30, "temperature": 0.9, "seed": 3}}
    a = post(served, "/v2/models/tiny/generate", body).json()
    b = post(served, "/v2/models/tiny/generate", body).json()
    assert a["text_output"] == b["text_output"] == \
        text_of(direct_tokens(served, "Hello", 30, temperature=0.9, seed=3))


def test_bad_parameters_are_a_400_naming_them(served):
    r = post(served, "/v2/models/tiny/generate",
             {"text_input": "Hello", "parameters": {"temperature": 7}})
    assert r.status_code == 400, r.text
    assert "temperature" in r.json()["error"]
    r = post(served, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 600})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_openai_completions_field_by_field(served):
    want = direct_tokens(served, "Once", 20)
    r = post(served, "/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 20})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == "tiny"
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["text"] == text_of(want)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}


def test_openai_completions_streamed(served):
    want = direct_tokens(served, "Once", 20)
    r = post(served, "/v1/completions",
             {"model": "tiny", "prompt": "Once", "max_tokens": 20, "stream": True}, stream=True)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/event-stream")
    payloads = list(events(r))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert all(c["object"] == "text_completion" and c["model"] == "tiny" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == text_of(want)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage == [{"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}]


def test_openai_chat_completions_field_by_field(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tiny.prompt_tokens(tiny.chat_prompt(messages))
    want = list(tiny.tokens(served["decoder"], prompt, 16))
    r = post(served, "/v1/chat/completions", {"model": "tiny_chat", "messages": messages,
                                              "max_tokens": 16})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "tiny_chat"
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": text_of(want)}
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 16,
                             "total_tokens": len(prompt) + 16}
    # Streamed: the role first, then the content piece by piece, the finish, [DONE].
    r = post(served, "/v1/chat/completions", {"model": "tiny_chat", "messages": messages,
                                              "max_tokens": 16, "stream": True}, stream=True)
    assert r.status_code == 200, r.text
    payloads = list(events(r))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0].get("role") == "assistant"
    assert "".join(d.get("content", "") or "" for d in deltas) == text_of(want)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    # A stop string: the text ends before it, finish_reason "stop".
    stop = text_of(want)[5:8]
    r = post(served, "/v1/chat/completions", {"model": "tiny_chat", "messages": messages,
                                              "max_tokens": 16, "stop": [stop]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == text_of(want)[:text_of(want).find(stop)]
    assert choice["finish_reason"] == "stop"


def test_optional_inputs_let_one_model_serve_prompts_and_chats(served):
    want = list(tiny.tokens(served["decoder"], tiny.prompt_tokens("Hello"), 8))
    r = post(served, "/v1/completions", {"model": "tiny_chat", "prompt": "Hello", "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text_of(want)
    # The model config says which inputs are optional, as Triton's does.
    config = requests.get(f"{served['url']}/v2/models/tiny_chat/config", timeout=10).json()
    assert [i.get("optional") for i in config["input"]] == [True, True]
    # A required input left out is still refused by name.
    r = post(served, "/v2/models/tiny/infer", {"inputs": [], "parameters": {"max_tokens": 2}})
    assert r.status_code == 400 and "text_input" in r.text, r.text


def test_a_model_lacking_messages_gets_a_400_naming_it_on_chat(served):
    r = post(served, "/v1/chat/completions",
             {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "messages" in error["message"] and error["type"] == "invalid_request_error"
    r = post(served, "/v1/completions", {"model": "chat_only", "prompt": "Hi"})
    assert r.status_code == 400, r.text
    assert "text_input" in r.json()["error"]["message"]


def test_the_openai_model_list(served):
    r = requests.get(f"{served['url']}/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    names = [m["id"] for m in body["data"]]
    assert {"tiny", "tiny_chat", "paced_a"} <= set(names)
    assert all(m["object"] == "model" for m in body["data"])


# ---- cancellation, crashes and errors mid-stream (the paced model) ------------------------


def pieces_of(payloads):
    """The numbered pieces of a paced stream, and its error (None if it ended well)."""
    numbers, error = [], None
    for p in payloads:
        e = json.loads(p)
        if "error" in e:
            error = e["error"]
            break
        numbers += [int(x) for x in e.get("text_output", "").split()]
    return numbers, error


def test_a_client_that_disconnects_frees_the_worker(served):
    version = served["paced"]["paced_one"]
    r = post(served, "/v2/models/paced_one/generate_stream",
             {"text_input": "x", "parameters": {"pieces": 100000, "pace_ms": 5}}, stream=True)
    assert r.status_code == 200, r.text
    got = events(r)
    for _ in range(3):
        next(got)
    r.close()  # the connection goes: the server cancels the request
    # The only worker is free again: the next request is answered in full...
    r = post(served, "/v2/models/paced_one/generate",
             {"text_input": "x", "parameters": {"pieces": 3, "pace_ms": 0}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == "0 1 2 "
    # ... and the generator of the first was closed at a yield (its GeneratorExit ran).
    closed = list(version.glob("closed-*"))
    assert len(closed) == 1, closed
    assert int(closed[0].name.split("-")[2]) >= 2


def test_sigkill_mid_stream_ends_only_that_stream(served):
    pace = {"pieces": 100000, "pace_ms": 10}
    other = post(served, "/v2/models/paced_b/generate_stream",
                 {"text_input": "b", "parameters": {"pieces": 300, "pace_ms": 10}}, stream=True)
    assert other.status_code == 200, other.text
    other_events = events(other)
    other_seen = [next(other_events) for _ in range(3)]
    victim = post(served, "/v2/models/paced_a/generate_stream",
                  {"text_input": "a", "parameters": pace}, stream=True)
    assert victim.status_code == 200, victim.text
    victim_events = events(victim)
    seen = [next(victim_events) for _ in range(3)]
    [pid] = python_workers(served["proc"].pid, "paced_a")
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    rest = list(victim_events)  # the stream ends: an error event, then the end of the body
    ended_in = time.monotonic() - killed_at
    numbers, error = pieces_of(seen + rest)
    assert error is not None, rest[-3:]
    # The bound for a broken stream's end (the server sees the
    # control socket close at once; the bound is generous for that).
    assert ended_in < 1.0, f"the stream ended {ended_in:.2f} s after the kill"
    # In order, none repeated: the half-sent stream was not replayed.
    assert numbers == list(range(len(numbers))), numbers
    # The other model's stream went on to its end.
    other_numbers, other_error = pieces_of(other_seen + list(other_events))
    assert other_error is None and other_numbers == list(range(300))
    # The replacement serves the next request.
    wait_for(lambda: requests.get(f"{served['url']}/v2/models/paced_a/ready").status_code == 200,
             "paced_a ready again", timeout=120)
    r = post(served, "/v2/models/paced_a/generate",
             {"text_input": "a", "parameters": {"pieces": 4, "pace_ms": 0}})
    assert r.status_code == 200 and r.json()["text_output"] == "0 1 2 3 ", r.text
    assert python_workers(served["proc"].pid, "paced_a") != [pid]


def test_an_exception_mid_stream_ends_the_stream_with_it(served):
    r = post(served, "/v2/models/paced_b/generate_stream",
             {"text_input": "b", "parameters": {"pieces": 10, "pace_ms": 0, "raise_at": 4}},
             stream=True)
    assert r.status_code == 200, r.text
    numbers, error = pieces_of(list(events(r)))
    assert numbers == [0, 1, 2, 3]
    assert "RuntimeError: the model broke at piece 4" in error
    # Not streamed: the error is the answer.
    r = post(served, "/v2/models/paced_b/generate",
             {"text_input": "b", "parameters": {"pieces": 10, "pace_ms": 0, "raise_at": 2}})
    assert r.status_code == 500, r.text
    assert "RuntimeError: the model broke at piece 2" in r.json()["error"]
    # OpenAI's stream ends with an error event and no [DONE].
    r = post(served, "/v1/completions", {"model": "paced_b", "prompt": "boom", "stream": True},
             stream=True)
    assert r.status_code == 200, r.text
    payloads = list(events(r))
    assert "[DONE]" not in payloads
    chunks = [json.loads(p) for p in payloads]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1] if c.get("choices")) == "0 1 "
    error = chunks[-1]["error"]
    assert "RuntimeError: the model broke at piece 2" in error["message"], error
    assert error["type"] == "server_error"


# ---- examples/generate/llama: seed 003's workload on the GPU machine ------------------------


def _transformers_missing():
    if int(torch.__version__.split(".")[0]) < 2:
        return f"torch {torch.__version__} < 2 (transformers needs torch 2)"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed for this interpreter"
    return None


@pytest.mark.skipif(_transformers_missing() is not None, reason=str(_transformers_missing()))
def test_llama_two_workers_on_one_copy_stream_what_generate_picks(tmp_path):
    import transformers
    llama_repository = _load("llama_make_repository",
                             ROOT / "examples" / "generate" / "llama" / "make_repository.py")
    repo = tmp_path / "repo"
    # float32: a worker decodes its streams together, through other kernels
    # than generate() decoding one prompt; in bf16 the different rounding can
    # flip two logits that nearly tie (tests/python/test_generate_models.py).
    version = llama_repository.write(repo, "llama", workers=2, kind=KIND, max_streams=4,
                                     dtype="float32")
    state = start_serve(tmp_path, repo)
    try:
        wait_for(lambda: requests.get(f"{state['url']}/v2/models/llama/ready").status_code == 200,
                 "llama ready", timeout=300)
        device = "cuda:0" if ON_GPU else "cpu"
        major_minor = tuple(int("".join(c for c in part if c.isdigit()) or 0)
                            for part in transformers.__version__.split(".")[:2])
        dtype_key = "dtype" if major_minor >= (4, 56) else "torch_dtype"
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(version), **{dtype_key: torch.float32}).to(device).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(version))
        prompts = ["one copy of the weights", "hello hearth, hello world", "The quick brown fox",
                   "a worker that crashes loses nothing", "a", "Large language models " * 4,
                   "Grouped-query attention shares each key and value head", "hello again"]
        want = {}
        for p in prompts:
            ids = tokenizer(p, return_tensors="pt")["input_ids"].to(device)
            with torch.inference_mode():
                out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=32, do_sample=False,
                                         pad_token_id=tokenizer.eos_token_id)
            want[p] = out[0, ids.shape[1]:].tolist()

        def ask(prompt):
            r = requests.post(f"{state['url']}/v2/models/llama/generate_stream", stream=True,
                              timeout=300, json={"text_input": prompt,
                                                 "parameters": {"max_tokens": 32}})
            assert r.status_code == 200, r.text
            got = [json.loads(e) for e in events(r)]
            return [t for e in got for t in token_ids(e)], \
                "".join(e.get("text_output", "") for e in got)

        # Concurrent streams, as many as the two workers' rows (4 each): a
        # worker decodes several together.
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = dict(zip(prompts, pool.map(ask, prompts)))
        for p in prompts:
            tokens, text = answers[p]
            assert tokens == want[p], p
            assert text == tokenizer.decode(want[p], skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False)
        pids = python_workers(state["proc"].pid, "llama")
        assert len(pids) == 2, pids
        if not ON_GPU:  # on host memory both map the store's one memfd, read-only
            inodes = set()
            for pid in pids:
                maps = [line.split() for line in pathlib.Path(f"/proc/{pid}/maps").read_text()
                        .splitlines() if "memfd:hearth-arena" in line]
                assert maps and all("w" not in m[1] for m in maps)
                inodes |= {m[4] for m in maps}
            assert len(inodes) == 1, inodes
    finally:
        code, text = stop_serve(state)
    assert code == 0, text[-3000:]



# ---- the same streams over gRPC: which response is final ---------------------------


def test_grpc_stream_marks_the_last_response_with_outputs_final(served):
    """Triton's rule (its decoupled-models docs): the response that ends a
    request carries triton_final_response true, outputs and all; an empty
    final response comes only to a client that set
    triton_enable_empty_final_response and a request whose end had no
    outputs. The tiny decoder ends a request with its counts: no empty one."""
    grpc_support = pytest.importorskip("grpc_support")
    channel, stub = grpc_support.connect(grpc_support.grpc_port(served["log"].read_text()))
    pb = grpc_support.pb
    want = direct_tokens(served, "Hello", 3)

    def int64_outputs(response):
        import numpy as np
        return {o.name: np.frombuffer(raw, dtype="<i8").tolist()
                for o, raw in zip(response.outputs, response.raw_output_contents) if o.datatype == "INT64"}

    try:
        for empty_final in (False, True):
            request = pb.ModelInferRequest(model_name="tiny", id=f"f{empty_final}")
            text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
            text.contents.bytes_contents.append(b"Hello")
            request.parameters["max_tokens"].int64_param = 3
            if empty_final:
                request.parameters["triton_enable_empty_final_response"].bool_param = True
            got = list(stub.ModelStreamInfer(iter([request]), timeout=60))
            assert [m.error_message for m in got] == [""] * 4
            finals = [m.infer_response.parameters["triton_final_response"].bool_param for m in got]
            assert finals == [False, False, False, True], empty_final
            assert int64_outputs(got[-1].infer_response)["completion_tokens"] == [3]
            assert [t for m in got for t in int64_outputs(m.infer_response)["token_ids"]] == want
    finally:
        channel.close()
