"""Runs examples/llm_uvicorn for real: a store, `uvicorn --workers 4`, greedy generation.

A random Llama checkpoint with a tokenizer (examples/llm_uvicorn/make_checkpoint.py),
a `hearth store` on $HEARTH_TEST_DEVICE holding its weights, and app.py under
`uvicorn --workers 4` on a free port. Checks: the 4 workers hold 4 leases on
the store's one copy (in host memory: the same memfd, mapped once each), the
supervisor loaded no torch and maps nothing, the tokens and text of greedy
requests equal from_pretrained + generate of the same checkpoint in this
process, at least two workers answered, a sampled request answers, and each
bad request gets its HTTP error. Skipped, saying why, without torch 2,
transformers, fastapi or uvicorn.
"""

import concurrent.futures
import json
import pathlib
import shutil
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

import hearth_testing as ht
from hearth_testing import DEVICE, ON_CUDA
from process_group import start, stop
from llm_checkpoints import MISSING, SHARDED, make_checkpoint, store_path

EXAMPLE = ht.ROOT / "examples" / "llm_uvicorn"
WORKERS = 4
MAX_NEW_TOKENS = 24
MAX_PROMPT_TOKENS = 100  # app.py refuses prompts longer than 16 x this in characters
MAX_POSITIONS = 64


def _missing():
    if MISSING:
        return MISSING
    for name in ("fastapi", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            return f"{name} is not importable"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, payload=None, timeout=120, raw=None):
    """(status, JSON body or text) of a GET, or of a POST of `payload` as JSON (or `raw` bytes)."""
    data = raw if raw is not None else (None if payload is None else json.dumps(payload).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, body.decode(errors="replace")


def healthy(url):
    try:
        return http(url, timeout=5)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


def children(pid):
    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def cmdline(pid):
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def maps_text(pid):
    return pathlib.Path(f"/proc/{pid}/maps").read_text()


@pytest.fixture(scope="module")
def service():
    directory = pathlib.Path(tempfile.mkdtemp(prefix="hearth-llmuv-"))
    checkpoint = directory / "llama"
    try:
        summary = make_checkpoint(checkpoint, "--max-positions", str(MAX_POSITIONS),
                                  *(["--max-shard-size", "200KB"] if SHARDED else []))
        with ht.running_store({"llama": store_path(checkpoint, summary)}) as store:
            port = free_port()
            log = directory / "uvicorn.log"
            env = ht.child_env(HEARTH_SOCKET=store.socket, HEARTH_CHECKPOINT=str(checkpoint),
                               HEARTH_MODEL="llama", MAX_NEW_TOKENS=str(MAX_NEW_TOKENS),
                               MAX_PROMPT_TOKENS=str(MAX_PROMPT_TOKENS), TORCH_THREADS="1")
            proc = start([sys.executable, "-m", "uvicorn", "app:app", "--workers", str(WORKERS),
                          "--host", "127.0.0.1", "--port", str(port)], EXAMPLE, env, log)
            try:
                base = f"http://127.0.0.1:{port}"
                ht.wait_for(lambda: (ht.store_attached_count(store.socket, "llama") >= WORKERS
                                     and healthy(base + "/health")),
                            "uvicorn to come up", timeout=300, procs=(proc,), log=log)
                yield base, proc, store, checkpoint
            finally:
                rc = stop(proc)
                assert rc == 0, f"uvicorn exited with {rc}:\n" + log.read_text(errors="replace")[-6000:]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def reference_generate(checkpoint, prompts, new_tokens):
    """{prompt: (new tokens, text, prompt tokens)} from from_pretrained, greedy, as app.py asks."""
    import torch
    import transformers

    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, local_files_only=True, **{dtype_key: torch.bfloat16}).to(DEVICE).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    pad = model.generation_config.pad_token_id
    out = {}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(DEVICE)
        with torch.inference_mode():
            full = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=pad if pad is not None else tokenizer.eos_token_id)
        new = full[0, ids.shape[1]:].tolist()
        out[prompt] = (new, tokenizer.decode(new, skip_special_tokens=True), ids.shape[1])
    return out


