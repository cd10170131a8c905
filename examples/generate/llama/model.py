"""Seed 003's workload under `hearth serve`: a Llama checkpoint, many streams decoded together.

`backend: python` with `model_transaction_policy: {decoupled: true}` and
config parameter `max_streams`: one worker holds up to that many streams and
decodes them all with one forward per step. The version directory is a
Hugging Face checkpoint directory (config.json, generation_config.json, the
safetensors shards and their index, the tokenizer files): the server's store
loads its weights once, and every worker builds the model with
hearth.transformers.causal_lm over that one read-only copy (no weight is
read from the files by a worker); the configuration, generation config and
tokenizer come from the directory.

Inputs, outputs and parameters are those of examples/generate/tiny_decoder:

- `text_input` (BYTES [1]): the prompt, tokenized as the tokenizer does
  (its BOS included); and/or `messages` (BYTES [1]): an OpenAI chat's
  messages as JSON text; when it is declared and holds something (or is the
  only input), the prompt is the tokenizer's own chat template applied to
  it (`apply_chat_template(..., add_generation_prompt=True)`) and
  text_input is ignored.
- parameters: max_tokens (default 16), temperature (0: greedy, the
  default), top_p (1), seed, stop (a string or a list of up to 4).
- `text_output` (BYTES [1]) per response: the new text, decoded
  incrementally so that a character is never split (a piece is sent only
  once its bytes decode completely) and held back while it may be the start
  of a stop string, which ends the text and is not part of it; the last
  response adds `prompt_tokens`, `completion_tokens` (INT64 [1]) and
  `finish_reason` (BYTES [1]: "stop" for EOS or a stop string, "length");
  `token_ids` (INT64 [-1]), where the config declares it: the tokens
  generated since the previous response (EOS included).

How the streams are decoded (Model.step, called by the worker again and
again while a stream is unfinished):

- The KV cache is allocated once, in initialize: per layer, keys and values
  of [max_streams, kv_heads, cap, head_dim] in the model's dtype, where cap,
  a stream's most positions, is max_prompt_tokens + max_tokens_limit
  (bounded by the model's max_position_embeddings). A stream owns one row
  (slot) from its prefill to its end. The active streams are kept in rows
  [0, B): when one ends, the last row's keys and values move into its row,
  so that a step reads views of the cache, never gathers.
- A step first prefills streams that arrived (one forward over a stream's
  prompt, causal, written into its row; up to PREFILL_BUDGET prompt tokens
  a step, at least one stream), then decodes every active stream with one
  forward of B tokens: each row's token at its own position (per-row
  position_ids for the rotary embedding), its key and value written at that
  position, attention over the first L positions of rows [0, B), L the
  longest stream's length, masked per row beyond each one's own length.
  Logits only for the last position.
- Attention goes through transformers' own model code (the checkpoint's
  modeling_llama) with a function registered in its AttentionInterface
  (`row_attention`), which the model is switched to: the model passes no
  cache and no mask; the function writes the step's keys and values into
  the cache and attends. Grouped-query attention reads each key/value head
  once: a decode step's queries are laid out as [B, kv_heads, group,
  head_dim] against keys [B, kv_heads, L, head_dim] (no repeat_kv copies).

Device memory of the cache: 2 x layers x kv_heads x head_dim x dtype size
per position, times cap, times max_streams. For a 1 B Llama (16 layers, 8
KV heads of 64) in bf16 that is 32 KiB a position: at the defaults (cap
5120) 160 MiB a stream, 10 GiB for 64 streams, per worker.

Greedy decoding (argmax of the last position's logits, no logits
processors) picks, token for token, what `model.generate(do_sample=False)`
picks for the prompt alone, but for rounding: batched matrices and the
masked attention sum in another order than generate's one-prompt decoding,
which in bf16 can flip two logits that nearly tie (the tests use a float32
checkpoint, where they are equal). Sampling: softmax(logits /
temperature), then top-p; the draw for the token at completion position p
(0 for the first) comes from a generator on the model's device seeded with
draw_seed(seed, p) alone, so that a stream draws the same whichever streams
share its steps, and a resumed stream what it would have drawn; without a
`seed`, each request draws its own.

Resuming (config `resumable: "true"`): a request whose resume_token_ids
are the tokens its client already got goes on from there: prompt and those
tokens are prefilled, the tokens are replayed through the detokenizer and
the stop strings without their text being sent again, they count towards
completion_tokens and max_tokens, and a generation they already end is
answered with its final response at once.

Config parameters: max_prompt_tokens (default 4096), max_tokens_limit (the
largest max_tokens a request may ask for; default 1024); the worker gives
max_streams (config `max_streams`, default 1).
"""

