"""Seed 003's FastAPI `/generate` service on one copy of a Llama checkpoint's weights.

    uvicorn app:app --workers 4 --host 127.0.0.1 --port 8000

The seed (seeds/windows-multiworker-llm.txt) loads the model with
`from_pretrained` in every uvicorn worker: N workers, N copies. Here a `hearth
store` holds the checkpoint's weights once; every worker (uvicorn starts them
with `spawn`: fresh interpreters) builds the model with hearth.transformers
in its startup, binding the store's read-only tensors without a copy, and
loads only the small files (config, generation config, tokenizer) from the
checkpoint directory. The supervisor process imports neither torch nor the
model. The model runs on the store's device.

Environment:
    HEARTH_CHECKPOINT   the checkpoint directory (config.json, tokenizer files); required
    HEARTH_MODEL        the store's model name (default "llama")
    HEARTH_SOCKET       the store's socket (else the library's default path); on Windows
                        the store's pipe name, the NAME of `hearth store --socket NAME`
    MAX_NEW_TOKENS      the largest max_new_tokens a request may ask for (default 256)
    MAX_PROMPT_TOKENS   the longest prompt, in tokens (default 2048)
    MAX_CONCURRENT      generations running at once in one worker (default 1)
    MAX_WAITING         requests waiting for one of those in one worker (default 8);
                        past that a request is answered 503 at once
    WAIT_SECONDS        how long a request waits for a generation slot (default 60)
    TORCH_THREADS       torch's intra-op threads per worker (default: torch's own)

POST /generate
    {"prompt": str, "max_new_tokens": int = min(64, MAX_NEW_TOKENS), "temperature": float = 0,
     "top_p": float = 1}
    -> {"text": str, "token_ids": [int], "prompt_tokens": int, "finish_reason": "stop"|"length",
        "model": str, "pid": int}
    temperature 0 is greedy decoding (deterministic: what `from_pretrained` of the same
    checkpoint generates); above 0, sampling with that temperature and top_p.
    400: an empty or too long prompt, max_new_tokens out of range, prompt + new tokens
    beyond the model's positions, temperature or top_p out of range; 422: wrong JSON types;
    503: the worker is busy (MAX_WAITING reached or WAIT_SECONDS passed) or out of device
    memory; 500: generation failed (the message says why; the worker serves on).
GET /health -> {"status": "ok", "pid", "model", "version", "device", "checksum"}; 503 while
    the model is not loaded.
"""

import contextlib
import inspect
import logging
import os
import threading
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, StrictInt, StrictStr

import hearth
import hearth.transformers

MODEL = os.environ.get("HEARTH_MODEL", "llama")
CHECKPOINT = os.environ.get("HEARTH_CHECKPOINT")
MAX_NEW_TOKENS = int(os.environ.get("MAX_NEW_TOKENS", "256"))
DEFAULT_NEW_TOKENS = min(64, MAX_NEW_TOKENS)
MAX_PROMPT_TOKENS = int(os.environ.get("MAX_PROMPT_TOKENS", "2048"))
MAX_PROMPT_CHARS = 16 * MAX_PROMPT_TOKENS  # checked before tokenizing: bounds the tokenizer's work
MAX_CONCURRENT = int(os.environ.get("MAX_CONCURRENT", "1"))
MAX_WAITING = int(os.environ.get("MAX_WAITING", "8"))
WAIT_SECONDS = float(os.environ.get("WAIT_SECONDS", "60"))

log = logging.getLogger("llm_uvicorn")
state = {}  # per worker: weights, model, tokenizer, admission


class Busy(Exception):
    pass


class Admission:
    """At most `running` generations at once and `waiting` more queued; the rest are refused."""

    def __init__(self, running, waiting):
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(running)
        self._admitted = 0
        self._limit = running + waiting

    @contextlib.contextmanager
    def slot(self, timeout):
        with self._lock:
            if self._admitted >= self._limit:
                raise Busy(f"{self._admitted} requests already admitted by worker {os.getpid()}")
            self._admitted += 1
        try:
            if not self._slots.acquire(timeout=timeout):
                raise Busy(f"no generation slot within {timeout:g} s")
            try:
                yield
            finally:
                self._slots.release()
        finally:
            with self._lock:
                self._admitted -= 1


