"""Seed 003's pattern, for comparison with hearth serve: N uvicorn workers
(FastAPI), each loading its own copy of a Llama checkpoint onto the GPU at
start-up, serving /v1/completions with server-sent events.

    HEARTH_BASELINE_CHECKPOINT=DIR uvicorn generate_baseline_app:app --workers 4 --port 9000

Each token comes from the same loop as hearth's examples/generate/llama
model.py (its Model class, given a model loaded with from_pretrained instead
of the store's weights), so the two differ only in how the weights are held
and how requests reach the loop.
"""
import importlib.util
import json
import os
import pathlib
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKPOINT = os.environ.get("HEARTH_BASELINE_CHECKPOINT", "")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402

app = FastAPI()
state = {}


def _load():
    import torch
    import transformers
    spec = importlib.util.spec_from_file_location("llama_model", ROOT / "examples/generate/llama/model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    m = module.Model()
    # This process's own copy, as seed 003's workers load it.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        CHECKPOINT, torch_dtype=torch.bfloat16, local_files_only=True).to("cuda").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(CHECKPOINT, local_files_only=True)
    m.bind(model, tokenizer, {"output": [], "parameters": {}})
    state["model"] = m
    state["lock"] = threading.Lock()


class _Request:
    """One request as hearth.Request gives it to the model: its responses kept here."""

    def __init__(self, inputs, parameters):
        self.id, self.inputs, self.parameters, self.resume_token_ids = "", inputs, parameters, []
        self.responses, self.done, self.error = [], False, None

    def is_cancelled(self):
        return False

    def send(self, outputs=None, final=False):
        self.responses.append(outputs or {})
        self.done = self.done or final
        return True

    def fail(self, error):
        self.error, self.done = error, True


@app.on_event("startup")
async def startup():
    _load()


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    m = state["model"]
    parameters = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop") if k in body}
    inputs = {"text_input": np.array([body["prompt"].encode()], dtype=object)}

    def outputs():
        # One stream at a time in this process, as seed 003's worker runs it.
        with state["lock"]:
            r = _Request(inputs, parameters)
            m.execute([r])
            while True:
                while r.responses:
                    yield r.responses.pop(0)
                if r.done:
                    break
                m.step()
            if r.error is not None:
                raise r.error

    def events():
        created = int(time.time())
        for out in outputs():
            chunk = {"object": "text_completion", "created": created, "model": body.get("model", ""),
                     "choices": [{"index": 0, "text": out["text_output"].reshape(-1)[0].decode()
                                  if "text_output" in out else "",
                                  "finish_reason": None}]}
            if "completion_tokens" in out:
                chunk["usage"] = {"prompt_tokens": int(out["prompt_tokens"][0]),
                                  "completion_tokens": int(out["completion_tokens"][0])}
                chunk["choices"][0]["finish_reason"] = out["finish_reason"].reshape(-1)[0].decode()
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