import inspect
import json
import os

import numpy as np
import torch

import hearth
import hearth.transformers

# transformers and the checkpoint's model classes, imported here rather than
# in initialize: the model's zygote imports this file once, with no GPU, and
# every worker forked from it starts with them (seconds for Llama).
try:
    hearth.transformers.prepare(os.path.dirname(os.path.abspath(__file__)))
except (ImportError, OSError):
    pass  # no transformers, or no checkpoint beside this file: initialize() says which

RequestError = hearth.InvalidArgument  # the client's fault: HTTP 400
MAX_STOPS = 4
SPAN_STEP = 64
MAX_STOP_CHARS = 256


def _config_parameter(config, name, default):
    value = config.get("parameters", {}).get(name, {}).get("string_value")
    return default if value is None else int(value)


def _number(parameters, name, default, low, high, integer=False):
    value = parameters.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise RequestError(f"parameter {name} must be {kind} from {low} to {high}, not {value!r}")
    return value


def sampling(parameters, max_tokens_limit):
    """The request's parameters, checked: (max_tokens, temperature, top_p, seed, stops)."""
    max_tokens = _number(parameters, "max_tokens", min(16, max_tokens_limit), 1, max_tokens_limit,
                         integer=True)
    temperature = float(_number(parameters, "temperature", 0.0, 0.0, 2.0))
    top_p = float(_number(parameters, "top_p", 1.0, 0.0, 1.0))
    if top_p == 0:
        raise RequestError("parameter top_p must be above 0")
    seed = _number(parameters, "seed", None, 0, 2**63 - 1, integer=True)
    stop = parameters.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise RequestError(f"parameter stop must be a string or a list of at most {MAX_STOPS}, "
                           f"each of 1 to {MAX_STOP_CHARS} characters")
    return max_tokens, temperature, top_p, seed, stops


class StopStrings:
    """Text in, text out: ends before the first stop string and holds back
    what may be the start of one."""

    def __init__(self, stops):
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, text):
        if self.stopped:
            return ""
        text = self._pending + text
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[:min(hits)]
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        self._pending = text[len(text) - hold:]
        return text[:len(text) - hold]

    def flush(self):
        text, self._pending = ("" if self.stopped else self._pending), ""
        return text


class Detokenizer:
    """Token ids in, text out, never splitting a character: the text of the
    ids since `prefix` is decoded whole, and what it adds beyond the text up
    to `read` is released only when it does not end in an incomplete
    character (U+FFFD). Decoding windows keeps tokenizers' context-dependent
    spacing (SentencePiece's leading spaces) right."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ids = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids):
        return self._tokenizer.decode(ids, skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)

    def add(self, token):
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before):]
        return ""

    def flush(self):
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):]


def _one(value):
    return np.array([value], dtype=object)


ROW_ATTENTION = "hearth_rows"  # the name row_attention is registered under in transformers
PREFILL_BUDGET = 4096  # prompt tokens a step prefills (at least one stream's, however long)
_MASK64 = (1 << 64) - 1


def draw_seed(seed, position):
    """The seed of the draw at completion position `position` (0 for the
    first token) of a stream seeded `seed`: splitmix64's output number
    position + 1 from state `seed`, a function of the two alone."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _torch_version():
    return tuple(int("".join(c for c in part if c.isdigit()) or 0)
                 for part in torch.__version__.split("+")[0].split(".")[:2])


# scaled_dot_product_attention's enable_gqa (torch 2.5): a prefill's query
# heads read their shared key/value head without repeat_kv copies.
_SDPA_GQA = _torch_version() >= (2, 5)