def load_model():
    """Runs in each worker at startup: the store's one copy, bound without a copy."""
    if not CHECKPOINT:
        raise RuntimeError("set HEARTH_CHECKPOINT to the checkpoint directory (config.json, "
                           "tokenizer files)")
    import torch

    if os.environ.get("TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["TORCH_THREADS"]))
    weights = hearth.attach(MODEL)
    model = hearth.transformers.causal_lm(weights, CHECKPOINT)
    tokenizer = hearth.transformers.tokenizer(CHECKPOINT)
    state.update(weights=weights, model=model, tokenizer=tokenizer,
                 tokenizer_lock=threading.Lock(),  # fast tokenizers are not thread-safe
                 admission=Admission(MAX_CONCURRENT, MAX_WAITING),
                 max_positions=getattr(model.config, "max_position_embeddings", None))
    log.info("worker %d: %s@%d on %s, checkpoint %s", os.getpid(), weights.model,
             weights.version, weights.device, CHECKPOINT)


def release_model():
    state.clear()  # the last reference goes: unmapped, lease ended


if "lifespan" in inspect.signature(FastAPI).parameters:
    @asynccontextmanager
    async def lifespan(_app):
        load_model()
        yield
        release_model()

    app = FastAPI(title="hearth LLM generate", lifespan=lifespan)
else:  # FastAPI < 0.93 (Debian 12's 0.92): startup/shutdown events
    app = FastAPI(title="hearth LLM generate")
    app.add_event_handler("startup", load_model)
    app.add_event_handler("shutdown", release_model)


class GenerateRequest(BaseModel):
    prompt: StrictStr
    max_new_tokens: Optional[StrictInt] = None  # None: DEFAULT_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0


def check(req, prompt_tokens):
    if req.max_new_tokens is None:
        req.max_new_tokens = DEFAULT_NEW_TOKENS
    if not 1 <= req.max_new_tokens <= MAX_NEW_TOKENS:
        raise HTTPException(400, f"max_new_tokens must be from 1 to {MAX_NEW_TOKENS}, "
                                 f"not {req.max_new_tokens}")
    if not 0.0 <= req.temperature <= 2.0:
        raise HTTPException(400, f"temperature must be from 0 to 2, not {req.temperature}")
    if not 0.0 < req.top_p <= 1.0:
        raise HTTPException(400, f"top_p must be above 0 and at most 1, not {req.top_p}")
    if prompt_tokens is None:
        return
    if prompt_tokens == 0:
        raise HTTPException(400, "the prompt is empty (no tokens)")
    if prompt_tokens > MAX_PROMPT_TOKENS:
        raise HTTPException(400, f"the prompt has {prompt_tokens} tokens; at most "
                                 f"{MAX_PROMPT_TOKENS} are accepted")
    limit = state.get("max_positions")
    if limit and prompt_tokens + req.max_new_tokens > limit:
        raise HTTPException(400, f"prompt ({prompt_tokens} tokens) + max_new_tokens "
                                 f"({req.max_new_tokens}) exceeds the model's {limit} positions")


@app.post("/generate")
def generate(req: GenerateRequest):
    # A plain `def`: FastAPI runs it on its thread pool, so generation never blocks the event
    # loop; Admission bounds how many of those threads one worker lets in.
    if "model" not in state:
        raise HTTPException(503, "the model is not loaded")
    check(req, None)
    if not req.prompt:
        raise HTTPException(400, "the prompt is empty")
    if len(req.prompt) > MAX_PROMPT_CHARS:
        raise HTTPException(400, f"the prompt has {len(req.prompt)} characters; at most "
                                 f"{MAX_PROMPT_CHARS} are accepted")
    import torch

    model, tokenizer = state["model"], state["tokenizer"]
    try:
        with state["admission"].slot(WAIT_SECONDS):
            with state["tokenizer_lock"]:
                ids = tokenizer(req.prompt, return_tensors="pt")["input_ids"]
            check(req, ids.shape[1])
            options = dict(max_new_tokens=req.max_new_tokens, do_sample=req.temperature > 0,
                           pad_token_id=(model.generation_config.pad_token_id
                                         if model.generation_config.pad_token_id is not None
                                         else tokenizer.eos_token_id))
            if options["do_sample"]:
                options.update(temperature=req.temperature, top_p=req.top_p)
            ids = ids.to(model.device)
            try:
                with torch.inference_mode():
                    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         **options)
            except torch.cuda.OutOfMemoryError as e:
                torch.cuda.empty_cache()
                raise HTTPException(503, f"out of device memory: {e}") from None
            new = out[0, ids.shape[1]:].tolist()
            with state["tokenizer_lock"]:
                text = tokenizer.decode(new, skip_special_tokens=True)
    except Busy as e:
        raise HTTPException(503, f"busy: {e}", headers={"Retry-After": "1"}) from None
    except HTTPException:
        raise
    except Exception as e:  # the worker serves on; the client learns what failed
        log.exception("generation failed")
        raise HTTPException(500, f"generation failed: {type(e).__name__}: {e}") from None
    eos = tokenizer.eos_token_id
    finish = "stop" if new and eos is not None and new[-1] == eos else "length"
    return {"text": text, "token_ids": new, "prompt_tokens": int(ids.shape[1]),
            "finish_reason": finish, "model": MODEL, "pid": os.getpid()}


@app.get("/health")
def health():
    weights = state.get("weights")
    if weights is None or "model" not in state:
        raise HTTPException(503, "the model is not loaded")
    return {"status": "ok", "pid": os.getpid(), "model": weights.model,
            "version": weights.version, "device": weights.device,
            "checksum": f"{weights.checksum:016x}"}