def test_four_workers_generate_what_from_pretrained_generates(service):
    base, proc, store, checkpoint = service
    supervisor = proc.pid
    workers = [c for c in children(supervisor) if "spawn_main" in cmdline(c)]
    assert len(workers) == WORKERS, [cmdline(c) for c in children(supervisor)]
    assert "libtorch" not in maps_text(supervisor), "the uvicorn supervisor loaded torch"
    assert ht.arena_maps(supervisor) == [], "the uvicorn supervisor maps the arena"
    if not ON_CUDA:
        inodes = {pid: [m[2] for m in ht.arena_maps(pid)] for pid in workers}
        assert all(len(v) == 1 for v in inodes.values()), inodes
        assert len({v[0] for v in inodes.values()}) == 1, f"different arenas: {inodes}"

    prompts = ["hello hearth", "one copy of the weights", "The quick brown fox",
               "uvicorn starts its workers", "a", "ünïcödé ✓ and more", "hello world " * 4]
    expected = reference_generate(checkpoint, prompts, MAX_NEW_TOKENS)
    payloads = [{"prompt": p, "max_new_tokens": MAX_NEW_TOKENS} for p in prompts] * 3
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: (p, *http(base + "/generate", p)), payloads))
    deadline = time.monotonic() + 120
    while len({b["pid"] for _, s, b in answers if s == 200}) < 2 and time.monotonic() < deadline:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers += list(pool.map(lambda p: (p, *http(base + "/generate", p)), payloads[:8]))
    for payload, status, body in answers:
        assert status == 200, f"{payload}: {status} {body}"
        tokens, text, prompt_tokens = expected[payload["prompt"]]
        assert body["token_ids"] == tokens, payload
        assert body["text"] == text, payload
        assert body["prompt_tokens"] == prompt_tokens
        assert body["finish_reason"] in ("stop", "length")
        assert body["model"] == "llama"
    assert len({tuple(b["token_ids"]) for _, _, b in answers}) > 1, "every answer is the same"
    pids = {b["pid"] for _, _, b in answers}
    assert len(pids) >= 2, f"only worker(s) {pids} answered {len(answers)} requests"
    assert pids <= set(workers), (pids, workers)

    status, body = http(base + "/generate", {"prompt": "hello", "max_new_tokens": 8,
                                             "temperature": 0.8, "top_p": 0.9})
    assert status == 200 and 1 <= len(body["token_ids"]) <= 8, body
    status, body = http(base + "/health")
    assert status == 200 and body["device"] == DEVICE and body["model"] == "llama", body
    assert ht.store_attached_count(store.socket, "llama") == WORKERS


def test_bad_requests_get_http_errors(service):
    import transformers

    base, _, _, checkpoint = service
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    # A prompt short enough to be accepted, long enough that MAX_NEW_TOKENS more pass the
    # model's positions.
    long_prompt = "hello world"
    while len(tokenizer(long_prompt)["input_ids"]) <= MAX_POSITIONS - MAX_NEW_TOKENS:
        long_prompt += " hello world"
    prompt_tokens = len(tokenizer(long_prompt)["input_ids"])
    assert prompt_tokens <= MAX_PROMPT_TOKENS, prompt_tokens
    too_many = MAX_POSITIONS - prompt_tokens + 1
    cases = [
        ({"prompt": "x", "max_new_tokens": MAX_NEW_TOKENS + 1}, 400, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": 0}, 400, "max_new_tokens"),
        ({"prompt": "", "max_new_tokens": 4}, 400, "empty"),
        ({"prompt": "x" * (16 * MAX_PROMPT_TOKENS + 1)}, 400, "characters"),
        ({"prompt": "hello " * (MAX_PROMPT_TOKENS + 1)}, 400, "tokens"),
        ({"prompt": "x", "temperature": 2.5}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": 5}, 422, "prompt"),
        ({"prompt": "x", "max_new_tokens": "4"}, 422, "max_new_tokens"),
        ({"max_new_tokens": 4}, 422, "prompt"),
        ({"prompt": long_prompt, "max_new_tokens": too_many}, 400, "positions"),
    ]
    for payload, want, word in cases:
        status, body = http(base + "/generate", payload)
        assert status == want and word in json.dumps(body), f"{payload}: {status} {body}"
    status, body = http(base + "/generate", raw=b"{not json")
    assert status == 422, (status, body)
    # Still serving.
    status, body = http(base + "/generate", {"prompt": "hello", "max_new_tokens": 2})
    assert status == 200 and len(body["token_ids"]) <= 2, body
