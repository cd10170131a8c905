"""Text generation models of backend: python, and the backend's decoupled path.

1. examples/generate/tiny_decoder run directly (torch 1.13 is enough): its
   KV-cached greedy decoding equals a full forward pass per token; stop
   strings end the text before them; max_tokens bounds it; a seed makes
   sampling repeatable; characters are never split between pieces. Its
   Model, stepped by hand with stand-in requests, decodes many streams in
   one forward a step: each stream (admitted together, joining mid-decode,
   beside a cancelled one, resumed from the token ids it had sent, sampled
   with a seed) sends exactly what it sends alone.
2. A real `python3 -m hearth.backend_worker` process on a real store, driven
   through its control socket and request slot by `Driver` below, the
   server's side of the worker protocol written from its wire format
   (src/protocol/worker_protocol.h: streams, a ring and credits): a
   decoupled model's stream, piece by piece, equals the direct run, the
   ring growing under it; two streams on a worker of max_streams 2 come
   interleaved, each as it runs alone; responses not yet credited keep their
   bytes; a request opened with the token ids of a run's first responses
   goes on exactly where that run was; a cancelled stream ends with a final
   response while the other goes on; a generator model's streams advance in
   turn, a cancel closes its generator (its GeneratorExit runs) and the
   worker serves the next; an exception mid-stream ends the stream with its
   last line; yields that fail their checks name the output; the request's
   parameters arrive as sent; a batch model still runs batches; a model
   whose execute does not match its transaction policy (or a generator
   model that says it is resumable) fails at start.
3. examples/generate/llama: its detokenizer and stop strings; its Model,
   many streams decoded together, on a stand-in for a transformers causal
   LM (here, without transformers): streams arriving at different steps,
   more than its rows, ending or cancelled at different steps, each equal
   token for token to a full forward per token; a stream resumed at any
   response boundary sends exactly what the whole stream sent after it
   (greedy, sampled, with stop strings); seeded draws the same alone and
   among other streams; bad requests refused naming what is wrong. Where
   torch >= 2 and transformers are installed (the GPU machine:
   HEARTH_TEST_DEVICE=cuda:0), on a Llama-architecture checkpoint with
   random weights in float32 (save_pretrained, offline): one Model over the
   store's weights decodes prompts of different lengths together, each
   token for token what transformers' own generate() picks for it alone;
   and a worker streams what generate() picks for a prompt and for a chat.

The end-to-end tests under `hearth serve` are in tests/serve/test_generate.py.
"""

import collections
import json
import math
import mmap
import os
import pathlib
import select
import socket
import struct
import subprocess
import sys

import numpy as np
import pytest

import hearth_testing as ht

torch = pytest.importorskip("torch", reason="the tiny decoder is written in torch")

TINY = ht.ROOT / "examples" / "generate" / "tiny_decoder"
LLAMA = ht.ROOT / "examples" / "generate" / "llama"


def _load(name, path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_repository = _load("tiny_decoder_make_repository", TINY / "make_repository.py")
tiny = make_repository.model_module()

llama = _load("llama_model", LLAMA / "model.py")
llama_repository = _load("llama_make_repository", LLAMA / "make_repository.py")


def _transformers_missing():
    if int(torch.__version__.split(".")[0]) < 2:
        return f"torch {torch.__version__} < 2 (transformers needs torch 2)"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed for this interpreter"
    return None


TRANSFORMERS_MISSING = _transformers_missing()

# hearth::StatusCode (include/hearth/status.h), as a Done carries it.
INVALID_ARGUMENT = 1
INTERNAL = 8


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    version = make_repository.write(root / "repo", workers=1)
    return version


@pytest.fixture(scope="module")
def decoder(repo):
    """The tiny decoder built from the repository's own files, without hearth."""
    config = json.loads((repo / "config.json").read_text())
    d = tiny.TinyDecoder.from_config(config)
    weights = read_safetensors(repo / "model.safetensors")
    d.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    torch.set_num_threads(1)
    return d.eval()


@pytest.fixture(scope="module")
def exact(decoder):
    """The repository's decoder in float64, for the tests of section 1 that
    compare two ways of computing the same tokens (a stream in a batch of 16
    and alone, the cached loop and a full forward). In float32 their logits
    differ by a few 1e-6 (another reduction order), and the repository's
    logits are not peaked enough to make that harmless: over 12,000 greedy
    steps of random prompts, the best two logits came within 1.2e-4 of each
    other, and a seeded draw tips wherever the uniform lands that close to a
    boundary. In float64 the difference is ~1e-14, too small to tip a token
    or a draw in any run. (Making the forward batch-invariant in float32
    instead would take a per-stream loop over every matmul, undoing the batch.)"""
    import copy
    return copy.deepcopy(decoder).double()


def read_safetensors(path):
    raw = pathlib.Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    kinds = {"F32": "<f4", "I64": "<i8", "F16": "<f2"}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=kinds[info["dtype"]]) \
            .reshape(info["shape"]).copy()
    return out


def full_forward_greedy(decoder, prompt, max_tokens):
    """Greedy decoding the plain way: the whole sequence through the module per token."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits, _ = decoder(torch.tensor(ids, dtype=torch.long))
            token = int(torch.argmax(logits[-1]))
            out.append(token)
            if token == tiny.EOS:
                break
            ids.append(token)
    return out


class Request:
    """A stand-in for hearth.Request: the model's responses, each with the
    number of the step (of `stepper`) that sent it. Cancelled by setting
    `cancelled`, or by its send() once it has `cancel_after` responses."""

    def __init__(self, text, parameters=None, resume=(), cancel_after=None):
        self.id = ""
        self.inputs = {"text_input": np.array([text.encode()], dtype=object),
                       "messages": np.array([b""], dtype=object)}
        self.parameters = dict(parameters or {})
        self.resume_token_ids = list(resume)
        self.cancel_after = cancel_after
        self.cancelled = False
        self.responses = []  # (step, {name: list}, final)
        self.error = None
        self.stepper = None

    def is_cancelled(self):
        return self.cancelled

    @property
    def over(self):
        return self.cancelled or self.error is not None or (self.responses and self.responses[-1][2])

    def send(self, outputs=None, final=False):
        assert not self.over, "a response after the request was over"
        if self.cancel_after is not None and len(self.responses) == self.cancel_after:
            self.cancelled = True
            return False
        self.responses.append((self.stepper.steps, {k: v.tolist() for k, v in outputs.items()}, final))
        return True

    def fail(self, exception):
        assert not self.over, "fail() after the request was over"
        self.error = exception

    def sent(self):
        """The responses, without their steps."""
        return [(out, final) for _, out, final in self.responses]

    def token_ids(self):
        return [t for _, out, _ in self.responses for t in out["token_ids"]]


class Stepper:
    """The tiny decoder's Model on `decoder` for max_streams streams, stepped as a worker would."""

    def __init__(self, decoder, max_streams):
        self.model = tiny.Model()
        self.model.serve(decoder, max_streams)
        self.steps = 0  # the steps made so far; responses of execute carry the last one's number

    def admit(self, *requests):
        for r in requests:
            r.stepper = self
        self.model.execute(list(requests))
        return requests

    def step(self, times=1):
        for _ in range(times):
            self.steps += 1
            self.model.step()

    def finish(self, requests, limit=600):
        while not all(r.over for r in requests):
            assert self.steps < limit, "the streams never ended"
            self.step()


def alone(decoder, text, parameters=None, resume=()):
    """A request run alone through the Model: the stand-in, finished."""
    stepper = Stepper(decoder, 1)
    r, = stepper.admit(Request(text, parameters, resume))
    stepper.finish([r])
    return r


def direct(decoder, text, **parameters):
    """The Model on `decoder`, one request alone, without a worker: (pieces,
    final response); a request it refuses raises the error it failed with."""
    r = alone(decoder, text, parameters)
    if r.error is not None:
        raise r.error
    responses = [{k: np.array(v, dtype=object if k in ("text_output", "finish_reason") else np.int64)
                  for k, v in out.items()} for out, _ in r.sent()]
    pieces = [r["text_output"][0] for r in responses]
    last = dict(responses[-1], token_ids=np.concatenate([r["token_ids"] for r in responses]))
    return pieces, last


# ---- the tiny decoder, directly ------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Hello, world", "The quick brown fox", "a"])
def test_cached_greedy_decoding_equals_a_full_forward_per_token(exact, prompt):
    ids = tiny.prompt_tokens(prompt)
    cached = list(tiny.tokens(exact, ids, 48))
    assert cached == full_forward_greedy(exact, ids, 48)
    # The repository's weights write printable ASCII: one token per character,
    # so comparing texts elsewhere compares tokens.
    assert all(0x20 <= t < 0x7f or t in (ord("\n"), tiny.EOS) for t in cached), cached


def test_max_tokens_bounds_the_generation(exact):
    ids = tiny.prompt_tokens("Hello")
    greedy = full_forward_greedy(exact, ids, 40)
    assert tiny.EOS not in greedy, "pick a prompt whose greedy run does not end by itself"
    for n in (1, 7, 40):
        pieces, last = direct(exact, "Hello", max_tokens=n)
        assert b"".join(pieces) == bytes(greedy[:n])
        assert last["token_ids"].tolist() == greedy[:n]
        assert last["completion_tokens"].tolist() == [n]
        assert last["prompt_tokens"].tolist() == [len(ids)]
        assert last["finish_reason"].tolist() == [b"length"]


def test_stop_strings_end_the_text_before_them(exact):
    text = bytes(full_forward_greedy(exact, tiny.prompt_tokens("Hello"), 64)).decode()
    stop = text[20:23]
    at = text.find(stop)
    pieces, last = direct(exact, "Hello", max_tokens=64, stop=stop)
    assert b"".join(pieces).decode() == text[:at]
    assert last["finish_reason"].tolist() == [b"stop"]
    # The token that completed the stop string is the last one generated.
    assert last["completion_tokens"].tolist() == [at + len(stop)]
    # Of a list, the first to appear ends the text; one that never appears changes nothing.
    later = text[40:42]
    pieces, last = direct(exact, "Hello", max_tokens=64, stop=["never seen \u00e9", later, stop])
    assert b"".join(pieces).decode() == text[:min(at, text.find(later))]
    pieces, last = direct(exact, "Hello", max_tokens=64, stop=["never seen \u00e9"])
    assert b"".join(pieces).decode() == text
    assert last["finish_reason"].tolist() == [b"length"]


