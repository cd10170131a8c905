"""A tiny byte-level, decoder-only transformer in plain torch, served as a decoupled model.

`backend: python` with `model_transaction_policy: {decoupled: true}`: execute
is a generator that yields one response per generated token. The module
(TinyDecoder), its decoding loop (tokens) and its detokenizer (TextStream)
are plain functions and classes, so that a test can run the very same code
without a server and compare token for token.

Tokens: bytes 0-255 are themselves; BOS = 256 starts every prompt and
EOS = 257 ends a generation. The prompt's UTF-8 bytes are its tokens.

The version directory holds `config.json` (dim, layers, heads,
max_positions) and `model.safetensors` (loaded by the store, handed over as
args["weights"], bound without a copy); make_repository.py writes both.

Inputs (config.yaml): `text_input` (BYTES [1]) and/or `messages` (BYTES [1],
an OpenAI chat's messages as JSON text). When `messages` is declared and
holds something (or is the only input), the prompt is the chat template
applied to it, and text_input is ignored:

    for each message: "<role>: <content>\\n"    then    "assistant: "

(content a string, or a list of {"type": "text", "text": ...} parts).

Parameters (the request's): max_tokens (default 16), temperature (0: greedy,
the default), top_p (1), seed (sampling is repeatable with one; without,
each request draws its own), stop (a string or a list of up to 4, none of
them empty; generation ends before the first one, which is not part of the
text).

Outputs: `text_output` (BYTES [1]): per response the text the new token
completed, decoded incrementally as UTF-8 so that a character is never
split across responses (bytes that cannot be UTF-8 become U+FFFD), and held
back while it may be the start of a stop string; the last response adds
`prompt_tokens` and `completion_tokens` (INT64 [1]; the EOS or the token
that completed a stop string counts) and `finish_reason` (BYTES [1]: "stop"
for EOS or a stop string, "length" for max_tokens). Where the config declares
`token_ids` (INT64 [-1]), each response also holds the ids of the tokens
generated since the previous one (EOS included), so that a stream's
token_ids are every token generated.
"""

import codecs
import json
import math
import os

import numpy as np
import torch

VOCAB = 258
BOS = 256
EOS = 257
MAX_STOPS = 4
MAX_STOP_BYTES = 256

try:
    import hearth
    # A request the model refuses: the front-end's 400, where other errors are 500s.
    RequestError = hearth.InvalidArgument
except ImportError:  # run directly, without the hearth package
    RequestError = ValueError


# ---- the module ----------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, 4 * dim)
        self.out = torch.nn.Linear(4 * dim, dim)

    def forward(self, x, cache):
        """x: [T, dim], the tokens after those in `cache` ((keys, values) of
        [heads, S, head_dim], or None). Returns x and the grown cache."""
        t, dim = x.shape
        hd = dim // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=1)
        q, k, v = (z.view(t, self.heads, hd).transpose(0, 1) for z in (q, k, v))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=1)
            v = torch.cat([cache[1], v], dim=1)
        s = k.shape[1]
        scores = q @ k.transpose(1, 2) / math.sqrt(hd)  # [heads, t, s]
        # Query i sits at position s - t + i and sees keys up to there.
        mask = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(diagonal=s - t)
        scores = scores.masked_fill(~mask, float("-inf"))
        a = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(t, dim)
        x = x + self.proj(a)
        x = x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))
        return x, (k, v)


class TinyDecoder(torch.nn.Module):
    def __init__(self, dim, layers, heads, max_positions):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.max_positions = max_positions
        self.tok = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Embedding(max_positions, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB)

    @classmethod
    def from_config(cls, config):
        return cls(int(config["dim"]), int(config["layers"]), int(config["heads"]),
                   int(config["max_positions"]))

    def forward(self, ids, cache=None):
        """ids: [T] token ids following the `cache` of an earlier call (None:
        the sequence starts). Returns the logits [T, VOCAB] and the cache."""
        start = 0 if cache is None else cache[0][0].shape[1]
        positions = torch.arange(start, start + ids.shape[0], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        grown = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, None if cache is None else cache[i])
            grown.append(c)
        return self.head(self.norm(x)), grown


# ---- decoding ------------------------------------------------------------------


def prompt_tokens(text):
    """BOS, then the text's UTF-8 bytes."""
    if isinstance(text, str):
        text = text.encode()
    return [BOS] + list(text)