def _causal_attention(query, key, value, scaling):
    """A prefill's attention, as transformers' sdpa_attention_forward computes
    it for generate()'s prefill (no mask: is_causal)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if _SDPA_GQA:
        return sdpa(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    group = query.shape[1] // key.shape[1]
    return sdpa(query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
                is_causal=True, scale=scaling)


class _Batch:
    """What row_attention needs for one forward beyond its inputs: the KV
    cache ([layers, 2, max_streams, kv_heads, cap, head_dim]) and where in it
    the forward's tokens go.

    A prefill (`row` given) is one stream's tokens from position 0: written
    at [0, T) of its row, attending causally among themselves. A decode is
    one token for each of rows [0, B): row i's written at positions[i], its
    query attending over positions [0, span) of its row with `bias`
    ([B, 1, 1, span]: 0 up to positions[i], -inf beyond, where the row holds
    an earlier stream's keys or the zeros the cache was made with).
    """

    def __init__(self, cache, row=None, rows=None, positions=None, span=0, bias=None):
        self.cache = cache
        self.row = row
        self.rows = rows
        self.positions = positions
        self.span = span
        self.bias = bias
        self.layers = 0  # layers that attended through this batch

    def attend(self, layer, query, key, value, scaling):
        self.layers += 1
        keys, values = self.cache[layer]
        if self.row is not None:
            t = key.shape[2]
            keys[self.row, :, :t] = key[0]
            values[self.row, :, :t] = value[0]
            out = _causal_attention(query, key, value, scaling)
        else:
            b, heads, _, dim = query.shape
            kv = key.shape[1]
            # Advanced indices on rows and positions: [B, kv_heads, head_dim] each.
            keys[self.rows, :, self.positions] = key[:, :, 0]
            values[self.rows, :, self.positions] = value[:, :, 0]
            # Query head h is kv head h // group's (repeat_kv's order): the
            # group's queries are the query length of one attention per kv head.
            out = torch.nn.functional.scaled_dot_product_attention(
                query.reshape(b, kv, heads // kv, dim), keys[:b, :, :self.span],
                values[:b, :, :self.span], attn_mask=self.bias, scale=scaling)
            out = out.reshape(b, heads, 1, dim)
        return out.transpose(1, 2).contiguous()


def row_attention(module, query, key, value, attention_mask, scaling=None, hearth_rows=None,
                  **kwargs):
    """The attention function registered as ROW_ATTENTION, by transformers'
    AttentionInterface contract: `module` the attention layer (its
    layer_idx), query [B, heads, T, head_dim] and key, value [B, kv_heads, T,
    head_dim] of this forward's tokens, rotated; returns the output as [B,
    T, heads, head_dim] and no weights. `hearth_rows`, the step's _Batch, is
    a keyword of the model's forward that transformers passes through to
    here; `attention_mask` is None (no mask function is registered under
    this name, so the model makes none) and is not used."""
    if hearth_rows is None:
        raise RuntimeError(f"attention {ROW_ATTENTION!r} runs only within Model.step, "
                           "which gives the model's forward hearth_rows")
    return hearth_rows.attend(module.layer_idx, query, key, value, scaling), None


class _Stream:
    """One request being generated: its parameters, its text so far, and its
    place in the KV cache."""

    def __init__(self, request, prompt, max_tokens, temperature, top_p, seed, stops, tokenizer):
        self.request = request
        self.prompt = prompt  # token ids
        self.resumed = []  # the tokens its client already had, prefilled after the prompt
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.detokenizer = Detokenizer(tokenizer)
        self.stop = StopStrings(stops)
        self.count = 0  # tokens generated, resumed ones included
        self.since = []  # tokens generated but not sent yet
        self.row = None  # its row of the cache, from its prefill to its end
        self.length = 0  # positions of its row that hold its keys and values
        self.next = None  # the token to feed at position `length`
        self.over = False  # its final response is sent, or its request is gone


class Model:
    def initialize(self, args):
        directory = args["model_repository"]
        self.bind(hearth.transformers.causal_lm(args["weights"], directory),
                  hearth.transformers.tokenizer(directory), args["model_config"],
                  args.get("max_streams", 1))

    def bind(self, model, tokenizer, config, max_streams=1):
        """Serves `model` (a transformers causal LM of the Llama family) with
        `tokenizer`, up to `max_streams` streams at once; `config` is the
        model's config in Triton's JSON form (its outputs and parameters are
        read). initialize() binds the store's weights; a program that loads a
        model otherwise may bind that one and call execute() and step()
        itself. The model is switched to row_attention, which works only
        within step(): bind a model that serves nothing else."""
        import transformers

        if not isinstance(max_streams, int) or max_streams < 1:
            raise ValueError(f"max_streams must be a positive integer, not {max_streams!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.device = model.device
        self.max_streams = max_streams
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.vocab = model.get_input_embeddings().num_embeddings
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.max_prompt_tokens = _config_parameter(config, "max_prompt_tokens", 4096)
        self.max_tokens_limit = _config_parameter(config, "max_tokens_limit", 1024)
        self.token_ids = any(o["name"] == "token_ids" for o in config.get("output", []))
        accepted = set(inspect.signature(model.forward).parameters)
        if "position_ids" not in accepted:
            raise ValueError(f"{type(model).__name__}.forward takes no position_ids: "
                             "streams at different positions cannot share its forward")
        self.keep_last = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in accepted),
                              None)
        # The most positions a stream can fill: its prompt and max_tokens.
        self.cap = self.max_prompt_tokens + self.max_tokens_limit
        if self.max_positions:
            self.cap = min(self.cap, self.max_positions)

        transformers.AttentionInterface.register(ROW_ATTENTION, row_attention)
        if self.device.type == "cuda" and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            # cuDNN's attention builds a graph for every new shape, which
            # cost 3.3 ms of CPU per layer and step on the H200 (a step of
            # 16 streams: 183 ms, 2 of them on the GPU); the flash and
            # memory-efficient kernels take no such time. For this process.
            torch.backends.cuda.enable_cudnn_sdp(False)
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ROW_ATTENTION)
        else:
            model.config._attn_implementation = ROW_ATTENTION
        if model.config._attn_implementation != ROW_ATTENTION:
            # set_attn_implementation only warns for a model whose attention
            # layers do not dispatch through AttentionInterface.
            raise ValueError(f"{type(model).__name__} kept attention "
                             f"{model.config._attn_implementation!r}: its attention does not go "
                             "through transformers' AttentionInterface")
        c = model.config
        self.layers = c.num_hidden_layers
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        with torch.inference_mode():
            # Zeros, not empty: a decode reads a row's positions beyond its
            # length (masked, weight 0), and 0 x NaN would be NaN.
            self.cache = torch.zeros((self.layers, 2, max_streams, kv_heads, self.cap, head_dim),
                                     dtype=model.dtype, device=self.device)
            self.row_index = torch.arange(max_streams, device=self.device)
            self.position_index = torch.arange(self.cap, device=self.device)
            # One token through row 0 (a stream's prefill overwrites it): a
            # model that does not attend through row_attention in every
            # layer fails here, at start, rather than on a request.
            self._logits(torch.zeros((1, 1), dtype=torch.long, device=self.device),
                         self.position_index[:1].unsqueeze(0), _Batch(self.cache, row=0))
        self.rows = []  # the active streams, stream i in row i
        self.waiting = []  # admitted, waiting for a row and their prefill

    def finalize(self):
        self.rows, self.waiting, self.cache = [], [], None

    def prompt(self, inputs):
        messages = inputs.get("messages")
        # A chat when messages holds something, or when it is the only input.
        if messages is not None and (messages.reshape(-1)[0] or "text_input" not in inputs):
            try:
                listed = json.loads(messages.reshape(-1)[0])
            except ValueError as e:
                raise RequestError(f"messages is not JSON: {e}") from None
            if not isinstance(listed, list) or not listed or \
                    not all(isinstance(m, dict) for m in listed):
                raise RequestError("messages must be a non-empty JSON list of objects")
            if len(messages.reshape(-1)[0]) > 16 * self.max_prompt_tokens:
                raise RequestError("the messages are too long for max_prompt_tokens "
                                   f"{self.max_prompt_tokens}")
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError("this model's tokenizer has no chat template: send a prompt")
            # The template writes the special tokens (BOS) itself.
            text = self.tokenizer.apply_chat_template(listed, add_generation_prompt=True,
                                                      tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            raw = inputs["text_input"].reshape(-1)[0]
            try:
                text = raw.decode()
            except UnicodeDecodeError as e:
                raise RequestError(f"text_input is not UTF-8: {e}") from None
            if not text:
                raise RequestError("the prompt is empty")
            if len(text) > 16 * self.max_prompt_tokens:  # bounds the tokenizer's work
                raise RequestError(f"the prompt has {len(text)} characters; at most "
                                   f"{16 * self.max_prompt_tokens} are accepted")
            ids = self.tokenizer(text)["input_ids"]
        if len(ids) > self.max_prompt_tokens:
            raise RequestError(f"the prompt has {len(ids)} tokens; at most "
                               f"{self.max_prompt_tokens} are accepted")
        return ids

    # ---- admission: execute() -------------------------------------------------------

    def execute(self, requests):
        """Admits new requests: checks each (one the model refuses fails with
        hearth.InvalidArgument and changes nothing), replays what a resumed
        one's client already has, and queues it for a row; step() does the rest."""
        for request in requests:
            try:
                stream = self._admit(request)
            except RequestError as e:
                request.fail(e)
                continue
            if stream is not None:
                self.waiting.append(stream)

    def _admit(self, request):
        """The request's stream, or None when its resumed tokens already end
        it (its final response then sent)."""
        max_tokens, temperature, top_p, seed, stops = sampling(request.parameters or {},
                                                               self.max_tokens_limit)
        ids = self.prompt(request.inputs)
        if self.max_positions and len(ids) + max_tokens > self.max_positions:
            raise RequestError(f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} come "
                               f"to more than the model's {self.max_positions} positions")
        resumed = getattr(request, "resume_token_ids", None) or []
        if not isinstance(resumed, (list, tuple)) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < self.vocab
                for t in resumed):
            raise RequestError("resume_token_ids must be a list of token ids from 0 to "
                               f"{self.vocab - 1}")
        resumed = [int(t) for t in resumed]
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        stream = _Stream(request, ids, max_tokens, temperature, top_p, seed, stops, self.tokenizer)
        for i, token in enumerate(resumed):
            finish = self._take(stream, token, replay=True)
            if finish is not None:
                if i + 1 < len(resumed):
                    raise RequestError(f"resume_token_ids go on after the generation they resume "
                                       f"ended (at their token {i})")
                self._finish(stream, finish)
                return None
        stream.resumed = resumed
        return stream

    # ---- decoding: step() -------------------------------------------------------------

    def step(self):
        """One step of every stream: cancelled ones dropped, waiting ones
        prefilled (their first token), then one batched forward for a token
        of every active stream."""
        with torch.inference_mode():
            for stream in [s for s in self.rows if s.request.is_cancelled()]:
                self._release(stream)
            self.waiting = [s for s in self.waiting if not s.request.is_cancelled()]
            self._prefill()
            if self.rows:
                self._decode()

    def _prefill(self):
        budget = PREFILL_BUDGET
        while self.waiting and len(self.rows) < self.max_streams:
            fed = self.waiting[0].prompt + self.waiting[0].resumed
            if len(fed) > budget and budget < PREFILL_BUDGET:
                break
            budget -= len(fed)
            stream = self.waiting.pop(0)
            stream.row = len(self.rows)
            self.rows.append(stream)
            logits = self._logits(torch.tensor([fed], dtype=torch.long, device=self.device),
                                  self.position_index[:len(fed)].unsqueeze(0),
                                  _Batch(self.cache, row=stream.row))
            stream.length = len(fed)
            self._after([stream], self._pick(logits, [stream]))

    def _decode(self):
        streams = list(self.rows)
        b = len(streams)
        fed = torch.tensor([[s.next for s in streams], [s.length for s in streams]],
                           dtype=torch.long).to(self.device)
        # Rounded up to a multiple of SPAN_STEP (the positions past a row's
        # length are masked): the attention's shapes change every
        # SPAN_STEP tokens, not every token.
        span = min(self.cap, -(-(max(s.length for s in streams) + 1) // SPAN_STEP) * SPAN_STEP)
        allowed = self.position_index[:span].unsqueeze(0) <= fed[1].unsqueeze(1)
        bias = torch.zeros(allowed.shape, dtype=self.cache.dtype, device=self.device)
        bias.masked_fill_(~allowed, float("-inf"))
        batch = _Batch(self.cache, rows=self.row_index[:b], positions=fed[1], span=span,
                       bias=bias[:, None, None, :])
        logits = self._logits(fed[0].unsqueeze(1), fed[1].unsqueeze(1), batch)
        for s in streams:
            s.length += 1
        self._after(streams, self._pick(logits, streams))

    def _logits(self, ids, positions, batch):
        """The logits after the last of each row of `ids` ([rows, T], at
        `positions`), the cache written as `batch` says."""
        kwargs = {"input_ids": ids, "position_ids": positions, "use_cache": False,
                  "hearth_rows": batch}
        if self.keep_last:
            kwargs[self.keep_last] = 1
        logits = self.model(**kwargs).logits[:, -1, :]
        if batch.layers != self.layers:
            raise RuntimeError(f"{type(self.model).__name__} attended through row_attention in "
                               f"{batch.layers} of its {self.layers} layers: its attention does "
                               "not go through transformers' AttentionInterface")
        return logits

    def _pick(self, logits, streams):
        """Each stream's next token from its row of `logits`, as a list."""
        logits = logits.float()
        tokens = torch.argmax(logits, dim=-1)
        for i, s in enumerate(streams):
            if s.temperature > 0:
                tokens[i] = self._draw(logits[i], s)
        return tokens.tolist()

    def _draw(self, logits, stream):
        probs = torch.softmax(logits / stream.temperature, dim=-1)
        if stream.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = (sorted_probs.cumsum(0) - sorted_probs) < stream.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        generator = torch.Generator(device=self.device)
        generator.manual_seed(draw_seed(stream.seed, stream.count))
        return torch.multinomial(probs, 1, generator=generator)[0]

    def _after(self, streams, tokens):
        """Gives each stream its token; frees the rows of those that ended."""
        for stream, token in zip(streams, tokens):
            finish = self._take(stream, token)
            if finish is not None and not stream.over:
                self._finish(stream, finish)
        for stream in streams:
            if stream.over:
                self._release(stream)

    def _release(self, stream):
        """Frees the stream's row: the last row's stream moves into it."""
        last = self.rows.pop()
        if last is not stream:
            n = last.length
            self.cache[:, :, stream.row, :, :n].copy_(self.cache[:, :, last.row, :, :n])
            self.rows[stream.row] = last
            last.row = stream.row
        stream.row = None

    # ---- a stream's text --------------------------------------------------------------

    def _take(self, stream, token, replay=False):
        """The stream's next token: counted, and the text it completes sent
        (not when `replay`ing a resumed token, whose text the client has).
        Returns what ends the stream with it ("stop", "length"), or None."""
        stream.count += 1
        if not replay:
            stream.since.append(token)
        if token in self.eos:
            return "stop"
        piece = stream.stop.feed(stream.detokenizer.add(token))
        if piece and not replay:
            self._send(stream, self._response(stream, piece))
        if stream.stop.stopped:
            return "stop"
        if stream.count == stream.max_tokens:
            return "length"
        stream.next = token
        return None

    def _finish(self, stream, finish):
        tail = ""
        if not stream.stop.stopped:
            tail = stream.stop.feed(stream.detokenizer.flush())
            if stream.stop.stopped:
                finish = "stop"
            tail += stream.stop.flush()
        self._send(stream, self._response(
            stream, tail, prompt_tokens=np.array([len(stream.prompt)], dtype=np.int64),
            completion_tokens=np.array([stream.count], dtype=np.int64),
            finish_reason=_one(finish.encode())), final=True)

    def _response(self, stream, text, **more):
        out = {"text_output": _one(text.encode()), **more}
        if self.token_ids:
            out["token_ids"] = np.array(stream.since, dtype=np.int64)
        stream.since = []
        return out

    def _send(self, stream, outputs, final=False):
        if not stream.request.send(outputs, final=final) or final:
            stream.over = True  # ended, or the request is gone (cancelled): dropped
