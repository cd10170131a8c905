"""Seed 003's workload under `hearth serve`: a Llama-architecture checkpoint, streamed token by token.

`backend: python` with `model_transaction_policy: {decoupled: true}`. The
version directory is a Hugging Face checkpoint directory (config.json,
generation_config.json, the safetensors shards and their index, the
tokenizer files): the server's store loads its weights once, and every
worker builds the model with hearth.transformers.causal_lm over that one
read-only copy (no weight is read from the files by a worker); the
configuration, generation config and tokenizer come from the directory.

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

Decoding is a plain loop over the model's forward with its KV cache, given
what generate() gives it (the new tokens, the attention mask over the whole
sequence, their positions, logits only for the last position), so that
greedy decoding (argmax, no logits processors) picks token for token what
`model.generate(do_sample=False)` picks. Sampling: softmax(logits /
temperature), then top-p, drawn from a torch.Generator on the model's
device, seeded with `seed` (a fresh seed without one). Stopping is checked
at every token: a cancelled request (client gone, timeout) closes this
generator at its yield and the KV cache is dropped with it.

Config parameters: max_prompt_tokens (default 4096), max_tokens_limit (the
largest max_tokens a request may ask for; default 1024).
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


class Model:
    def initialize(self, args):
        directory = args["model_repository"]
        self.bind(hearth.transformers.causal_lm(args["weights"], directory),
                  hearth.transformers.tokenizer(directory), args["model_config"])

    def bind(self, model, tokenizer, config):
        """Serves `model` (a transformers causal LM) with `tokenizer`; `config`
        is the model's config in Triton's JSON form (its outputs and
        parameters are read). initialize() binds the store's weights; a
        program that loads a model otherwise (a baseline that gives each
        process its own copy) may bind that one and call execute() itself."""
        self.model = model
        self.tokenizer = tokenizer
        self.device = self.model.device
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_prompt_tokens = _config_parameter(config, "max_prompt_tokens", 4096)
        self.max_tokens_limit = _config_parameter(config, "max_tokens_limit", 1024)
        self.token_ids = any(o["name"] == "token_ids" for o in config.get("output", []))
        # The forward arguments generate() gives, where this version's model takes them.
        accepted = set(inspect.signature(self.model.forward).parameters)
        self.keep_last = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in accepted),
                              None)
        self.positions = "position_ids" in accepted
        self.cache_position = "cache_position" in accepted
        self.marker_dir = config.get("parameters", {}).get("closed_marker_dir", {}) \
            .get("string_value")

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

    def _pick(self, logits, temperature, top_p, generator):
        logits = logits.float()
        if temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=generator))

    def _forward(self, new, attention, past, start):
        """The logits after the last of `new` (the tokens after `past`, the
        KV cache: None at first, and the model makes its own, as generate's)."""
        kwargs = {"input_ids": new, "attention_mask": attention, "past_key_values": past,
                  "use_cache": True}
        n = new.shape[1]
        positions = torch.arange(start, start + n, device=self.device)
        if self.positions:
            kwargs["position_ids"] = positions.unsqueeze(0)
        if self.cache_position:
            kwargs["cache_position"] = positions
        if self.keep_last:
            kwargs[self.keep_last] = 1
        out = self.model(**kwargs)
        return out.logits[0, -1], out.past_key_values

    def execute(self, inputs, parameters):
        max_tokens, temperature, top_p, seed, stops = sampling(parameters, self.max_tokens_limit)
        ids = self.prompt(inputs)
        if self.max_positions and len(ids) + max_tokens > self.max_positions:
            raise RequestError(f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} come "
                               f"to more than the model's {self.max_positions} positions")
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else
                                  int.from_bytes(os.urandom(8), "little") >> 1)
        detokenizer, stop = Detokenizer(self.tokenizer), StopStrings(stops)
        finish, count, since = "length", 0, []

        def response(text, **more):
            out = {"text_output": _one(text.encode()), **more}
            if self.token_ids:
                out["token_ids"] = np.array(since, dtype=np.int64)
            since.clear()
            return out

        state = {"new": torch.tensor([ids], dtype=torch.long, device=self.device), "past": None}
        state["attention"] = torch.ones_like(state["new"])

        def step():
            """The next token; the cache grows by the tokens fed. No torch
            mode spans a yield: it is entered and left here."""
            with torch.inference_mode():
                start = state["attention"].shape[1] - state["new"].shape[1]
                logits, state["past"] = self._forward(state["new"], state["attention"],
                                                      state["past"], start)
                return self._pick(logits, temperature, top_p, generator)

        def feed(token):
            new = torch.tensor([[token]], dtype=torch.long, device=self.device)
            state["new"] = new
            state["attention"] = torch.cat([state["attention"], torch.ones_like(new)], dim=1)

        try:
            while True:
                token = step()
                count += 1
                since.append(token)
                if token in self.eos:
                    finish = "stop"
                    break
                piece = stop.feed(detokenizer.add(token))
                if piece:
                    yield response(piece)
                if stop.stopped:
                    finish = "stop"
                    break
                if count == max_tokens:
                    break
                feed(token)
        except GeneratorExit:  # the request is over early: closed at the yield
            if self.marker_dir:
                with open(os.path.join(self.marker_dir, f"closed-{os.getpid()}-{count}"), "w"):
                    pass
            raise
        finally:
            state.clear()  # the KV cache goes now, not when the generator is collected
        tail = ""
        if not stop.stopped:
            tail = stop.feed(detokenizer.flush())
            if stop.stopped:
                finish = "stop"
            tail += stop.flush()
        yield response(tail,
                       prompt_tokens=np.array([len(ids)], dtype=np.int64),
                       completion_tokens=np.array([count], dtype=np.int64),
                       finish_reason=_one(finish.encode()))
