"""A tiny byte-level, decoder-only transformer in plain torch, served as a decoupled model.

`backend: python` with `model_transaction_policy: {decoupled: true}` and
config parameters `max_streams` (how many requests it decodes at once) and
`resumable: "true"`: execute admits requests, and each step() is one forward
over every active stream, one new token each (see Model). The module
(TinyDecoder), its single-stream decoding loop (tokens) and its detokenizer
(TextStream) are plain functions and classes, so that a test can run the
very same code without a server and compare token for token.

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
text). The token at completion position p is drawn from a generator seeded
with (seed, p) alone, so that a stream draws the same whatever shares its
batch, and a resumed stream draws what the uninterrupted one would have.

Outputs: `text_output` (BYTES [1]): per response the text the new token
completed, decoded incrementally as UTF-8 so that a character is never
split across responses (bytes that cannot be UTF-8 become U+FFFD), and held
back while it may be the start of a stop string; the last response adds
`prompt_tokens` and `completion_tokens` (INT64 [1]; the EOS or the token
that completed a stop string counts) and `finish_reason` (BYTES [1]: "stop"
for EOS or a stop string, "length" for max_tokens). Where the config declares
`token_ids` (INT64 [-1]), each response also holds the ids of the tokens
generated since the previous one (EOS included), so that a stream's
token_ids are every token generated; a request resumed with those ids
(request.resume_token_ids) goes on from there without sending them again.
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

    def forward_packed(self, x, keys, values, packed):
        """x: [N, dim], the tokens of many streams as `packed` places them.
        Writes their keys and values into the layer's cache (`keys`,
        `values`: [slots, heads, positions, head_dim]) and returns x."""
        n, dim = x.shape
        hd = dim // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=1)
        q, k, v = (z.view(n, self.heads, hd) for z in (q, k, v))
        keys[packed.slot, :, packed.position] = k
        values[packed.slot, :, packed.position] = v
        a = torch.empty_like(q)
        if packed.decoding is not None:
            # A token a stream: one attention for them all, over the longest
            # stream's keys, each query seeing its own slot up to its position.
            rows, slots, extent, hidden = packed.decoding
            scores = q[rows].unsqueeze(2) @ keys[slots, :, :extent].transpose(2, 3) / math.sqrt(hd)
            scores = scores.masked_fill(hidden, float("-inf"))  # [streams, heads, 1, extent]
            a[rows] = (scores.softmax(dim=-1) @ values[slots, :, :extent]).squeeze(2)
        for row, count, slot, start in packed.prefilling:
            end = start + count
            qs = q[row:row + count].transpose(0, 1)  # [heads, count, hd]
            scores = qs @ keys[slot, :, :end].transpose(1, 2) / math.sqrt(hd)
            mask = torch.ones(count, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
            scores = scores.masked_fill(~mask, float("-inf"))
            a[row:row + count] = (scores.softmax(dim=-1) @ values[slot, :, :end]).transpose(0, 1)
        x = x + self.proj(a.reshape(n, dim))
        x = x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))
        return x


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

    def forward_packed(self, ids, packed, cache):
        """ids: [N], the new tokens of many streams, placed by `packed`, after
        what each stream's slot of `cache` (a StreamCache) already holds.
        Returns the logits of each stream's last token, [streams, VOCAB]."""
        x = self.tok(ids) + self.pos(packed.position)
        for block, keys, values in zip(self.blocks, cache.keys, cache.values):
            x = block.forward_packed(x, keys, values, packed)
        return self.head(self.norm(x[packed.last]))