def chat_prompt(messages):
    """The chat template: "<role>: <content>\\n" per message, then "assistant: "."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty JSON list")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role")
        content = m.get("content", "")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or \
                        not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{i}].content: only text parts are understood")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts")
        lines.append(f"{m['role']}: {content}\n")
    return "".join(lines) + "assistant: "


def _pick(logits, temperature, top_p, generator):
    # On the host: the generator is the host's, and the draw is the same whatever the weights' device.
    logits = logits.float().cpu()
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def tokens(decoder, prompt, max_tokens, temperature=0.0, top_p=1.0, seed=None):
    """Yields the generated token ids, one at a time, with the KV cache: at
    most max_tokens, ending early with EOS (yielded). Greedy for
    temperature 0; else sampled from torch's generator seeded with `seed`
    (a fresh random seed when None)."""
    if len(prompt) + max_tokens > decoder.max_positions:
        raise RequestError(f"the prompt's {len(prompt)} tokens and max_tokens {max_tokens} come "
                           f"to more than the model's {decoder.max_positions} positions")
    generator = None
    if temperature > 0:
        generator = torch.Generator()
        generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    device = decoder.tok.weight.device
    logits, cache = decoder(torch.tensor(prompt, dtype=torch.long, device=device))
    for n in range(max_tokens):
        token = _pick(logits[-1], temperature, top_p, generator)
        yield token
        if token == EOS or n + 1 == max_tokens:
            return
        logits, cache = decoder(torch.tensor([token], dtype=torch.long, device=device), cache)


class TextStream:
    """Token ids in, text out: incremental UTF-8 (a character is never
    split; invalid bytes become U+FFFD) and stop strings (the text ends
    before the first one; what may be the start of one is held back)."""

    def __init__(self, stop=()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._pending = ""
        self.stopped = False

    def feed(self, token):
        """The text that can be sent now ("" if none); sets `stopped`."""
        if self.stopped:
            return ""
        if token < 256:
            self._pending += self._decoder.decode(bytes([token]))
        return self._release()

    def flush(self):
        """At the end: what was held back (an incomplete character as U+FFFD)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        text, self._pending = self._pending, ""
        return text

    def _release(self):
        text = self._pending
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[:min(hits)]
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        self._pending = text[len(text) - hold:]
        return text[:len(text) - hold]


# ---- the request's parameters ------------------------------------------------------


def _number(parameters, name, default, low, high, integer=False):
    value = parameters.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise RequestError(f"parameter {name} must be {kind} from {low} to {high}, not {value!r}")
    return value


def sampling(parameters, max_positions):
    """The request's parameters, checked: (max_tokens, temperature, top_p, seed, stops)."""
    max_tokens = _number(parameters, "max_tokens", 16, 1, max_positions, integer=True)
    temperature = float(_number(parameters, "temperature", 0.0, 0.0, 2.0))
    top_p = float(_number(parameters, "top_p", 1.0, 0.0, 1.0))
    if top_p == 0:
        raise RequestError("parameter top_p must be above 0")
    seed = _number(parameters, "seed", None, 0, 2**63 - 1, integer=True)
    stop = parameters.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(
            isinstance(s, str) and 0 < len(s.encode()) <= MAX_STOP_BYTES for s in stops):
        raise RequestError(f"parameter stop must be a string or a list of at most {MAX_STOPS}, "
                           f"each of 1 to {MAX_STOP_BYTES} bytes")
    return max_tokens, temperature, top_p, seed, stops


def _one(value):
    return np.array([value], dtype=object)


# ---- the Python backend's Model ---------------------------------------------------


class Model:
    def initialize(self, args):
        # One intra-op thread per worker unless the config says otherwise: the
        # model is tiny, and several workers share the machine's cores.
        params = args["model_config"].get("parameters", {})
        threads = params.get("torch_threads", {}).get("string_value", "1")
        torch.set_num_threads(int(threads))
        with open(os.path.join(args["model_repository"], "config.json")) as f:
            config = json.load(f)
        import hearth.torch
        with hearth.torch.meta_parameters():
            self.decoder = TinyDecoder.from_config(config)
        hearth.torch.load_into(self.decoder, args["weights"])
        self.decoder.eval()
        # Tests of cancellation: a file written when a generation is closed early.
        self.marker_dir = params.get("closed_marker_dir", {}).get("string_value")
        self.token_ids = any(o["name"] == "token_ids" for o in args["model_config"]["output"])

    def execute(self, inputs, parameters):
        max_tokens, temperature, top_p, seed, stops = sampling(parameters,
                                                               self.decoder.max_positions)
        messages = inputs.get("messages")
        # A chat when messages holds something, or when it is the only input.
        if messages is not None and (messages.reshape(-1)[0] or "text_input" not in inputs):
            try:
                listed = json.loads(messages.reshape(-1)[0])
            except ValueError as e:
                raise RequestError(f"messages is not JSON: {e}") from None
            prompt = prompt_tokens(chat_prompt(listed))
        else:
            text = inputs["text_input"].reshape(-1)[0]
            if len(text) + 1 + max_tokens > self.decoder.max_positions:  # before making a list of it
                raise RequestError(f"the prompt's {len(text) + 1} tokens and max_tokens {max_tokens} "
                                   f"come to more than the model's {self.decoder.max_positions} "
                                   "positions")
            prompt = prompt_tokens(text)
        stream = TextStream(stops)
        finish, count, since = "length", 0, []

        def response(text, **more):
            out = {"text_output": _one(text.encode()), **more}
            if self.token_ids:
                out["token_ids"] = np.array(since, dtype=np.int64)
            since.clear()
            return out

        try:
            for token in tokens(self.decoder, prompt, max_tokens, temperature, top_p, seed):
                count += 1
                since.append(token)
                if token == EOS:
                    finish = "stop"
                    break
                piece = stream.feed(token)
                if piece:
                    yield response(piece)
                if stream.stopped:
                    finish = "stop"
                    break
        except GeneratorExit:  # the request is over early: closed at the yield
            if self.marker_dir:
                with open(os.path.join(self.marker_dir, f"closed-{os.getpid()}-{count}"), "w"):
                    pass
            raise
        yield response(stream.flush(),
                       prompt_tokens=np.array([len(prompt)], dtype=np.int64),
                       completion_tokens=np.array([count], dtype=np.int64),
                       finish_reason=_one(finish.encode()))