def test_eos_ends_the_generation_as_a_stop(exact):
    import copy
    eager = copy.deepcopy(exact)
    with torch.no_grad():
        eager.head.bias[tiny.EOS] = 1e4  # EOS is always the most likely token
    pieces, last = direct(eager, "Hello", max_tokens=10)
    assert b"".join(pieces) == b""
    assert last["token_ids"].tolist() == [tiny.EOS]
    assert last["completion_tokens"].tolist() == [1]
    assert last["finish_reason"].tolist() == [b"stop"]


def test_a_seed_makes_sampling_repeatable(exact):
    ids = tiny.prompt_tokens("Hello")
    a = list(tiny.tokens(exact, ids, 40, temperature=1.0, seed=7))
    assert a == list(tiny.tokens(exact, ids, 40, temperature=1.0, seed=7))
    assert a != list(tiny.tokens(exact, ids, 40, temperature=1.0, seed=8))
    assert a != list(tiny.tokens(exact, ids, 40)), "sampling at temperature 1 chose the greedy path"
    # top_p so small that only the most likely token is left: greedy again.
    assert list(tiny.tokens(exact, ids, 40, temperature=1.0, top_p=1e-9, seed=7)) == \
        list(tiny.tokens(exact, ids, 40))
    pieces, _ = direct(exact, "Hello", max_tokens=40, temperature=1.0, seed=7)
    assert b"".join(pieces) == bytes(t for t in a if t < 256)


def test_pieces_never_split_a_character_and_hold_back_a_stop_prefix():
    s = tiny.TextStream(stop=["<end>"])
    pieces = [s.feed(b) for b in "h\u00e9\u20ac\U0001F600 <en".encode()]
    assert [p for p in pieces if p] == ["h", "\u00e9", "\u20ac", "\U0001F600", " "]
    assert s.feed(ord("x")) == "<enx"  # not the stop string after all
    assert s.feed(0xFF) == "\ufffd"   # a byte that is never UTF-8
    for b in b"<end>":
        assert s.feed(b) == ""
    assert s.stopped and s.flush() == ""
    s = tiny.TextStream()
    assert s.feed(0xC3) == "" and s.flush() == "\ufffd"  # a character cut off by the end


def test_the_chat_template():
    assert tiny.chat_prompt([{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                          {"type": "text", "text": "!"}]}]) == \
        "system: Be brief.\nuser: Hi!\nassistant: "
    for bad in ([], {"role": "user"}, [{"content": "no role"}],
                [{"role": "user", "content": [{"type": "image_url"}]}]):
        with pytest.raises(tiny.RequestError):
            tiny.chat_prompt(bad)


@pytest.mark.parametrize("parameters, named", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"temperature": 5}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop": ["a"] * 5}, "stop"), ({"stop": 3}, "stop"),
    ({"max_tokens": 510}, "positions"),
])
def test_bad_parameters_are_refused_naming_them(decoder, parameters, named):
    with pytest.raises(tiny.RequestError, match=named):
        direct(decoder, "Hello", **parameters)


# ---- the tiny decoder's Model, many streams at once --------------------------------------

# Sixteen prompts of 0 to 80 characters.
PROMPTS = ["Hello", "The quick brown fox", "a", "", "Once upon a time, in a land far away",
           "hearth", "0123456789", "What is the answer?", "x" * 80, "Lorem ipsum dolor sit amet",
           "GPU", "one copy of the weights, many workers", "zz", "A\nB\nC", "tiny decoder", "?!"]


def greedy_text(decoder, prompt, n):
    return bytes(t for t in tiny.tokens(decoder, tiny.prompt_tokens(prompt), n) if t < 256).decode()


