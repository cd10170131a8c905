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
    m = module.Model.__new__(module.Model)
    # What Model.initialize sets, from a copy of this process's own.
    m.model = transformers.AutoModelForCausalLM.from_pretrained(
        CHECKPOINT, torch_dtype=torch.bfloat16, local_files_only=True).to("cuda").eval()
    m.tokenizer = transformers.AutoTokenizer.from_pretrained(CHECKPOINT, local_files_only=True)
    m.device = m.model.device
    eos = m.model.generation_config.eos_token_id
    if eos is None:
        eos = m.tokenizer.eos_token_id
    m.eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    m.max_positions = getattr(m.model.config, "max_position_embeddings", None)
    m.max_prompt_tokens, m.max_tokens_limit, m.token_ids, m.marker_dir = 4096, 1024, False, None
    import inspect
    accepted = set(inspect.signature(m.model.forward).parameters)
    m.keep_last = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in accepted), None)
    m.positions = "position_ids" in accepted
    m.cache_position = "cache_position" in accepted
    state["model"] = m


@app.on_event("startup")
async def startup():
    _load()


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    m = state["model"]
    parameters = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop") if k in body}
    inputs = {"text_input": np.array([body["prompt"].encode()], dtype=object)}

    def events():
        created = int(time.time())
        for out in m.execute(inputs, parameters):
            chunk = {"object": "text_completion", "created": created, "model": body.get("model", ""),
                     "choices": [{"index": 0, "text": out["text_output"].reshape(-1)[0].decode(),
                                  "finish_reason": None}]}
            if "completion_tokens" in out:
                chunk["usage"] = {"prompt_tokens": int(out["prompt_tokens"][0]),
                                  "completion_tokens": int(out["completion_tokens"][0])}
                chunk["choices"][0]["finish_reason"] = out["finish_reason"].reshape(-1)[0].decode()
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