class StreamCache:
    """The keys and values of up to `slots` sequences, for forward_packed: per
    layer a [slots, heads, max_positions, head_dim] tensor of keys and one of
    values, a sequence in a row (its slot) from position 0. It keeps no
    lengths: a slot's owner knows how far it has written, attention never
    looks past that, so a freed slot needs no clearing before its next owner."""

    def __init__(self, decoder, slots):
        weight = decoder.tok.weight
        heads = decoder.blocks[0].heads
        shape = (slots, heads, decoder.max_positions, weight.shape[1] // heads)
        self.keys = [torch.zeros(shape, dtype=weight.dtype, device=weight.device)
                     for _ in decoder.blocks]
        self.values = [torch.zeros_like(k) for k in self.keys]


class Packed:
    """The tokens of one forward over many streams, packed stream after
    stream: stream i's counts[i] tokens go to positions starts[i] onwards of
    its slot slots[i]. The index tensors are made once and shared by the
    layers. A stream of one token (decoding) attends batched with the
    others of one token; a stream of more (a prompt being prefilled) attends
    on its own, so that no stream's attention is padded to a long prompt."""

    def __init__(self, slots, starts, counts, device):
        def longs(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        rows = [0]
        for c in counts:
            rows.append(rows[-1] + c)
        self.slot = longs([s for s, c in zip(slots, counts) for _ in range(c)])
        self.position = longs([p for s, c in zip(starts, counts) for p in range(s, s + c)])
        self.last = longs([r - 1 for r in rows[1:]])
        one = [i for i, c in enumerate(counts) if c == 1]
        self.decoding = None
        if one:
            ends = [starts[i] + 1 for i in one]
            extent = max(ends)
            hidden = torch.arange(extent, device=device)[None, :] >= longs(ends)[:, None]
            self.decoding = (longs([rows[i] for i in one]), longs([slots[i] for i in one]), extent,
                             hidden[:, None, None, :])
        self.prefilling = [(rows[i], c, slots[i], starts[i]) for i, c in enumerate(counts) if c > 1]


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


_MASK64 = (1 << 64) - 1


def position_seed(seed, position):
    """The seed of the draw at completion position `position` (0: the first
    token generated) of a stream seeded with `seed`: splitmix64's output
    number position + 1 from state `seed`, cut to the 63 bits any torch's
    manual_seed takes."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def random_seed():
    return int.from_bytes(os.urandom(8), "little") >> 1


def _pick(logits, temperature, top_p, seed, position):
    # On the host, in float64: the generator is the host's, and the draw is the
    # same whatever the weights' device; a float32 rounding of the logits
    # cannot tip a draw that the weights' precision would not.
    logits = logits.double().cpu()
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    generator = torch.Generator().manual_seed(position_seed(seed, position))
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def tokens(decoder, prompt, max_tokens, temperature=0.0, top_p=1.0, seed=None):
    """Yields the generated token ids of one stream, one at a time, with the
    module's own KV cache (forward, not forward_packed): at most max_tokens,
    ending early with EOS (yielded). Greedy for temperature 0; else the token
    at completion position p is drawn from a generator seeded with
    position_seed(seed, p) (`seed` a fresh random one when None)."""
    if len(prompt) + max_tokens > decoder.max_positions:
        raise RequestError(f"the prompt's {len(prompt)} tokens and max_tokens {max_tokens} come "
                           f"to more than the model's {decoder.max_positions} positions")
    if seed is None:
        seed = random_seed()
    device = decoder.tok.weight.device
    logits, cache = decoder(torch.tensor(prompt, dtype=torch.long, device=device))
    for n in range(max_tokens):
        token = _pick(logits[-1], temperature, top_p, seed, n)
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


def request_prompt(inputs, max_tokens, max_positions):
    """The prompt's tokens: the chat template applied to `messages` when it
    holds something (or is the only input), else text_input's bytes."""
    def check(n):
        if n + max_tokens > max_positions:
            raise RequestError(f"the prompt's {n} tokens and max_tokens {max_tokens} "
                               f"come to more than the model's {max_positions} positions")

    messages = inputs.get("messages")
    if messages is not None and (messages.reshape(-1)[0] or "text_input" not in inputs):
        try:
            listed = json.loads(messages.reshape(-1)[0])
        except ValueError as e:
            raise RequestError(f"messages is not JSON: {e}") from None
        prompt = prompt_tokens(chat_prompt(listed))
        check(len(prompt))
        return prompt
    if "text_input" not in inputs:
        raise RequestError("give text_input (a prompt) or messages (a chat)")
    text = inputs["text_input"].reshape(-1)[0]
    check(len(text) + 1)  # before making a list of it
    return prompt_tokens(text)


# ---- the Python backend's Model ---------------------------------------------------


class Stream:
    """One request being generated: its sampling, its detokenizer, what it
    has generated, and where it sits in the cache."""

    def __init__(self, request, prompt, max_tokens, temperature, top_p, seed, stops):
        self.request = request
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = random_seed() if seed is None else seed
        self.text = TextStream(stops)
        self.count = 0       # tokens generated, resumed ones included
        self.since = []      # tokens generated since the last response
        self.finish = None   # "stop" or "length" once the generation is over
        self.slot = None     # its row of the StreamCache while it holds one
        self.length = 0      # tokens in its slot
        self.pending = list(prompt)  # the tokens the next step puts through the decoder

    def accept(self, token):
        """Takes the next token generated: the text it completes ("" if
        none); sets `finish` when it ends the generation."""
        self.count += 1
        self.since.append(token)
        piece = ""
        if token == EOS:
            self.finish = "stop"
        else:
            piece = self.text.feed(token)
            if self.text.stopped:
                self.finish = "stop"
        if self.finish is None and self.count == self.max_tokens:
            self.finish = "length"
        return piece


class Model:
    """Many streams at once (config parameter max_streams): execute admits
    requests, each step() runs one forward over every active stream, one
    token each, and sends what each new token completes.

    The cache (StreamCache) has a slot per stream. A stream admitted by
    execute is prefilled (its prompt, and the tokens it resumes with) in the
    next step, packed in the same forward as the others' one token each
    (Packed); from then on it decodes with them. A stream that ends, or
    whose request is cancelled, leaves at once and its slot goes to the next
    one admitted."""

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
            decoder = TinyDecoder.from_config(config)
        # In the weights' dtype (float32, or float64 for exact comparisons).
        decoder.to(args["weights"]["tok.weight"].dtype)
        hearth.torch.load_into(decoder, args["weights"])
        # Tests of cancellation: a file written when a cancelled stream is dropped.
        marker_dir = params.get("closed_marker_dir", {}).get("string_value")
        token_ids = any(o["name"] == "token_ids" for o in args["model_config"]["output"])
        self.serve(decoder.eval(), int(args.get("max_streams", 1)), token_ids, marker_dir)

    def serve(self, decoder, max_streams, token_ids=True, marker_dir=None):
        """Decodes with `decoder`, up to max_streams streams at once; responses
        hold token_ids when `token_ids`. (initialize's end; tests call it.)"""
        self.decoder = decoder
        self.device = decoder.tok.weight.device
        self.cache = StreamCache(decoder, max_streams)
        self.free = list(range(max_streams))[::-1]  # pop() hands out slot 0 first
        self.streams = []
        self.token_ids = token_ids
        self.marker_dir = marker_dir

    def execute(self, requests):
        for request in requests:
            try:
                stream = self._admit(request)
            except Exception as e:  # this request's fault (or its bug): the others go on
                request.fail(e)
                continue
            if stream.finish:  # resumed with tokens that already end it
                self._send(stream, stream.text.flush(), final=True)
            elif not self.free:  # the worker gave more than max_streams
                request.fail(RuntimeError(f"the model holds {len(self.streams)} streams, "
                                          "its max_streams"))
            else:
                stream.slot = self.free.pop()
                self.streams.append(stream)

    @torch.no_grad()
    def step(self):
        for stream in [s for s in self.streams if s.request.is_cancelled()]:
            self._drop(stream)
        streams = list(self.streams)
        if not streams:
            return
        ids = torch.tensor([t for s in streams for t in s.pending], dtype=torch.long, device=self.device)
        packed = Packed([s.slot for s in streams], [s.length for s in streams],
                        [len(s.pending) for s in streams], self.device)
        logits = self.decoder.forward_packed(ids, packed, self.cache).double().cpu()
        for stream, row in zip(streams, logits):
            stream.length += len(stream.pending)
            token = _pick(row, stream.temperature, stream.top_p, stream.seed, stream.count)
            stream.pending = [token]
            piece = stream.accept(token)
            if piece and not self._send(stream, piece):
                continue
            if stream.finish:
                self._send(stream, stream.text.flush(), final=True)
                self._release(stream)

    def _admit(self, request):
        """A Stream for the request, its resumed tokens replayed."""
        max_tokens, temperature, top_p, seed, stops = sampling(request.parameters,
                                                               self.decoder.max_positions)
        prompt = request_prompt(request.inputs, max_tokens, self.decoder.max_positions)
        stream = Stream(request, prompt, max_tokens, temperature, top_p, seed, stops)
        resumed = [int(t) for t in request.resume_token_ids]
        if not all(0 <= t < VOCAB for t in resumed):
            raise ValueError(f"resume_token_ids holds a token that is not one of the "
                             f"model's {VOCAB}")
        # The client has the text of these already: through the detokenizer,
        # counted, not sent again.
        for token in resumed:
            stream.accept(token)
            stream.pending.append(token)
            if stream.finish:
                break
        stream.since = []
        return stream

    def _send(self, stream, text, final=False):
        """One response; False (and the stream dropped) when the request is over."""
        out = {"text_output": _one(text.encode())}
        if self.token_ids:
            out["token_ids"] = np.array(stream.since, dtype=np.int64)
        stream.since = []
        if final:
            out.update(prompt_tokens=np.array([len(stream.prompt)], dtype=np.int64),
                       completion_tokens=np.array([stream.count], dtype=np.int64),
                       finish_reason=_one(stream.finish.encode()))
        if stream.request.send(out, final=final):
            return True
        if not final:
            self._drop(stream)
        return False

    def _drop(self, stream):
        """A cancelled stream: gone, sending nothing more."""
        if self.marker_dir:
            with open(os.path.join(self.marker_dir, f"closed-{os.getpid()}-{stream.count}"), "w"):
                pass
        self._release(stream)

    def _release(self, stream):
        if stream.slot is not None:
            self.free.append(stream.slot)
            stream.slot = None
        if stream in self.streams:
            self.streams.remove(stream)