def sixteen_requests(decoder):
    """(prompt, parameters) for 16 streams: max_tokens from 2 to 40, every
    fourth with a stop string its greedy text reaches, two sampled."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        parameters = {"max_tokens": 2 + (i * 7) % 39}
        if i % 4 == 1:
            text = greedy_text(decoder, prompt, 40)
            parameters = {"max_tokens": 40, "stop": ["never", text[12:14]]}
        if i in (6, 13):
            parameters.update(temperature=0.8, seed=100 + i)
        out.append((prompt, parameters))
    return out


def test_sixteen_streams_decode_together_each_as_alone(exact):
    cases = sixteen_requests(exact)
    stepper = Stepper(exact, 16)
    requests = stepper.admit(*(Request(p, q) for p, q in cases))  # as many as max_streams
    stepper.finish(requests)
    for (prompt, parameters), r in zip(cases, requests):
        assert r.error is None, r.error
        assert r.sent() == alone(exact, prompt, parameters).sent(), (prompt, parameters)
        if "temperature" not in parameters:  # and the module's own loop, token for token
            assert r.token_ids() == list(tiny.tokens(exact, tiny.prompt_tokens(prompt),
                                                     r.sent()[-1][0]["completion_tokens"][0]))
    finals = [r.sent()[-1][0] for r in requests]
    assert {f["finish_reason"][0] for f in finals} == {b"stop", b"length"}
    # Together: the first step gave every stream its first token, no stream
    # ended before that, and the steps were those of the longest stream.
    assert [r.responses[0][0] for r in requests] == [1] * 16
    assert min(r.responses[-1][0] for r in requests) > 1
    assert stepper.steps == max(f["completion_tokens"][0] for f in finals)


def test_streams_joining_mid_decode_equal_their_alone_runs(exact):
    stepper = Stepper(exact, 9)
    first = stepper.admit(*(Request(p, {"max_tokens": 30}) for p in PROMPTS[:4]))
    stepper.step(5)
    second = stepper.admit(*(Request(p, {"max_tokens": 20}) for p in PROMPTS[4:7]))
    stepper.step(3)
    third = stepper.admit(Request(PROMPTS[8], {"max_tokens": 12}),
                          Request(PROMPTS[9], {"max_tokens": 25, "temperature": 0.8, "seed": 9}))
    stepper.step()
    # Prefilled in the step after they came, beside the others' decoding.
    assert [r.responses[0][0] for r in third] == [9, 9]
    assert all(not r.over for r in first + second)
    stepper.finish(first + second + third)
    assert [r.responses[0][0] for r in second] == [6] * 3
    for r in first + second + third:
        want = alone(exact, r.inputs["text_input"][0].decode(), r.parameters)
        assert r.sent() == want.sent(), r.parameters


def test_a_cancelled_stream_leaves_and_a_new_one_takes_its_slot(exact, tmp_path):
    stepper = Stepper(exact, 4)
    stepper.model.marker_dir = str(tmp_path)
    long, kept, torn, other = stepper.admit(
        Request("x" * 80, {"max_tokens": 40}), Request("Hello", {"max_tokens": 40}),
        Request("hearth", {"max_tokens": 40}, cancel_after=3), Request("zz", {"max_tokens": 40}))
    # A fifth is more than the worker may give; the model refuses it and goes on.
    fifth, = stepper.admit(Request("GPU", {"max_tokens": 40}))
    assert isinstance(fifth.error, RuntimeError) and "max_streams" in str(fifth.error)
    stepper.step(6)
    long.cancelled = True  # the client went away between two steps
    seen = len(long.responses)
    # The stream whose send found its request over (at its 4th token) is gone.
    assert torn.cancelled and len(torn.responses) == 3
    stepper.step()
    assert len(long.responses) == seen
    # Each dropped with a marker naming the tokens it had generated.
    assert sorted(p.name.split("-")[2] for p in tmp_path.iterdir()) == ["4", "6"]
    # Two slots free, one of them where an 81-token prompt and 6 tokens were:
    # what the new streams write is shorter, and the rest must not show.
    late = stepper.admit(Request("a", {"max_tokens": 30}), Request("GPU", {"max_tokens": 30}))
    stepper.finish([kept, other, *late])
    for r in (kept, other, *late):
        assert r.error is None, r.error
        want = alone(exact, r.inputs["text_input"][0].decode(), r.parameters)
        assert r.sent() == want.sent(), r.parameters
    assert sorted(stepper.model.free) == [0, 1, 2, 3] and not stepper.model.streams


def test_a_refused_request_fails_alone(exact):
    stepper = Stepper(exact, 4)
    chat = Request("")
    chat.inputs["messages"][0] = json.dumps([{"role": "user", "content": "x" * 500}]).encode()
    good, bad, long, other = stepper.admit(
        Request("Hello", {"max_tokens": 5}), Request("Hello", {"temperature": 9}), chat,
        Request("", {"max_tokens": 5}))
    assert isinstance(bad.error, tiny.RequestError) and "temperature" in str(bad.error)
    assert isinstance(long.error, tiny.RequestError) and "positions" in str(long.error)
    stepper.finish([good, other])
    assert good.sent() == alone(exact, "Hello", {"max_tokens": 5}).sent()
    assert other.sent() == alone(exact, "", {"max_tokens": 5}).sent()
    assert bad.responses == [] and long.responses == []


def joined(responses):
    """The text and tokens of a stream's responses, and its last response's counts."""
    text = b"".join(out["text_output"][0] for out, _ in responses)
    ids = [t for out, _ in responses for t in out["token_ids"]]
    final = {k: v for k, v in responses[-1][0].items() if k not in ("text_output", "token_ids")}
    return text, ids, final


@pytest.mark.parametrize("parameters", [
    {"max_tokens": 24},                                            # greedy, ends by length
    {"max_tokens": 40, "stop": "STOP"},                            # greedy, ends by a stop string
    {"max_tokens": 30, "temperature": 0.8, "seed": 1234},          # sampled, ends by length
    {"max_tokens": 40, "temperature": 0.8, "seed": 77, "stop": "STOP"},  # sampled, by a stop string
], ids=["greedy-length", "greedy-stop", "sampled-length", "sampled-stop"])
def test_a_resumed_stream_goes_on_from_the_tokens_it_had_sent(exact, parameters):
    parameters = dict(parameters)
    prompt = "Once upon a time"
    if "stop" in parameters:  # a stop string the uninterrupted run meets at its 20th token
        sampled = {k: parameters[k] for k in ("temperature", "seed") if k in parameters}
        ids = list(tiny.tokens(exact, tiny.prompt_tokens(prompt), 40, **sampled))
        parameters["stop"] = bytes(ids[17:20]).decode()
    whole = alone(exact, prompt, parameters).sent()
    n = len(whole)
    reason = b"stop" if "stop" in parameters else b"length"
    assert whole[-1][0]["finish_reason"] == [reason] and n > 10
    # Cut after k responses, k from the first to the one right before the last
    # (then the tokens sent already end the generation); all resumed at once,
    # beside a stream that starts afresh.
    cuts = [1, 2, n // 2, n - 2, n - 1]
    stepper = Stepper(exact, 16)
    resumed = stepper.admit(*(Request(prompt, parameters,
                                      resume=[t for out, _ in whole[:k] for t in out["token_ids"]])
                              for k in cuts), Request("hearth", {"max_tokens": 30}))[:-1]
    # Cut right before the final response: when the tokens sent already end
    # the generation (max_tokens: the last token's text went out before the
    # final response), the final response comes at once, before any step.
    ended = len(joined(whole[:n - 1])[1]) == whole[-1][0]["completion_tokens"][0]
    assert ended or "stop" in parameters
    assert [s for s, _, _ in resumed[-1].responses] == ([0] if ended else [])
    stepper.finish(resumed)
    for k, r in zip(cuts, resumed):
        assert r.error is None, r.error
        assert joined(whole[:k] + r.sent()) == joined(whole), k
        # Not a byte of the text sent before the cut comes again.
        assert r.sent() == whole[k:], k


def test_the_draw_at_each_position_comes_from_its_own_seed(exact):
    # splitmix64 from state 0 gives 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, ...
    # (its reference outputs); position_seed keeps their top 63 bits.
    assert [tiny.position_seed(0, p) for p in range(3)] == \
        [0xE220A8397B1DCDAF >> 1, 0x6E789E6AA1B965F4 >> 1, 0x06C45D188009454F >> 1]
    # Each sampled token is the draw of a generator seeded with (seed, its position) alone.
    ids = tiny.prompt_tokens("Hello")
    sampled = list(tiny.tokens(exact, ids, 20, temperature=0.8, seed=5))
    with torch.no_grad():
        for p, token in enumerate(sampled):
            logits, _ = exact(torch.tensor(ids + sampled[:p], dtype=torch.long))
            probs = torch.softmax(logits[-1] / 0.8, dim=-1)
            generator = torch.Generator().manual_seed(tiny.position_seed(5, p))
            assert int(torch.multinomial(probs, 1, generator=generator)) == token, p


def test_seeded_sampling_is_the_same_alone_or_among_fifteen(exact):
    parameters = {"max_tokens": 40, "temperature": 0.8, "seed": 5}
    lone = alone(exact, "Hello", parameters)
    stepper = Stepper(exact, 16)
    others = [Request(p, {"max_tokens": 30, "temperature": 0.8, "seed": i} if i % 2 else
                      {"max_tokens": 30}) for i, p in enumerate(PROMPTS[1:])]
    together, *_ = stepper.admit(Request("Hello", parameters), *others)
    stepper.finish([together, *others])
    assert together.sent() == lone.sent()
    # The module's own loop draws the same, and sampling is not greedy here.
    assert lone.token_ids() == list(tiny.tokens(exact, tiny.prompt_tokens("Hello"), 40,
                                                temperature=0.8, seed=5))
    assert lone.token_ids() != alone(exact, "Hello", {"max_tokens": 40}).token_ids()
    assert lone.token_ids() != alone(exact, "Hello", dict(parameters, seed=6)).token_ids()


# ---- the backend's decoupled path, through a real worker process ----------------------

# enum Kind (src/protocol/worker_protocol.h)
KIND_READY, KIND_RUN, KIND_DONE, KIND_SETUP, KIND_ROOM = 1, 2, 3, 4, 5
KIND_RING, KIND_OPEN, KIND_RESPONSE, KIND_CREDIT, KIND_CANCEL, KIND_RING_GROW = 10, 11, 12, 13, 14, 15
MAGIC = 0x4B524F57
SLOT_HEADER = 4096  # control::kSlotHeaderBytes (protocol/life_lock.h)
BYTES, I64 = 12, 4
TRITON = {"TYPE_STRING": BYTES, "TYPE_INT64": I64}


def align(n):
    return (n + 63) // 64 * 64


def _str(b):
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<I", len(b)) + b


def _tensors(ts):
    out = struct.pack("<I", len(ts))
    for offset, nbytes, shape in ts:
        out += struct.pack("<QQI", offset, nbytes, len(shape)) + struct.pack(f"<{len(shape)}q", *shape)
    return out


class _Reader:
    def __init__(self, b):
        self.b, self.at = b, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.b, self.at)
        self.at += struct.calcsize(fmt)
        return v if len(v) > 1 else v[0]

    def str(self):
        n = self.take("<I")
        s = self.b[self.at:self.at + n]
        self.at += n
        return s

    def dims(self):
        n = self.take("<I")
        dims = list(struct.unpack_from(f"<{n}q", self.b, self.at))
        self.at += 8 * n
        return dims

    def tensors(self):
        out = []
        for _ in range(self.take("<I")):
            offset, nbytes = self.take("<QQ")
            out.append((offset, nbytes, self.dims()))
        return out

    def specs(self):
        return [(self.str().decode(), self.take("<B"), self.dims()) for _ in range(self.take("<I"))]

    def end(self, what):
        assert self.at == len(self.b), f"{len(self.b) - self.at} bytes after the end of a {what}"


def bytes_tensor(elements):
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def unbytes(raw):
    out, at = [], 0
    while at < len(raw):
        n = int.from_bytes(raw[at:at + 4], "little")
        out.append(raw[at + 4:at + 4 + n])
        at += 4 + n
    return out


class Driver:
    """The server's side of one worker: a SOCK_SEQPACKET control socket and a
    memfd request slot, handed to `python3 -m hearth.backend_worker`.

    A batch model's worker runs a batch of one request at a time (run()). A
    decoupled model's worker holds streams: the slot's first INPUT_BYTES hold
    the open requests' inputs (first fit, 64-byte aligned; once a request's
    final response came its region is the driver's again, and is scribbled
    over), and the ring lies right after them, `ring` bytes at first. A ring
    the worker outgrows (kRingGrow) moves to the slot's end, the slot growing
    for it. Every response is checked (its outputs in the ring, clear of
    every response not yet credited) and its outputs copied out as it is
    read; next() credits what it read in one kCredit, take() leaves that to
    the test."""

    SLOT = 1 << 20
    INPUT_BYTES = 256 << 10

    def __init__(self, tmp, store, model, config, version_dir, decoupled=True, ring=256):
        self.config = config
        self.outputs = config["output"]
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.slot = os.memfd_create("test-slot", os.MFD_CLOEXEC)
        # The slot's data follow its header page (the worker's life lock), as the server lays it out.
        os.ftruncate(self.slot, SLOT_HEADER + self.SLOT)
        self.size = self.SLOT
        self.mem = mmap.mmap(self.slot, self.size, offset=SLOT_HEADER)
        self.seq = 0
        self.next_id = 0
        self.regions = {}      # open request id -> its inputs' (offset, bytes)
        self.untaken = []      # responses read and not yet credited
        self.queue = collections.deque()  # responses read (and credited) that next() has not returned
        self.ring_grows = 0
        cfg = dict(config, model_transaction_policy={"decoupled": decoupled})
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        setup = struct.pack("<IIII", MAGIC, KIND_SETUP, cfg["max_batch_size"], len(params))
        for k, v in params.items():
            setup += _str(k) + _str(v)
        setup += struct.pack("<II", 0, 0)  # inputs, outputs: the config says
        setup += _str(json.dumps(cfg)) + _str(str(version_dir)) + struct.pack("<B", decoupled)
        self.control.send(setup)
        self.log = open(tmp / f"worker-{model}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hearth.backend_worker", "--store-socket", store.socket,
             "--model", model, "--control-fd", str(theirs.fileno()), "--slot-fd", str(self.slot)],
            pass_fds=(theirs.fileno(), self.slot), env=ht.child_env(), stdout=self.log,
            stderr=subprocess.STDOUT)
        theirs.close()
        kind, r = self.receive(timeout=180)
        self.ready = kind == KIND_READY
        if not self.ready:
            assert kind == KIND_DONE, kind
            self.start_error = self._done(r)
            return
        r.specs(), r.specs(), r.take("<Q"), r.str(), r.take("<B")  # signature, memory, text, ...
        for _ in range(r.take("<I")):  # the phases of its start
            r.str(), r.take("<Q")
        self.streams, self.window = r.take("<II")
        r.end("ready message")
        if decoupled:
            self.ring = (self.INPUT_BYTES, ring)  # right after the inputs' region
            self._send_ring()

    def receive(self, timeout=60):
        ready, _, _ = select.select([self.control], [], [], timeout)
        assert ready, f"the worker said nothing within {timeout} s:\n{self.log_text()}"
        b = self.control.recv(1 << 18)
        assert b, f"the worker closed its control socket:\n{self.log_text()}"
        r = _Reader(b)
        magic, kind = r.take("<II")
        assert magic == MAGIC
        return kind, r

    def log_text(self):
        self.log.flush()
        return pathlib.Path(self.log.name).read_text()[-4000:]

    def _grow_slot(self, size):
        self.size = size
        os.ftruncate(self.slot, SLOT_HEADER + self.size)
        self.mem = mmap.mmap(self.slot, self.size, offset=SLOT_HEADER)

    # -- batches (a model that is not decoupled)

    @staticmethod
    def _done(r):
        seq, status = r.take("<QI")
        text = r.str().decode(errors="replace")
        retry_alone, _run_us, room_needed = r.take("<BQQ")
        outputs = r.tensors()
        present = [r.take("<B") for _ in range(r.take("<I"))]
        r.end("done message")
        return {"seq": seq, "status": status, "text": text, "retry_alone": retry_alone,
                "room_needed": room_needed, "outputs": outputs, "present": present}

    def run(self, inputs):
        """A batch of one request, inputs {name: [bytes, ...]} (BYTES): its
        kDone, with its outputs decoded as `values`."""
        self.seq += 1
        lead = [1] if self.config["max_batch_size"] > 0 else []
        at, placed = 0, []
        for io in self.config["input"]:
            raw = bytes_tensor(inputs[io["name"]])
            self.mem[at:at + len(raw)] = raw
            placed.append((at, len(raw), lead + [len(inputs[io["name"]])]))
            at = align(at + len(raw))
        n_out = len(self.outputs)
        run = struct.pack("<IIQqQ", MAGIC, KIND_RUN, self.seq, 1, self.size) + _tensors(placed)
        run += _tensors([(0, 0, [])] * n_out) + struct.pack("<I", n_out) + bytes(n_out)
        run += struct.pack("<Q", max(at, 64)) + _str("")
        run += struct.pack("<IIB", 0, 0, 0)  # no CUDA shared-memory regions or device copies; not compact
        self.control.send(run)
        while True:
            kind, r = self.receive()
            assert kind == KIND_DONE, kind
            m = self._done(r)
            assert m["seq"] == self.seq
            if not m["room_needed"]:
                break
            self._grow_slot(max(m["room_needed"], 2 * self.size))
            self.control.send(struct.pack("<IIQQ", MAGIC, KIND_ROOM, self.seq, self.size))
        m["values"] = {}
        for io, (offset, nbytes, shape), present in zip(self.outputs, m["outputs"],
                                                         m["present"] or [1] * n_out):
            if present:
                m["values"][io["name"]] = (self._value(io, offset, nbytes), shape)
        return m

    def _value(self, io, offset, nbytes):
        raw = bytes(self.mem[offset:offset + nbytes])
        return unbytes(raw) if TRITON[io["data_type"]] == BYTES else np.frombuffer(raw, "<i8").tolist()

    # -- streams (a decoupled model)

    def _send_ring(self):
        self.control.send(struct.pack("<IIQQQ", MAGIC, KIND_RING, *self.ring, self.size))

    def _place(self, nbytes):
        """First fit in the inputs' region."""
        nbytes = align(max(nbytes, 1))
        at = 0
        for start, taken in sorted(self.regions.values()):
            if start - at >= nbytes:
                break
            at = start + taken
        assert at + nbytes <= self.INPUT_BYTES, "the open requests' inputs outgrew the driver's region"
        return at, nbytes

    def open(self, inputs, parameters=None, resume=()):
        """Opens a request: its inputs {name: [bytes, ...]} (BYTES) placed in
        the slot, its parameters as JSON (None: none) and the token ids it
        resumes from. Returns its id."""
        lead = [1] if self.config["max_batch_size"] > 0 else []
        raws = [bytes_tensor(inputs[io["name"]]) for io in self.config["input"]]
        resume_raw = np.asarray(resume, dtype="<i8").tobytes()
        start, nbytes = self._place(sum(align(len(raw)) for raw in raws) + len(resume_raw))
        self.next_id += 1
        self.regions[self.next_id] = (start, nbytes)
        at, placed = start, []
        for io, raw in zip(self.config["input"], raws):
            self.mem[at:at + len(raw)] = raw
            placed.append((at, len(raw), lead + [len(inputs[io["name"]])]))
            at += align(len(raw))
        self.mem[at:at + len(resume_raw)] = resume_raw
        tokens = (at, len(resume_raw), [len(resume)]) if len(resume) else (0, 0, [0])
        message = struct.pack("<IIQ", MAGIC, KIND_OPEN, self.next_id) + _str(f"r{self.next_id}")
        message += struct.pack("<Q", self.size) + _tensors(placed)
        message += _str(json.dumps(parameters) if parameters is not None else "") + _tensors([tokens])
        self.control.send(message)
        return self.next_id

    def cancel(self, *ids):
        self.control.send(struct.pack(f"<III{len(ids)}Q", MAGIC, KIND_CANCEL, len(ids), *ids))

    def _grow_ring(self, nbytes):
        """A new ring at the slot's end, the slot grown for it: the old one is
        the driver's again."""
        assert not self.untaken, "kRingGrow before every response was taken"
        assert nbytes > self.ring[1], f"kRingGrow to {nbytes} bytes from a ring of {self.ring[1]}"
        self.ring = (align(self.size), align(nbytes))
        self._grow_slot(sum(self.ring))
        self._send_ring()
        self.ring_grows += 1

    def _read(self):
        """The next response, answering kRingGrow on the way: checked, its
        outputs copied out, and counted as not yet taken."""
        while True:
            kind, r = self.receive()
            if kind != KIND_RING_GROW:
                break
            nbytes = r.take("<Q")
            r.end("ring-grow message")
            self._grow_ring(nbytes)
        assert kind == KIND_RESPONSE, f"a message of kind {kind} among streams"
        rid, final, status = r.take("<QBI")
        m = {"id": rid, "final": bool(final), "status": status, "text": r.str().decode(errors="replace")}
        outputs = r.tensors()
        m["present"] = [r.take("<B") for _ in range(r.take("<I"))]
        r.end("response message")
        assert rid in self.regions, f"a response to request {rid}, which is not open"
        assert len(outputs) == len(m["present"]) == len(self.outputs), m
        assert final or status == 0, "an error that is not final"
        m["values"], m["places"] = {}, []
        ring_at, ring_bytes = self.ring
        untaken = [(at, n) for u in self.untaken for _, at, n, _ in u["places"] if n]
        for io, (offset, nbytes, shape), present in zip(self.outputs, outputs, m["present"]):
            if not present:
                assert (offset, nbytes, shape) == (0, 0, []), (io["name"], offset, nbytes, shape)
                continue
            assert ring_at <= offset and offset + nbytes <= ring_at + ring_bytes, \
                f"output {io['name']!r} at [{offset}, +{nbytes}) is outside the ring at {self.ring}"
            if nbytes:
                for at, n in untaken:
                    assert offset + nbytes <= at or at + n <= offset, \
                        f"output {io['name']!r} at [{offset}, +{nbytes}) overlaps untaken bytes at [{at}, +{n})"
                untaken.append((offset, nbytes))
            m["places"].append((io, offset, nbytes, shape))
            m["values"][io["name"]] = (self._value(io, offset, nbytes), shape)
        self.untaken.append(m)
        if final:  # its inputs are the driver's again: the worker must not read them now
            start, nbytes = self.regions.pop(rid)
            self.mem[start:start + nbytes] = b"\xa5" * nbytes
        return m

    def take(self, n):
        """The next n responses, read and left uncredited."""
        assert not self.queue
        return [self._read() for _ in range(n)]

    def untaken_unchanged(self):
        """Whether every response not yet credited still holds what was read."""
        return all({io["name"]: (self._value(io, offset, nbytes), shape)
                    for io, offset, nbytes, shape in m["places"]} == m["values"]
                   for m in self.untaken)

    def credit(self):
        """Every response read is taken: their ring bytes go back in one
        kCredit, once it is checked that the worker wrote none of them since."""
        if self.untaken:
            assert self.untaken_unchanged(), "the worker wrote over a response not yet taken"
            self.control.send(struct.pack("<III", MAGIC, KIND_CREDIT, len(self.untaken)))
            self.untaken = []

    def next(self):
        """The next response: what the worker has sent is read (waiting for
        the first) and credited at once, as the server does."""
        if not self.queue:
            self.queue.append(self._read())
            while select.select([self.control], [], [], 0)[0]:
                self.queue.append(self._read())
            self.credit()
        return self.queue.popleft()

    def finish(self, *ids):
        """Reads responses until each of `ids` had its final one: ({id: its
        responses}, the ids of every response in the order they came)."""
        got, order = {i: [] for i in ids}, []
        while not all(got[i] and got[i][-1]["final"] for i in ids):
            m = self.next()
            assert m["id"] in got, f"a response to request {m['id']}"
            got[m["id"]].append(m)
            order.append(m["id"])
        return got, order

    def stream(self, inputs, parameters=None, resume=()):
        """A request run to its end: (the values of its responses that hold
        an output, its final response)."""
        rid = self.open(inputs, parameters, resume)
        return outcome(self.finish(rid)[0][rid])

    def close(self):
        self.control.close()  # the worker's next wait ends: it exits
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = "killed"
        self.log.close()
        return code


