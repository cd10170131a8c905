"""A multi-worker FastAPI "generation" service over one shared copy of the weights.

    uvicorn app:app --workers 4 --host 127.0.0.1 --port 8000

The situation of seeds/windows-multiworker-llm.txt: uvicorn starts its
workers with the `spawn` method, each a fresh interpreter, and loading the
model in each of them holds N copies. Here every worker attaches, at startup,
to the one copy a `hearth store` holds (read-only, no copy): the supervisor
process imports nothing of the model and maps nothing.

Environment:
    HEARTH_SOCKET   the store's socket (else the library's default path); on Windows
                    the store's pipe name, the NAME of `hearth store --socket NAME`
    HEARTH_MODEL    the model name (default "tiny"), an `mlp` checkpoint:
                    encoder.weight [H, I], encoder.bias [H], head.weight [O, H], head.bias [O]
                    (`hearth make-model mlp --dims 256,64,256` makes one whose input and
                    output vocabularies are the 256 byte values)

POST /generate {"prompt": str, "max_new_tokens": k}  ->  {"tokens": [...], "text": str, "pid": int}

    A toy greedy decoder, deterministic and documented so a client can check it:
      context = list(prompt.encode("utf-8"))              # token ids: the prompt's bytes
      repeat k times:
        x = zeros(I, float32)                             # recency-weighted bag of tokens:
        for t in context: x *= 0.5; x[t % I] += 1         #   the newest token weighs 1, older ones halve
        logits = relu(x @ W1.T + b1) @ W2.T + b2          # float32, the mlp's forward
        token = argmax(logits)                            # first maximum wins
        context.append(token); tokens.append(token)
    "text" is bytes(t % 256 for t in tokens) decoded as latin-1.

GET /health  ->  {"status": "ok", "pid", "model", "version", "device", "checksum"}
    (checksum: the store's, as `hearth inspect` prints it for the checkpoint)
"""

import inspect
import os
from contextlib import asynccontextmanager

import numpy as np
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

import hearth

MODEL = os.environ.get("HEARTH_MODEL", "tiny")
MAX_NEW_TOKENS = 256
MAX_PROMPT_BYTES = 65536

state = {}  # per worker process: "weights" and the numpy views


def attach_weights():
    """Runs in each worker at startup: maps the store's copy read-only (no copy)."""
    weights = hearth.attach(MODEL)
    if weights.device != "cpu":
        raise RuntimeError(f"model {MODEL!r} is on {weights.device}; this example computes "
                           "with numpy and needs a store on host memory (--device cpu)")
    names = ("encoder.weight", "encoder.bias", "head.weight", "head.bias")
    missing = [n for n in names if n not in weights]
    if missing:
        raise RuntimeError(f"model {MODEL!r} is not an mlp: missing {', '.join(missing)}")
    w1, b1, w2, b2 = (weights[n].numpy() for n in names)  # read-only views
    state.update(weights=weights, w1=w1, b1=b1, w2=w2, b2=b2)


def release_weights():
    state.clear()  # the last reference goes: unmapped, lease ended


if "lifespan" in inspect.signature(FastAPI).parameters:
    @asynccontextmanager
    async def lifespan(_app):
        attach_weights()
        yield
        release_weights()

    app = FastAPI(title="hearth toy generator", lifespan=lifespan)
else:  # FastAPI < 0.93: startup/shutdown events
    app = FastAPI(title="hearth toy generator")
    app.add_event_handler("startup", attach_weights)
    app.add_event_handler("shutdown", release_weights)


class GenerateRequest(BaseModel):
    prompt: str
    max_new_tokens: int = 8


def encode(context, n_in):
    """The input vector of a context: a recency-weighted bag of its token ids."""
    x = np.zeros(n_in, dtype=np.float32)
    for t in context:
        x *= np.float32(0.5)
        x[t % n_in] += np.float32(1.0)
    return x


def generate(prompt, max_new_tokens, w1, b1, w2, b2):
    """The toy greedy decoder described in the module docstring."""
    n_in = w1.shape[1]
    x = encode(prompt.encode("utf-8"), n_in)
    tokens = []
    for _ in range(max_new_tokens):
        hidden = np.maximum(x @ w1.T + b1, np.float32(0))
        logits = hidden @ w2.T + b2
        token = int(np.argmax(logits))
        tokens.append(token)
        x *= np.float32(0.5)  # the same as encode(context + [token]), incrementally
        x[token % n_in] += np.float32(1.0)
    return tokens


@app.post("/generate")
def generate_endpoint(req: GenerateRequest):
    # A plain `def`: FastAPI runs it in a thread, so numpy does not block the event loop.
    if not 0 <= req.max_new_tokens <= MAX_NEW_TOKENS:
        raise HTTPException(400, f"max_new_tokens must be from 0 to {MAX_NEW_TOKENS}")
    if len(req.prompt.encode("utf-8")) > MAX_PROMPT_BYTES:
        raise HTTPException(400, f"prompt longer than {MAX_PROMPT_BYTES} bytes")
    tokens = generate(req.prompt, req.max_new_tokens,
                      state["w1"], state["b1"], state["w2"], state["b2"])
    text = bytes(t % 256 for t in tokens).decode("latin-1")
    return {"tokens": tokens, "text": text, "pid": os.getpid()}


@app.get("/health")
def health():
    weights = state.get("weights")
    if weights is None:
        raise HTTPException(503, "weights not attached")
    return {"status": "ok", "pid": os.getpid(), "model": weights.model,
            "version": weights.version, "device": weights.device,
            "checksum": f"{weights.checksum:016x}"}