def outcome(responses):
    """A stream's responses: (the values of those that hold an output, the
    final one). A generator model's return is a final response of none."""
    assert responses[-1]["final"] and not any(m["final"] for m in responses[:-1])
    return [m["values"] for m in responses if any(m["present"])], responses[-1]


def sent(responses):
    """A stream's responses read by Driver as the stand-in Request's sent()
    has them: [({name: list}, final)]."""
    assert all(m["status"] == 0 for m in responses), responses[-1]["text"]
    return [({k: v for k, (v, _) in m["values"].items()}, m["final"]) for m in responses]


def texts(values):
    """Each response's text_output (None where it has none)."""
    return [v["text_output"][0][0] if "text_output" in v else None for v in values]


def io_config(name, max_batch_size, inputs, outputs, **parameters):
    """A config in Triton's JSON form; inputs and outputs (name, type[, dims]), dims [1] by default."""
    ios = lambda entries: [{"name": e[0], "data_type": e[1], "dims": list(e[2]) if len(e) > 2 else [1]}  # noqa: E731
                           for e in entries]
    return {"name": name, "backend": "python", "max_batch_size": max_batch_size,
            "input": ios(inputs), "output": ios(outputs),
            "parameters": {k: {"string_value": str(v)} for k, v in parameters.items()}}


TINY_IO = dict(inputs=[("text_input", "TYPE_STRING"), ("messages", "TYPE_STRING")],
               outputs=[("text_output", "TYPE_STRING"), ("prompt_tokens", "TYPE_INT64"),
                        ("completion_tokens", "TYPE_INT64"), ("finish_reason", "TYPE_STRING"),
                        ("token_ids", "TYPE_INT64", [-1])])

ECHO_IO = dict(inputs=[("text_input", "TYPE_STRING")],
               outputs=[("text_output", "TYPE_STRING"), ("count", "TYPE_INT64")])

# A stream of the request's parameters, then `pieces` pieces, then a count;
# parameters make it fail in the ways a model can.
ECHO_PY = '''
import json, os
import numpy as np

class Model:
    def initialize(self, args):
        self.lead = (1,) if args["model_config"]["max_batch_size"] > 0 else ()
        self.dir = args["model_repository"]

    def execute(self, inputs, parameters):
        text = inputs["text_input"].reshape(-1)[0]
        one = lambda v, t=object: np.array([v], dtype=t).reshape(self.lead + (1,))
        yield {"text_output": one(json.dumps(parameters, sort_keys=True).encode())}
        i = 0
        try:
            for i in range(int(parameters.get("pieces", 3))):
                if parameters.get("raise_at") == i:
                    raise RuntimeError(f"the model broke at piece {i}")
                if parameters.get("bad") == "name":
                    yield {"text_ouput": one(b"typo")}
                if parameters.get("bad") == "dtype":
                    yield {"count": one(1.5, np.float64)}
                if parameters.get("bad") == "shape":
                    yield {"count": np.array([[1, 2]], dtype=np.int64)}
                if parameters.get("bad") == "list":
                    yield [b"not a dict"]
                yield {"text_output": one(text + b"-%d" % i)}
        except GeneratorExit:
            open(os.path.join(self.dir, f"closed-{os.getpid()}-{i}"), "w").close()
            raise
        yield {"count": one(i + 1, np.int64)}
'''


def echoed(text, parameters, pieces):
    """The echo model's responses' text_output for a stream it ends itself."""
    return [json.dumps(parameters, sort_keys=True).encode()] + \
        [text + b"-%d" % i for i in range(pieces)] + [None]


@pytest.fixture(scope="module")
def stores(tmp_path_factory, repo):
    """A store holding the tiny decoder's weights and some weights for the echo model."""
    tmp = tmp_path_factory.mktemp("echo")
    echo = tmp / "echo" / "1"
    echo.mkdir(parents=True)
    subprocess.run([ht.CLI, "make-model", "scale", "--dims", "4", "--out",
                    str(echo / "model.safetensors")], check=True, capture_output=True)
    (echo / "model.py").write_text(ECHO_PY)
    with ht.running_store({"tiny": repo / "model.safetensors",
                           "echo": echo / "model.safetensors"}) as store:
        yield store, echo


@pytest.fixture
def echo_worker(stores, tmp_path):
    store, echo = stores
    for old in echo.glob("closed-*"):
        old.unlink()
    d = Driver(tmp_path, store, "echo", io_config("echo", 0, **ECHO_IO), echo)
    assert d.ready, d.start_error
    yield d
    assert d.close() == 0, d.log_text()


def prompt(text):
    return {"text_input": [text.encode()], "messages": [b""]}


def least_margin(exact, text, max_tokens):
    """How close the best two logits come over the greedy run of `text`, in float64."""
    ids, least = tiny.prompt_tokens(text), math.inf
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = exact(torch.tensor(ids, dtype=torch.long))[0][-1]
            best, second = torch.topk(logits, 2).values.tolist()
            least = min(least, best - second)
            ids.append(int(torch.argmax(logits)))
            if ids[-1] == tiny.EOS:
                break
    return least


@pytest.fixture(scope="module")
def steady(exact):
    """Prompts whose greedy run of 40 tokens never has its best two logits
    within 1e-3 of each other. The worker decodes in float32 like `decoder`,
    but a forward over two streams, or a prefill of resumed tokens, adds
    their terms in another order than the direct run alone: a few 1e-6, too
    little to change a token of these (see `exact`)."""
    found = [p for p in PROMPTS if least_margin(exact, p, 40) > 1e-3]
    assert len(found) >= 4, found
    return found


def test_the_worker_streams_what_the_direct_run_generates(stores, repo, decoder, tmp_path):
    store, _ = stores
    d = Driver(tmp_path, store, "tiny", io_config("tiny", 0, **TINY_IO), repo)
    assert d.ready, d.start_error
    assert d.streams == 1 and d.window >= 1  # max_streams: 1 unless the config says
    try:
        for text, parameters in [("Hello", {"max_tokens": 24}),
                                 ("The quick brown fox", {"max_tokens": 30, "stop": ["q", "zz"]}),
                                 ("Hello", {"max_tokens": 20, "temperature": 0.9, "seed": 11})]:
            responses, final = d.stream(prompt(text), parameters)
            assert final["status"] == 0, final["text"]
            want_pieces, want_last = direct(decoder, text, **parameters)
            got = [r["text_output"][0][0] for r in responses]
            assert got == want_pieces, (text, parameters)
            assert all(r["text_output"][1] == [1] for r in responses)
            # Token for token: the stream's token_ids are what the module generates directly.
            ids = tiny.prompt_tokens(text)
            sampled = {k: parameters[k] for k in ("temperature", "seed") if k in parameters}
            generated = list(tiny.tokens(decoder, ids, parameters["max_tokens"], **sampled))
            streamed = [t for r in responses for t in r["token_ids"][0]]
            assert streamed == generated[:want_last["completion_tokens"][0]], (streamed, generated)
            # Each response before the last is one piece and its tokens; the
            # last, the final one, adds the counts.
            assert all(set(r) == {"text_output", "token_ids"} for r in responses[:-1])
            last = responses[-1]
            assert last["prompt_tokens"][0] == want_last["prompt_tokens"].tolist()
            assert last["completion_tokens"][0] == want_last["completion_tokens"].tolist()
            assert last["finish_reason"][0] == want_last["finish_reason"].tolist()
        # The final response (five outputs of 64 bytes each at least) never
        # fits the first ring of 256 bytes: the worker asked for a larger one
        # while it was building it, and what it had built came along.
        assert d.ring_grows >= 1
        # A chat: messages (JSON text) through the template, text_input ignored.
        messages = [{"role": "user", "content": "Hi"}]
        responses, final = d.stream({"text_input": [b"ignored"],
                                     "messages": [json.dumps(messages).encode()]}, {"max_tokens": 12})
        assert final["status"] == 0, final["text"]
        want = bytes(t for t in tiny.tokens(decoder, tiny.prompt_tokens(tiny.chat_prompt(messages)), 12)
                     if t < 256)
        assert b"".join(r["text_output"][0][0] for r in responses) == want
        assert responses[-1]["prompt_tokens"][0] == [len(tiny.chat_prompt(messages)) + 1]
        # A request the model refuses is the client's fault, and the worker serves on.
        responses, final = d.stream(prompt("Hello"), {"temperature": 9})
        assert responses == [] and final["status"] == INVALID_ARGUMENT, final
        assert "temperature" in final["text"]
        responses, final = d.stream(prompt("Hello"), None)
        assert final["status"] == 0 and responses[-1]["completion_tokens"][0] == [16]  # the default
    finally:
        assert d.close() == 0, d.log_text()


def test_a_model_with_messages_alone_is_a_chat(stores, repo, decoder, tmp_path):
    store, _ = stores
    io = dict(TINY_IO, inputs=[("messages", "TYPE_STRING")])
    d = Driver(tmp_path, store, "tiny", io_config("tiny", 0, **io), repo)
    assert d.ready, d.start_error
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        responses, final = d.stream({"messages": [json.dumps(messages).encode()]}, {"max_tokens": 10})
        assert final["status"] == 0, final["text"]
        ids = tiny.prompt_tokens(tiny.chat_prompt(messages))
        assert [t for r in responses for t in r["token_ids"][0]] == list(tiny.tokens(decoder, ids, 10))
        responses, final = d.stream({"messages": [b""]}, {"max_tokens": 10})
        assert final["status"] == INVALID_ARGUMENT and "messages is not JSON" in final["text"]
    finally:
        assert d.close() == 0, d.log_text()


def test_two_streams_on_one_worker_interleave_each_as_its_direct_run(stores, repo, decoder, steady,
                                                                     tmp_path):
    store, _ = stores
    d = Driver(tmp_path, store, "tiny", io_config("tiny", 0, **TINY_IO, max_streams=2), repo)
    assert d.ready, d.start_error
    try:
        assert d.streams == 2
        cases = [(steady[0], {"max_tokens": 30}), (steady[1], {"max_tokens": 24})]
        a, b = (d.open(prompt(text), parameters) for text, parameters in cases)
        got, order = d.finish(a, b)
        for (text, parameters), rid in zip(cases, (a, b)):
            assert sent(got[rid]) == alone(decoder, text, parameters).sent(), (text, parameters)
        # Answered together: b's first response came before a's last, and a
        # sent responses while b was going. (Deterministic: the worker sends
        # at most its window of responses before a credit, and b was opened
        # before the first credit; a sends 31.)
        b_first, b_last = order.index(b), len(order) - 1 - order[::-1].index(b)
        assert b_first < len(order) - 1 - order[::-1].index(a), order
        assert a in order[b_first:b_last], order
    finally:
        assert d.close() == 0, d.log_text()


def test_responses_not_yet_taken_keep_their_bytes(stores, repo, decoder, steady, tmp_path):
    store, _ = stores
    d = Driver(tmp_path, store, "tiny", io_config("tiny", 0, **TINY_IO), repo, ring=64 << 10)
    assert d.ready, d.start_error
    try:
        parameters = {"max_tokens": 40}
        rid = d.open(prompt(steady[0]), parameters)
        # As many as the worker may send before a credit, each in a place of
        # its own in the ring: none was written over by a later one.
        held = d.take(d.window)
        assert d.untaken_unchanged()
        d.credit()
        got, _ = d.finish(rid)
        assert sent(held + got[rid]) == alone(decoder, steady[0], parameters).sent()
    finally:
        assert d.close() == 0, d.log_text()


@pytest.mark.parametrize("stop", [False, True], ids=["length", "stop"])
def test_a_resumed_request_goes_on_where_the_direct_run_was(stores, repo, decoder, steady, tmp_path,
                                                            stop):
    store, _ = stores
    config = io_config("tiny", 0, **TINY_IO, max_streams=4, resumable="true")
    d = Driver(tmp_path, store, "tiny", config, repo)
    assert d.ready, d.start_error
    try:
        text, parameters = steady[2], {"max_tokens": 30}
        if stop:  # a stop string the uninterrupted run meets first at its 18th token or later
            run = greedy_text(decoder, text, 40)
            at = next(p for p in range(15, 37) if run.index(run[p:p + 3]) == p)
            parameters = {"max_tokens": 40, "stop": run[at:at + 3]}
        whole = alone(decoder, text, parameters).sent()
        n = len(whole)
        assert whole[-1][0]["finish_reason"] == [b"stop" if stop else b"length"] and n > 10
        # Cut after the first response, half way, and right before the last;
        # all resumed at once, beside a stream that starts afresh.
        cuts = [1, n // 2, n - 1]
        ids = [d.open(prompt(text), parameters,
                      resume=[t for out, _ in whole[:k] for t in out["token_ids"]]) for k in cuts]
        fresh = d.open(prompt(steady[3]), {"max_tokens": 20})
        got, _ = d.finish(*ids, fresh)
        for k, rid in zip(cuts, ids):
            # Not a byte of the text sent before the cut comes again.
            assert sent(got[rid]) == whole[k:], k
        assert sent(got[fresh]) == alone(decoder, steady[3], {"max_tokens": 20}).sent()
    finally:
        assert d.close() == 0, d.log_text()


def test_a_cancelled_stream_ends_and_the_other_goes_on(stores, repo, decoder, steady, tmp_path):
    store, _ = stores
    markers = tmp_path / "markers"
    markers.mkdir()
    config = io_config("tiny", 0, **TINY_IO, max_streams=2, closed_marker_dir=markers)
    d = Driver(tmp_path, store, "tiny", config, repo)
    assert d.ready, d.start_error
    try:
        (a_text, a_parameters), (b_text, b_parameters) = cases = \
            [(steady[0], {"max_tokens": 40}), (steady[1], {"max_tokens": 30})]
        # Each of a's responses holds one token: the model's marker counts them.
        assert all(len(out["token_ids"]) == 1
                   for out, _ in alone(decoder, a_text, a_parameters).sent()[:-1])
        a, b = (d.open(prompt(text), parameters) for text, parameters in cases)
        got = {a: [], b: []}
        while len(got[a]) < 3:
            m = d.next()
            got[m["id"]].append(m)
        d.cancel(a)
        more, _ = d.finish(a, b)
        got = {k: got[k] + more[k] for k in got}
        # a got a final response (after what it sent before it saw the
        # cancel), long before its end.
        whole = alone(decoder, a_text, a_parameters).sent()
        assert got[a][-1]["final"] and got[a][-1]["status"] == 0
        assert len(got[a]) < len(whole)
        assert sent(got[a][:-1]) == whole[:len(got[a]) - 1]
        assert sent(got[b]) == alone(decoder, b_text, b_parameters).sent()
        # The model dropped a at its next step, b going on.
        sent_by_a = sum(len(m["values"]["token_ids"][0]) for m in got[a][:-1])
        assert [p.name for p in markers.iterdir()] == [f"closed-{d.proc.pid}-{sent_by_a}"]
        # Its place went to the next.
        c = d.open(prompt(steady[2]), {"max_tokens": 12})
        assert sent(d.finish(c)[0][c]) == alone(decoder, steady[2], {"max_tokens": 12}).sent()
    finally:
        assert d.close() == 0, d.log_text()


def test_cancel_closes_the_generator_and_frees_the_worker(echo_worker, stores):
    _, echo = stores
    d = echo_worker
    rid = d.open({"text_input": [b"x"]}, {"pieces": 100})
    seen = [d.next()]
    while texts([seen[-1]["values"]]) != [b"x-2"]:
        seen.append(d.next())
    d.cancel(rid)
    seen += d.finish(rid)[0][rid]
    assert seen[-1]["final"] and seen[-1]["status"] == 0
    assert not any(m["final"] for m in seen[:-1])
    pieces = texts([m["values"] for m in seen[1:-1]])
    assert pieces == [b"x-%d" % i for i in range(len(pieces))]
    y = d.open({"text_input": [b"y"]}, {"pieces": 2})
    responses, final = outcome(d.finish(y)[0][y])
    assert final["status"] == 0
    assert texts(responses) == echoed(b"y", {"pieces": 2}, 2)
    assert responses[-1]["count"] == ([2], [1])
    # The generator was closed at its yield after the last piece it sent
    # (GeneratorExit ran its handler), before the worker took the next request.
    assert [p.name for p in echo.glob("closed-*")] == [f"closed-{d.proc.pid}-{len(pieces) - 1}"]
    # A cancel that crossed the final response on the wire changes nothing:
    # no response to y comes (Driver checks each is to an open request).
    d.cancel(y)
    responses, final = d.stream({"text_input": [b"z"]}, {"pieces": 1})
    assert final["status"] == 0 and texts(responses) == echoed(b"z", {"pieces": 1}, 1)


def test_a_generator_models_streams_interleave_when_it_holds_two(stores, tmp_path):
    store, echo = stores
    d = Driver(tmp_path, store, "echo", io_config("echo", 0, **ECHO_IO, max_streams=2), echo)
    assert d.ready, d.start_error
    try:
        assert d.streams == 2
        a = d.open({"text_input": [b"a"]}, {"pieces": 40})
        b = d.open({"text_input": [b"b"]}, {"pieces": 5})
        got, order = d.finish(a, b)
        for rid, text, pieces in [(a, b"a", 40), (b, b"b", 5)]:
            responses, final = outcome(got[rid])
            assert final["status"] == 0 and final["present"] == [0, 0]
            assert texts(responses) == echoed(text, {"pieces": pieces}, pieces)
            assert responses[-1]["count"] == ([pieces], [1])
        # Each generator is advanced by one response in turn: from b's first
        # response to its final one, a's and b's alternate. (b was opened
        # before the first credit, so the worker saw it within its window
        # of a's 43 responses.)
        b_first, b_last = order.index(b), len(order) - 1 - order[::-1].index(b)
        assert order[b_first:b_last + 1] == [b, a] * 7 + [b], order
    finally:
        assert d.close() == 0, d.log_text()


def test_an_exception_mid_stream_ends_it_with_its_last_line(echo_worker):
    d = echo_worker
    responses, final = d.stream({"text_input": [b"x"]}, {"pieces": 5, "raise_at": 2})
    assert texts(responses[1:]) == [b"x-0", b"x-1"]
    assert final["status"] == INTERNAL and final["present"] == [0, 0]
    assert final["text"] == "RuntimeError: the model broke at piece 2"
    assert "Traceback" in d.log_text()
    responses, final = d.stream({"text_input": [b"x"]}, {"pieces": 1})
    assert final["status"] == 0 and len(responses) == 3


@pytest.mark.parametrize("bad, says", [
    ("name", "execute() yielded output 'text_ouput', which the config does not declare"),
    ("dtype", "output 'count' has dtype float64; the config says int64"),
    ("shape", "'count'"),
    ("list", "execute() yielded list, not a dict of outputs"),
])
def test_a_yield_that_fails_its_checks_ends_the_stream_naming_it(echo_worker, stores, bad, says):
    _, echo = stores
    d = echo_worker
    responses, final = d.stream({"text_input": [b"x"]}, {"bad": bad})
    assert len(responses) == 1  # the parameters
    assert final["status"] == INVALID_ARGUMENT and says in final["text"], final["text"]
    _, final = d.stream({"text_input": [b"x"]}, {"pieces": 1})
    assert final["status"] == 0
    # The generator was closed, by the time the worker took the next request.
    assert [p.name for p in echo.glob("closed-*")] == [f"closed-{d.proc.pid}-0"]


def test_the_requests_parameters_arrive_as_sent(echo_worker):
    d = echo_worker
    given = {"max_tokens": 3, "temperature": 0.25, "stop": ["\n", "</s>"], "stream": True,
             "custom": {"nested": [1, None]}, "name": "caf\u00e9", "pieces": 0}
    responses, final = d.stream({"text_input": [b"x"]}, given)
    assert final["status"] == 0
    assert json.loads(responses[0]["text_output"][0][0]) == given
    responses, _ = d.stream({"text_input": [b"x"]}, None)  # none: {}
    assert json.loads(responses[0]["text_output"][0][0]) == {}
    responses, final = d.stream({"text_input": [b"x"]}, [1, 2])  # not an object
    assert responses == [] and final["status"] == INVALID_ARGUMENT and "not an object" in final["text"]


def test_a_batching_decoupled_model_has_a_batch_dimension_of_one(stores, tmp_path):
    store, echo = stores
    d = Driver(tmp_path, store, "echo", io_config("echo", 4, **ECHO_IO), echo)
    assert d.ready, d.start_error
    try:
        responses, final = d.stream({"text_input": [b"x"]}, {"pieces": 1})
        assert final["status"] == 0, final["text"]
        assert responses[1]["text_output"] == ([b"x-0"], [1, 1])
        assert responses[2]["count"] == ([1], [1, 1])
    finally:
        assert d.close() == 0


def test_a_batch_model_runs_batches(stores, tmp_path):
    store, _ = stores
    version = tmp_path / "1"
    version.mkdir()
    (version / "model.py").write_text(
        "import numpy as np\n"
        "class Model:\n    def initialize(self, args): pass\n"
        "    def execute(self, inputs):\n"
        "        t = inputs['text_input']\n"
        "        return {'text_output': np.array([[e[::-1] for e in row] for row in t], dtype=object),\n"
        "                'count': np.array([[len(row[0])] for row in t], dtype=np.int64)}\n")
    d = Driver(tmp_path, store, "echo", io_config("echo", 4, **ECHO_IO), version, decoupled=False)
    assert d.ready, d.start_error
    try:
        done = d.run({"text_input": [b"hearth"]})
        assert done["status"] == 0, done["text"]
        assert done["values"] == {"text_output": ([b"htraeh"], [1, 1]), "count": ([6], [1, 1])}
    finally:
        assert d.close() == 0, d.log_text()


@pytest.mark.parametrize("decoupled, code, parameters, says", [
    (True, "class Model:\n    def initialize(self, args): pass\n"
           "    def execute(self, inputs, parameters): return {}\n", {},
     "this execute takes 2 arguments and does not yield"),
    (False, "class Model:\n    def initialize(self, args): pass\n"
            "    def execute(self, inputs):\n        yield {}\n", {},
     "Model.execute is a generator function (it yields), but the model is not decoupled"),
    # A stream resumes through Request.resume_token_ids, which a generator never sees.
    (True, ECHO_PY, {"resumable": "true"}, "parameters.resumable"),
], ids=["decoupled-returns", "batched-yields", "resumable-generator"])
def test_execute_must_match_the_transaction_policy(stores, tmp_path, decoupled, code, parameters, says):
    store, _ = stores
    version = tmp_path / "1"
    version.mkdir()
    (version / "model.py").write_text(code)
    config = io_config("echo", 0, **ECHO_IO, **parameters)
    d = Driver(tmp_path, store, "echo", config, version, decoupled=decoupled)
    assert not d.ready
    assert d.start_error["status"] == INVALID_ARGUMENT
    assert says in d.start_error["text"], d.start_error["text"]
    assert d.close() == 1


# ---- examples/generate/llama ------------------------------------------------------------


class ByteTokenizer:
    """Decodes as a byte-level tokenizer does: ids are bytes, 256 and above are special."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_the_llama_detokenizer_never_splits_a_character():
    text = "h\u00e9llo \u20ac\U0001F600!"
    d = llama.Detokenizer(ByteTokenizer())
    pieces = [d.add(b) for b in text.encode()]
    assert all("\ufffd" not in p for p in pieces)
    assert [p for p in pieces if p] == ["h", "\u00e9", "l", "l", "o", " ", "\u20ac", "\U0001F600", "!"]
    assert d.flush() == ""
    d = llama.Detokenizer(ByteTokenizer())
    assert d.add(0xE2) == "" and d.add(0x82) == "" and d.flush() == "\ufffd"


def test_the_llama_stop_strings():
    s = llama.StopStrings(["</s>", "\n\n"])
    assert s.feed("Hello <") == "Hello "
    assert s.feed("/") == ""
    assert s.feed("x") == "</x"
    assert s.feed("end\n") == "end"
    assert s.feed("\nmore") == "" and s.stopped and s.flush() == ""
    with pytest.raises(hearth_invalid_argument()):
        llama.sampling({"stop": ["a"] * 5}, 100)
    assert llama.sampling({}, 100) == (16, 0.0, 1.0, None, [])
    assert llama.sampling({"max_tokens": 100, "stop": "x"}, 100)[::4] == (100, ["x"])


def hearth_invalid_argument():
    import hearth
    return hearth.InvalidArgument


def test_a_draw_seed_is_a_function_of_seed_and_position_alone():
    seeds = {(seed, p): llama.draw_seed(seed, p) for seed in (0, 1, 7, 2**63 - 1) for p in range(64)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= v < 2**64 for v in seeds.values())
    assert llama.draw_seed(7, 3) == seeds[(7, 3)]
    # splitmix64 from state 0: its first output, the published test value.
    assert llama.draw_seed(0, 0) == 0xE220A8397B1DCDAF


# The many-streams Model here, without transformers: a stand-in causal LM whose
# attention layers call the function registered under config._attn_implementation
# in (a stand-in of) transformers' AttentionInterface, with query, key and value
# laid out as transformers gives them and the forward's keywords passed through.
# Its "eager" attention is plain causal attention over the forward's own tokens:
# the reference, a full forward per token, that the Model's batched, cached
# decoding must equal token for token.

BOS, EOS, VOCAB = 256, 257, 258


class AttentionInterface:
    """transformers.AttentionInterface's contract: register() is global."""

    functions = {}

    @classmethod
    def register(cls, key, value):
        cls.functions[key] = value


def eager_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = query @ key.transpose(2, 3) * scaling
    t = scores.shape[-1]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2), None


AttentionInterface.functions["eager"] = eager_attention


def reference_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention by its definition (torch < 2 lacks it)."""
    if enable_gqa:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, -3), value.repeat_interleave(group, -3)
    scores = query @ key.transpose(-2, -1) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        q, k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(q, k, dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    return scores.softmax(-1) @ value


def rotate(x, positions):
    """Rotary positions: x [B, heads, T, head_dim] at positions [B, T]."""
    half = x.shape[-1] // 2
    angles = positions[:, None, :, None].float() / 10000 ** (torch.arange(half) / half)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class StandInAttention(torch.nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = torch.nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim)
        self.k_proj = torch.nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.v_proj = torch.nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.o_proj = torch.nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size)

    def forward(self, x, position_ids, **kwargs):
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q = rotate(self.q_proj(x).view(shape).transpose(1, 2), position_ids)
        k = rotate(self.k_proj(x).view(shape).transpose(1, 2), position_ids)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        attend = AttentionInterface.functions[self.config._attn_implementation]
        out, _ = attend(self, q, k, v, None, dropout=0.0, scaling=self.scaling,
                        position_ids=position_ids, **kwargs)
        return self.o_proj(out.reshape(b, t, -1))


class StandInLlama(torch.nn.Module):
    """A small grouped-query decoder (4 query heads on 2 key/value heads) with
    random weights whose head writes printable ASCII only: one character a token
    (seed 2: weights whose greedy text varies rather than repeating one character)."""

    def __init__(self, seed=2, hidden=32, layers=2, heads=4, kv_heads=2, positions=512):
        import types
        super().__init__()
        self.config = types.SimpleNamespace(
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=hidden // heads, hidden_size=hidden, max_position_embeddings=positions,
            _attn_implementation="eager")
        self.generation_config = types.SimpleNamespace(eos_token_id=EOS)
        self.embed_tokens = torch.nn.Embedding(VOCAB, hidden)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(hidden) for _ in range(layers + 1))
        self.layers = torch.nn.ModuleList(StandInAttention(self.config, i) for i in range(layers))
        self.lm_head = torch.nn.Linear(hidden, VOCAB)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.lm_head.bias[:] = -1e4
            self.lm_head.bias[0x20:0x7f] = torch.randn(0x7f - 0x20, generator=g)

    @property
    def device(self):
        return self.lm_head.weight.device

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_attn_implementation(self, name):
        if name not in AttentionInterface.functions:
            raise ValueError(f"no attention {name!r}")
        self.config._attn_implementation = name

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        import types
        assert past_key_values is None and not use_cache, "the Model keeps the cache itself"
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)
        x = self.embed_tokens(input_ids)
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x), position_ids, **kwargs)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return types.SimpleNamespace(logits=self.lm_head(self.norms[-1](x)))


class AsciiTokenizer(ByteTokenizer):
    """BOS, then the text's bytes; no chat template."""

    eos_token_id = EOS
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([BOS] if add_special_tokens else []) + list(text.encode())}


def full_forward_tokens(model, prompt, n):
    """Greedy decoding the plain way: the whole sequence through `model` per token."""
    ids, out = [BOS] + list(prompt.encode()), []
    with torch.no_grad():
        for _ in range(n):
            token = int(torch.argmax(model(torch.tensor([ids])).logits[0, -1]))
            out.append(token)
            if token == EOS:
                break
            ids.append(token)
    return out


class LlamaRequest:
    """A stand-in for hearth.Request, as the worker makes them: records what the model sends."""

    def __init__(self, text, resume=(), messages=b"", **parameters):
        self.id = ""
        self.inputs = {"text_input": np.array([text.encode()], dtype=object),
                       "messages": np.array([messages], dtype=object)}
        self.parameters = parameters
        self.resume_token_ids = list(resume)
        self.responses, self.error, self.final, self.cancelled = [], None, False, False
        self.sent_after_cancel = 0

    def is_cancelled(self):
        return self.cancelled

    def send(self, outputs=None, final=False):
        assert not self.final and self.error is None, "a response after the stream ended"
        if self.cancelled:
            self.sent_after_cancel += 1
            return False
        self.responses.append({k: v.tolist() for k, v in (outputs or {}).items()})
        self.final = final
        return True

    def fail(self, exception):
        assert not self.final and self.error is None and not self.responses
        self.error = exception

    @property
    def done(self):
        return self.final or self.error is not None or self.cancelled

    def tokens(self):
        return [t for r in self.responses for t in r.get("token_ids", [])]

    def text(self):
        return b"".join(r["text_output"][0] for r in self.responses).decode()


def run(model, arrivals, cancel=None, max_steps=400):
    """Drives `model` as the worker does: arrivals {step: [LlamaRequest]} are given
    to execute() before that step; step() is called while one is unfinished.
    cancel {step: [LlamaRequest]} cancels before a step. Checks after every step
    that the active streams fill rows [0, B) of at most max_streams."""
    given, cancel = [], cancel or {}
    for i in range(max_steps):
        for r in cancel.get(i, []):
            r.cancelled = True
        if i in arrivals:
            model.execute(arrivals[i])
            given += arrivals[i]
        if all(r.done for r in given) and max(arrivals) <= i:
            return i
        model.step()
        assert len(model.rows) <= model.max_streams
        assert [s.row for s in model.rows] == list(range(len(model.rows)))
    raise AssertionError(f"not done after {max_steps} steps")


@pytest.fixture
def stand_in(monkeypatch):
    """(reference, serve): the stand-in model, and serve(max_streams, **config
    parameters) -> a Model bound to a copy of it, transformers stood in for."""
    import copy
    import types
    fake = types.ModuleType("transformers")
    fake.AttentionInterface = AttentionInterface
    monkeypatch.setitem(sys.modules, "transformers", fake)
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", reference_sdpa,
                            raising=False)
    torch.set_num_threads(1)
    reference = StandInLlama().eval()

    def serve(max_streams, model=None, **parameters):
        m = llama.Model()
        m.bind(copy.deepcopy(model or reference), AsciiTokenizer(),
               io_config("llama", 0, **TINY_IO, **parameters), max_streams)
        return m

    return reference, serve


def test_llama_streams_decoded_together_each_equal_a_full_forward_per_token(stand_in):
    reference, serve = stand_in
    m = serve(max_streams=3)
    asked = [("a", 20), ("Hello, world", 7), ("The quick brown fox jumps over the lazy dog", 25),
             ("x" * 40, 12), ("many streams, one forward", 30), ("0123456789" * 3, 3)]
    requests = [LlamaRequest(p, max_tokens=n) for p, n in asked]
    gone = LlamaRequest("cancelled at step 4", max_tokens=50)
    # More streams than rows: some wait; they end at different steps (the
    # cancelled one in row 0), so rows move.
    run(m, {0: [gone] + requests[:4], 2: requests[4:]}, cancel={4: [gone]})
    for (prompt, n), r in zip(asked, requests):
        want = full_forward_tokens(reference, prompt, n)
        assert len(want) == n and EOS not in want, "pick prompts whose greedy runs do not end by themselves"
        assert r.final and r.tokens() == want, (prompt, r.tokens(), want)
        assert r.text() == bytes(want).decode()
        assert all(len(x["token_ids"]) == 1 for x in r.responses[:-1])  # ASCII: a piece a token
        last = r.responses[-1]
        assert last["prompt_tokens"] == [len(prompt) + 1] and last["completion_tokens"] == [n]
        assert last["finish_reason"] == [b"length"]
    # The cancelled stream was dropped at the next step (nothing more computed
    # or sent for it), and holds no row.
    assert not gone.final and 0 < len(gone.responses) < 50 and gone.sent_after_cancel == 0
    assert gone.tokens() == full_forward_tokens(reference, gone.inputs["text_input"][0].decode(),
                                                len(gone.responses))
    assert m.rows == [] and m.waiting == []


def _cut_and_resumed(serve, prompt, **parameters):
    """A stream run whole, then resumed at each of its response boundaries (all
    together in one Model): (the whole run's responses, [(k, the stream
    resumed after k responses)])."""
    whole = LlamaRequest(prompt, **parameters)
    run(serve(max_streams=1), {0: [whole]})
    assert len(whole.responses) > 3
    resumed = [(k, LlamaRequest(prompt, resume=[t for x in whole.responses[:k] for t in x["token_ids"]],
                           **parameters)) for k in range(len(whole.responses))]
    run(serve(max_streams=len(resumed)), {0: [r for _, r in resumed]})
    return whole.responses, resumed


@pytest.mark.parametrize("parameters", [
    {"max_tokens": 24},
    {"max_tokens": 40, "temperature": 0.8, "top_p": 0.9, "seed": 3},
])
def test_llama_a_resumed_stream_sends_what_the_whole_one_sent_after_the_cut(stand_in, parameters):
    _, serve = stand_in
    whole, resumed = _cut_and_resumed(serve, "Hello, world", **parameters)
    for k, r in resumed:
        # Its responses are the whole run's after the k its client had: no text
        # again, the counts of the whole stream.
        assert r.responses == whole[k:], k


def test_llama_a_resumed_stream_keeps_its_stop_string_state(stand_in):
    reference, serve = stand_in
    text = bytes(full_forward_tokens(reference, "Hello, world", 40)).decode()
    stop = text[20:23]
    # The second stop string never completes (the model writes no \x01), but
    # text[9:11] starts it: that text is held back until the next token.
    whole, resumed = _cut_and_resumed(serve, "Hello, world", max_tokens=40,
                                      stop=[stop, text[9:11] + "\x01"])
    assert b"".join(x["text_output"][0] for x in whole).decode() == text[:text.find(stop)]
    assert whole[-1]["finish_reason"] == [b"stop"]
    # Some cuts fall where text is held back (sent tokens, their text not yet
    # all sent): the resumed stream must hold it back too, then send it.
    held = [k for k in range(len(whole))
            if sum(len(x["text_output"][0]) for x in whole[:k]) <
            sum(len(x["token_ids"]) for x in whole[:k])]
    assert held, whole
    for k, r in resumed:
        assert r.responses == whole[k:], k


def test_llama_resumed_tokens_that_end_the_stream_get_its_final_response_at_once(stand_in):
    reference, serve = stand_in
    want = full_forward_tokens(reference, "Hello, world", 10)
    m = serve(max_streams=2)
    r = LlamaRequest("Hello, world", resume=want, max_tokens=10)
    m.execute([r])
    assert r.final and r.responses == [{"text_output": [b""], "token_ids": [], "prompt_tokens": [13],
                                        "completion_tokens": [10], "finish_reason": [b"length"]}]
    assert m.waiting == []
    text = bytes(want).decode()
    stop = next(text[-n:] for n in range(2, 11) if text.find(text[-n:]) == len(text) - n)
    r = LlamaRequest("Hello, world", resume=want, max_tokens=20, stop=stop)
    m.execute([r])
    assert r.final and r.responses[-1]["finish_reason"] == [b"stop"]
    # Tokens past the end cannot be what a client got.
    r = LlamaRequest("Hello, world", resume=want + want, max_tokens=10)
    m.execute([r])
    assert isinstance(r.error, hearth_invalid_argument()) and "resume_token_ids" in str(r.error)


def test_llama_seeded_sampling_draws_the_same_alone_and_among_other_streams(stand_in):
    _, serve = stand_in
    sampled = dict(max_tokens=30, temperature=1.0, seed=11)
    alone = LlamaRequest("Hello, world", **sampled)
    run(serve(max_streams=1), {0: [alone]})
    together = LlamaRequest("Hello, world", **sampled)
    others = [LlamaRequest(p, max_tokens=n, temperature=t, seed=5) for p, n, t in
              [("a", 8, 0.0), ("The quick brown fox", 40, 1.5), ("zz", 12, 0.0)]]
    run(serve(max_streams=4), {0: others[:2], 3: [together, others[2]]})
    assert together.tokens() == alone.tokens()
    greedy = LlamaRequest("Hello, world", max_tokens=30)
    run(serve(max_streams=1), {0: [greedy]})
    assert alone.tokens() != greedy.tokens(), "sampling at temperature 1 chose the greedy path"
    again = LlamaRequest("Hello, world", **dict(sampled, seed=12))
    run(serve(max_streams=1), {0: [again]})
    assert again.tokens() != alone.tokens()


def test_llama_eos_ends_a_stream_as_a_stop(stand_in):
    reference, serve = stand_in
    import copy
    eager = copy.deepcopy(reference)
    with torch.no_grad():
        eager.lm_head.bias[EOS] = 1e4  # EOS is always the most likely token
    m = serve(max_streams=2, model=eager)
    r = LlamaRequest("Hello", max_tokens=10)
    run(m, {0: [r]})
    assert r.responses == [{"text_output": [b""], "token_ids": [EOS], "prompt_tokens": [6],
                            "completion_tokens": [1], "finish_reason": [b"stop"]}]


def test_llama_refuses_a_model_whose_attention_it_cannot_replace(stand_in):
    import copy
    import types
    reference, serve = stand_in
    stubborn = copy.deepcopy(reference)
    for layer in stubborn.layers:  # their own config: "eager" whatever the model's says
        layer.config = types.SimpleNamespace(**vars(reference.config))
    with pytest.raises(RuntimeError, match="0 of its 2 layers"):
        serve(max_streams=2, model=stubborn)


@pytest.mark.parametrize("request_args, named", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": 5}, "temperature"), ({"top_p": 0}, "top_p"), ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop": ["a"] * 5}, "stop"),
    ({"max_tokens": 600}, "positions"),  # the stand-in has 512
    ({"resume": [VOCAB]}, "resume_token_ids"), ({"resume": [-1]}, "resume_token_ids"),
    ({"resume": [True]}, "resume_token_ids"),
    ({"text": ""}, "empty"), ({"messages": b'[{"role": "user", "content": "Hi"}]'}, "chat template"),
    ({"messages": b"not json"}, "not JSON"),
])
def test_llama_refuses_a_bad_request_naming_it_and_serves_the_others(stand_in, request_args, named):
    reference, serve = stand_in
    m = serve(max_streams=2)
    request_args = dict(request_args)
    bad = LlamaRequest(request_args.pop("text", "Hello"), resume=request_args.pop("resume", ()),
                  messages=request_args.pop("messages", b""), **request_args)
    good = LlamaRequest("Hello", max_tokens=5)
    run(m, {0: [bad, good]})
    assert isinstance(bad.error, hearth_invalid_argument()) and named in str(bad.error), bad.error
    assert bad.responses == []
    assert good.tokens() == full_forward_tokens(reference, "Hello", 5)


# ---- examples/generate/llama with transformers (the GPU machine) ----------------------------


@pytest.fixture(scope="module")
def llama_store(tmp_path_factory):
    """A checkpoint with random weights in float32, and a store holding it.

    float32, not the bf16 of make_checkpoint.py: the streams decoded together
    go through other kernels (matrices of B rows, a masked attention over the
    batch) than generate() decoding one prompt, and the sums round
    differently; in bf16 that difference can flip the argmax of two logits
    that nearly tie, in float32 (TF32 off) it is far below any gap seen."""
    if TRANSFORMERS_MISSING:
        pytest.skip(TRANSFORMERS_MISSING)
    tmp = tmp_path_factory.mktemp("llama")
    version = llama_repository.write(tmp / "repo", workers=1,
                                     kind="KIND_GPU" if ht.ON_CUDA else "KIND_CPU",
                                     max_streams=4, dtype="float32")
    with ht.running_store({"llama": version}) as store:
        yield store, version


def _reference(version):
    """transformers' own model of the checkpoint (from_pretrained, float32) and its tokenizer."""
    import transformers
    device = "cuda:0" if ht.ON_CUDA else "cpu"
    major_minor = tuple(int("".join(c for c in part if c.isdigit()) or 0)
                        for part in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if major_minor >= (4, 56) else "torch_dtype"  # renamed in 4.56
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(version), **{dtype_key: torch.float32}).to(device).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(version))


def _generate(model, tokenizer, ids, max_new_tokens):
    ids = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_llama_streams_decoded_together_each_equal_what_generate_picks(llama_store):
    """One Model (a worker's) over the store's weights, built by initialize()
    as the worker does: prompts of different lengths arriving at different
    steps, more than its 4 rows, ending at different steps, one resumed, each
    stream token for token what transformers' generate(do_sample=False)
    picks for its prompt alone."""
    import hearth
    store, version = llama_store
    reference, tokenizer = _reference(version)
    m = llama.Model()
    config = io_config("llama", 0, **TINY_IO, max_streams=4, resumable="true")
    m.initialize({"model_repository": str(version), "model_config": config, "max_streams": 4,
                  "weights": hearth.attach("llama", socket=store.socket)})
    assert m.model.config._attn_implementation == llama.ROW_ATTENTION
    asked = [("one copy of the weights", 24), ("a", 9),
             ("hello hearth, hello world, hello again " * 6, 31),
             ("The quick brown fox jumps over the lazy dog.", 16),
             ("a worker that crashes loses nothing", 5), ("Large language models " * 3, 28)]
    requests = [LlamaRequest(p, max_tokens=n) for p, n in asked]
    want = [_generate(reference, tokenizer, tokenizer(p)["input_ids"], n) for p, n in asked]
    cut = 6
    resumed = LlamaRequest(asked[0][0], resume=want[0][:cut], max_tokens=asked[0][1])
    run(m, {0: requests[:4], 3: requests[4:], 5: [resumed]})
    for (prompt, n), r, w in zip(asked, requests, want):
        assert r.final and r.tokens() == w, (prompt, r.tokens(), w)
        assert r.text() == tokenizer.decode(w, skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False)
        last = r.responses[-1]
        assert last["prompt_tokens"] == [len(tokenizer(prompt)["input_ids"])]
        assert last["completion_tokens"] == [len(w)]
        eos = reference.generation_config.eos_token_id
        ended = w[-1] in (eos if isinstance(eos, list) else [eos])
        assert last["finish_reason"] == [b"stop" if ended else b"length"]
    assert resumed.tokens() == want[0][cut:]
    assert resumed.responses[-1]["completion_tokens"] == [len(want[0])]
    assert m.rows == [] and m.waiting == []


def test_llama_streams_token_for_token_what_generate_picks(llama_store, tmp_path):
    """Greedy, through a worker process: the stream (token_ids, text) equals
    transformers' generate(do_sample=False) of the same checkpoint loaded the
    usual way, for a prompt and for a chat; sampling with a seed repeats itself."""
    store, version = llama_store
    outputs = TINY_IO["outputs"]
    d = Driver(tmp_path, store, "llama",
               io_config("llama", 0, TINY_IO["inputs"], outputs, max_streams=4, resumable="true"),
               version)
    assert d.ready, d.start_error
    try:
        reference, tokenizer = _reference(version)
        messages = [{"role": "user", "content": "hello hearth"}]
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        for prompt, inputs in [
                ("one copy of the weights", {"text_input": [b"one copy of the weights"], "messages": [b""]}),
                (None, {"text_input": [b""], "messages": [json.dumps(messages).encode()]})]:
            ids = (tokenizer(prompt) if prompt is not None else
                   tokenizer(chat, add_special_tokens=False))["input_ids"]
            want = _generate(reference, tokenizer, ids, 24)
            responses, done = d.stream(inputs, {"max_tokens": 24})
            assert done["status"] == 0, done["text"]
            got = [t for r in responses for t in r["token_ids"][0]]
            assert got == want, (prompt, got, want)
            text = b"".join(r["text_output"][0][0] for r in responses).decode()
            assert text == tokenizer.decode(want, skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False)
            last = responses[-1]
            assert last["prompt_tokens"][0] == [len(ids)]
            assert last["completion_tokens"][0] == [len(want)]
            eos = reference.generation_config.eos_token_id
            ended = want[-1] in (eos if isinstance(eos, list) else [eos])
            assert last["finish_reason"][0] == [b"stop" if ended else b"length"]
        # Sampling with a seed repeats itself.
        first = d.stream({"text_input": [b"hello"], "messages": [b""]},
                         {"max_tokens": 16, "temperature": 1.0, "seed": 5})[0]
        again = d.stream({"text_input": [b"hello"], "messages": [b""]},
                         {"max_tokens": 16, "temperature": 1.0, "seed": 5})[0]
        assert [r["token_ids"] for r in first] == [r["token_ids"] for r in again]
    finally:
        assert d.close() == 0, d.log_text()
