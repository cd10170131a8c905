"""Text generation on the GPU: seed 003's workload on hearth serve beside
seed 003's own pattern and transformers' continuous batching, in one run.

    python3 bench/serve/generate_bench.py --build build-gpu --webroot .gpu/webroot/usr/lib/python3/dist-packages \\
        --workers 1,2 --streams 1,16,64,256 --max-streams 256 --continuous-batching 16,64,256 \\
        --chaos-seconds 60 --json gpu-out/generate.json

A Llama-architecture checkpoint in bf16 (--dtype; random weights, made
offline): --shape 1b, about 1 B parameters (hidden 2048, 16 layers, 32 heads,
8 KV heads, intermediate 8192, a small vocabulary, tied embeddings), or 8b,
Llama 3 8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads,
intermediate 14336, vocabulary 128256, untied; made on the GPU). Every
stream is POST /v1/completions, stream: true, greedy, max_tokens 128
(--max-tokens); the prompt is numbered ("Request 7: ..."), so that
concurrent streams differ, and stream k of a run always sends prompt k;
--prompt-tokens N pads each prompt with words until the checkpoint's
tokenizer counts N tokens (the tables give the prompt tokens the server
counted). Parts, each printed as a markdown table as it ends:

- hearth: examples/generate/llama (backend: python, decoupled) under
  `hearth serve`, one copy of the weights in the store, once per count in
  --workers, with `max_streams` (--max-streams; 0 leaves it out) and
  `max_tokens_limit` set in its config: device memory, output tokens per
  second, time to first token p50 and p99 as the clients see it and as
  the server's histogram bounds it (from a request's arrival to its first
  response from the worker), for each concurrency in
  --streams (each client sends one stream after another for --seconds),
  and the output tokens/s as a fraction of the weight-read floor: every
  step reads the weights once (an untied embedding table excepted), so S
  streams draw at most S x 4.0e12 / (the weights' bytes) tokens a second.
  After the last count (unless --no-kill-check), the time from a worker's
  SIGKILL to its replacement's ready line and to a short stream served.
- continuous batching (--continuous-batching SIZES; empty: skipped):
  transformers' `model.generate_batch` in one process on the same
  checkpoint and the same prompts, output tokens per second for each
  number of prompts. It runs in a child process, so that its failure
  (an older transformers, memory) is reported and the run goes on.
- baseline (--baseline-workers N; 0: skipped): bench/serve/generate_baseline_app.py
  under uvicorn --workers N, each worker loading its own copy (seed 003),
  the same decoding loop, at --baseline-streams.
- chaos (--chaos-seconds S; 0: skipped): --chaos-streams clients on
  --chaos-workers workers with `resumable: "true"`, each client sending a
  new stream as soon as one ends, while worker 0 is SIGKILLed every
  --chaos-every seconds. First every prompt's uninterrupted greedy text is
  fetched with no kills; then it counts failed streams, completed streams
  whose text differs from that reference, and the longest gap between two
  consecutive chunks any stream saw, and reads the replacements' start
  times from the server's log.

--device cpu runs the same code against examples/generate/tiny_decoder
(a dry run of the clients, tables and chaos; no device memory, and no
baseline, which needs a GPU). All numbers go to --json (default
OUT/generate.json), rewritten after each part.
"""
import argparse
import collections
import datetime
import inspect
import json
import math
import multiprocessing
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

PROMPT = "one copy of the weights, many worker processes, and"
# make_checkpoint.py's arguments for each --shape.
SHAPES = {
    "1b": ["--hidden", "2048", "--intermediate", "8192", "--layers", "16", "--heads", "32",
           "--kv-heads", "8"],
    "8b": ["--hidden", "4096", "--intermediate", "14336", "--layers", "32", "--heads", "32",
           "--kv-heads", "8", "--vocab", "128256", "--untied", "--fill-vocab", "--device", "cuda"],
}
# The memory bandwidth the weight-read floor assumes (an H200's, as bench/llm's).
BANDWIDTH = 4.0e12

# Prompts padded to --prompt-tokens (make_prompts), by number.
_PROMPTS = {}


def prompt(number):
    return _PROMPTS.get(number) or f"Request {number}: {PROMPT}"


def make_prompts(checkpoint, tokens, count):
    """Prompts 0 .. count - 1, each "Request k: " and then PROMPT's words over
    and over, as many as keep the checkpoint's tokenizer at `tokens` tokens
    or under. Returns how they were counted. Without transformers (or a
    checkpoint) a word stands for a token."""
    words = PROMPT.split()
    count_tokens = None
    how = "a word for a token (no tokenizer here)"
    if checkpoint is not None:
        try:
            import transformers
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
            count_tokens = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
            how = "the checkpoint's tokenizer"
        except ImportError:
            pass
    if count_tokens is None:
        count_tokens = lambda text: len(text.split())  # noqa: E731

    def padded(number, n):
        head = f"Request {number}:"
        return " ".join([head] + [words[i % len(words)] for i in range(n)])

    for number in range(count):
        low, high = 0, 4 * tokens  # the most filler words with at most `tokens` tokens
        while low < high:
            mid = (low + high + 1) // 2
            if count_tokens(padded(number, mid)) <= tokens:
                low = mid
            else:
                high = mid - 1
        _PROMPTS[number] = padded(number, low)
    return how


def weight_read_bytes(checkpoint):
    """The bytes a decode step reads of the checkpoint's weights: every
    tensor, but the embedding table only in the rows it gathers where the
    checkpoint has an lm_head.weight of its own (untied)."""
    sizes = {}
    for path in pathlib.Path(checkpoint).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                sizes[name] = end - begin
    total = sum(sizes.values())
    if "lm_head.weight" in sizes:
        total -= sizes.get("model.embed_tokens.weight", 0)
    return total


# ---- the client -----------------------------------------------------------------


def stream(port, model, number, max_tokens, timeout=600):
    """One streamed completion of prompt `number`. Never raises: a failure is
    its `error`. `ttft` is the seconds to the first text, `max_gap` the
    longest time between two consecutive events after the first."""
    body = json.dumps({"model": model, "prompt": prompt(number), "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    r = {"prompt": number, "ttft": None, "total": None, "tokens": None, "prompt_tokens": None,
         "text": "", "max_gap": 0.0, "finish": None, "error": None}
    pieces, last, done = [], None, False
    t0 = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                now = time.time()
                if last is not None:
                    r["max_gap"] = max(r["max_gap"], now - last)
                last = now
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    raise RuntimeError(error.get("message", error) if isinstance(error, dict) else error)
                choice = chunk["choices"][0]
                if choice.get("text"):
                    if r["ttft"] is None:
                        r["ttft"] = now - t0
                    pieces.append(choice["text"])
                if choice.get("finish_reason"):
                    r["finish"] = choice["finish_reason"]
                if chunk.get("usage"):
                    r["tokens"] = chunk["usage"]["completion_tokens"]
                    r["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
        if not done or r["finish"] is None:
            raise RuntimeError("the stream ended without its finish chunk and [DONE]")
    except Exception as e:  # noqa: BLE001: every failure is counted, whatever its kind
        r["error"] = f"{type(e).__name__}: {e}"[:300]
    r["total"] = time.time() - t0
    r["text"] = "".join(pieces)
    return r


def _client_process(path, port, model, numbers, stop_at, max_tokens, once):
    """Runs in a child process: one thread per prompt number, each sending
    one stream after another until `stop_at` (one stream only if `once`);
    then writes every stream's record to `path` as JSON."""
    results, lock = [], threading.Lock()

    def client(number):
        while True:
            r = stream(port, model, number, max_tokens)
            with lock:
                results.append(r)
            if once or time.time() >= stop_at:
                return

    threads = [threading.Thread(target=client, args=(n,)) for n in numbers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pathlib.Path(path).write_text(json.dumps(results))


class Clients:
    """`concurrency` client threads spread over client processes (one Python
    process parsing 256 streams' events would be the bottleneck), started
    at once; result() waits for them and returns every stream's record and
    the wall time. The processes are forked from this thread before any
    client thread exists, and hand their records back in files, so that
    none blocks on a full pipe while running() is asked."""

    def __init__(self, port, model, concurrency, seconds, max_tokens, processes=0, once=False):
        if processes <= 0:
            processes = max(1, min((os.cpu_count() or 2) // 2, math.ceil(concurrency / 32)))
        processes = min(processes, concurrency)
        context = multiprocessing.get_context("fork")
        self._dir = tempfile.TemporaryDirectory(prefix="hearth-generate-clients-")
        self._t0 = time.time()
        stop_at = self._t0 + seconds
        self._procs = []
        for p in range(processes):
            path = pathlib.Path(self._dir.name) / f"{p}.json"
            proc = context.Process(target=_client_process,
                                   args=(path, port, model, list(range(p, concurrency, processes)),
                                         stop_at, max_tokens, once))
            proc.start()
            self._procs.append((proc, path))

    def running(self):
        return any(proc.is_alive() for proc, _ in self._procs)

    def result(self):
        results = []
        for proc, path in self._procs:
            proc.join()
            if proc.exitcode != 0 or not path.exists():
                raise RuntimeError(f"a client process exited with {proc.exitcode}")
            results += json.loads(path.read_text())
        wall = time.time() - self._t0
        self._dir.cleanup()
        return results, wall


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def first_responses(port, model):
    """hearth's histogram of time to first response for `model` from its
    /metrics (from the request's arrival at the server to the worker's first
    response reaching it): {bucket bound: count}; None where the server has
    none (another server, or no stream yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    pattern = r'hearth_stream_first_response_seconds_bucket\{model="%s",le="([^"]+)"\} (\d+)'
    found = re.findall(pattern % re.escape(model), text)
    return {bound: int(n) for bound, n in found} or None


def bucket_bound_ms(before, after, q):
    """The bound, in ms, of the first bucket that holds q of the first
    responses counted between two scrapes ("+Inf" past the last bound);
    None without both scrapes or with none counted."""
    if before is None or after is None:
        return None
    rows = sorted((float("inf") if b == "+Inf" else float(b), n - before.get(b, 0)) for b, n in after.items())
    total = rows[-1][1] if rows else 0
    if total <= 0:
        return None
    for bound, n in rows:
        if n >= q * total:
            return "+Inf" if bound == float("inf") else round(bound * 1000, 3)
    return None


def load(port, model, concurrency, seconds, max_tokens, processes=0):
    before = first_responses(port, model)
    results, wall = Clients(port, model, concurrency, seconds, max_tokens, processes).result()
    after = first_responses(port, model)
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    prompt_tokens = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
    errors = collections.Counter(r["error"] for r in results if r["error"] is not None)
    return {"concurrency": concurrency, "streams": len(results), "failed": len(results) - len(ok),
            "wall_s": wall, "tokens_per_s": sum(r["tokens"] or 0 for r in ok) / wall,
            "prompt_tokens_p50": statistics.median(prompt_tokens) if prompt_tokens else None,
            "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else None,
            "ttft_p99_ms": 1000 * percentile(ttft, 0.99) if ttft else None,
            # The server's own, from its histogram: at most these bounds.
            "server_ttft_p50_le_ms": bucket_bound_ms(before, after, 0.5),
            "server_ttft_p99_le_ms": bucket_bound_ms(before, after, 0.99),
            "errors": dict(errors.most_common(5))}


def warm(port, model, streams):
    """`streams` short streams at once, so that every worker has run once (its
    first run loads kernels) before anything is timed."""
    results, _ = Clients(port, model, streams, 0, 4, once=True).result()
    failed = [r["error"] for r in results if r["error"]]
    if failed:
        print(f"warm-up: {len(failed)} of {len(results)} streams failed: {failed[0]}", flush=True)


# ---- processes ------------------------------------------------------------------


def wait_port(log, pattern, proc, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(pattern, pathlib.Path(log).read_text())
        if m:
            return m
        if proc.poll() is not None:
            raise SystemExit(f"{log}: exited\n" + pathlib.Path(log).read_text()[-3000:])
        time.sleep(0.1)
    raise SystemExit(f"{log}: not ready in {timeout} s")


def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def device_mib(a):
    if a.device != "cuda":
        return None
    from serve_bench import settled_used_mib
    return settled_used_mib()


def set_parameters(config, values):
    """Sets entries of config.yaml's `parameters:` block (make_repository.py
    writes it last, one `  key: "value"` line per entry), replacing an entry
    already there, so that this works whichever of them make_repository.py
    learns to write itself."""
    lines = config.read_text().splitlines()
    start = lines.index("parameters:") + 1
    end = start
    while end < len(lines) and lines[end].startswith("  "):
        end += 1
    entries = {}
    for line in lines[start:end]:
        key, _, value = line.strip().partition(": ")
        entries[key] = value
    entries.update({k: json.dumps(str(v)) for k, v in values.items()})
    lines[start:end] = [f"  {k}: {v}" for k, v in entries.items()]
    config.write_text("\n".join(lines) + "\n")


class Models:
    """The model repositories of a run: one per worker count and config
    parameters, over one checkpoint (the Llama one is made once and linked
    into each)."""

    def __init__(self, a, tmp, env):
        self._a, self._tmp, self._env = a, tmp, env
        self._count = 0
        self.name = "llama" if a.device == "cuda" else "tiny_decoder"
        self.checkpoint = None
        self.made = {}
        if a.device == "cuda":
            base = tmp / "checkpoint"
            t0 = time.time()
            dtype = [] if a.dtype == "bfloat16" else ["--dtype", a.dtype]
            self._run("llama", base, "--workers", "1", *dtype, "--", *SHAPES[a.shape])
            self.checkpoint = base / "llama" / "1"
            size = sum(f.stat().st_size for f in self.checkpoint.glob("*.safetensors")) / 2**20
            self.made = {"shape": a.shape, "checkpoint_mib": size, "made_s": time.time() - t0,
                         "weight_read_bytes": weight_read_bytes(self.checkpoint)}

    def _run(self, example, repo, *args):
        subprocess.run([sys.executable, str(ROOT / f"examples/generate/{example}/make_repository.py"),
                        str(repo), *args], check=True, env=self._env, stdout=subprocess.DEVNULL)

    def repository(self, workers, max_streams, resumable, hot_spares=0):
        self._count += 1
        repo = self._tmp / f"repo-{self._count}"
        if self._a.backend == "llm":
            # The checkpoint's files as they are, and the three lines a user writes.
            version = repo / self.name / "1"
            version.mkdir(parents=True)
            for f in self.checkpoint.iterdir():
                if f.name != "model.py":
                    (version / f.name).symlink_to(f)
            engine = f", gemm_engine: \"{self._a.gemm_engine}\"" if self._a.gemm_engine else ""
            spares = (f", standby_workers: \"{hot_spares}\", standby_mode: \"hot\"" if hot_spares else "")
            (repo / self.name / "config.yaml").write_text(
                f"backend: llm\ninstance_group: [{{count: {workers}, kind: KIND_GPU}}]\n"
                f"parameters: {{max_streams: \"{max_streams or 256}\", "
                f"resumable: \"{'true' if resumable else 'false'}\"{engine}{spares}}}\n")
            return repo
        if self.checkpoint is not None:
            self._run("llama", repo, "--workers", str(workers), "--checkpoint", str(self.checkpoint))
        else:
            self._run("tiny_decoder", repo, "--workers", str(workers))
        parameters = {"resumable": "true" if resumable else "false"}
        if self.name == "llama":  # the tiny decoder's limit is its positions (512)
            parameters["max_tokens_limit"] = self._a.max_tokens
        if max_streams:
            parameters["max_streams"] = max_streams
        if hot_spares:
            parameters["standby_workers"], parameters["standby_mode"] = hot_spares, "hot"
        set_parameters(repo / self.name / "config.yaml", parameters)
        return repo


class Serve:
    """`hearth serve` on a repository, its log, and its workers' pids as the
    log names them."""

    def __init__(self, a, repo, model, env, log):
        self.model, self.log = model, log
        self.proc = subprocess.Popen([f"{a.build}/bin/hearth", "serve", "--model-repository", str(repo),
                                      "--http-port", "0", "--grpc-port", "-1", "--device", a.device],
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env=dict(env, HEARTH_PYTHON=sys.executable))
        self.port = int(wait_port(log, r"ready on http://127\.0\.0\.1:(\d+)", self.proc).group(1))

    def ready_lines(self, worker=0):
        """(pid, start in ms) for each ready line of `worker` and each hot
        spare's takeover of it (start 0: the spare was ready), in order."""
        m = re.escape(self.model)
        pattern = (rf"{m} worker {worker} ready: pid (\d+) on .*? in ([0-9.]+) ms"
                   rf"|{m} worker {worker}: the hot spare \(pid (\d+)\) takes over")
        return [(int(ready or spare), float(ms or 0)) for ready, ms, spare in re.findall(pattern, self.log.read_text())]

    def stop(self):
        stop(self.proc)


# ---- the parts ------------------------------------------------------------------


def table(title, header, rows):
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join("" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)
                                for v in row) + " |")
    print(flush=True)


def server_ttft(r):
    """The server's TTFT bounds of a load() row, or None where it has none."""
    p50, p99 = r.get("server_ttft_p50_le_ms"), r.get("server_ttft_p99_le_ms")
    return None if p50 is None else f"{p50} / {p99}"


def load_table(title, runs, weight_bytes=None):
    """runs: [(workers, row from load())]; weight_bytes: what a step reads of
    the weights (None: no floor column)."""
    def of_floor(r):
        if not weight_bytes:
            return None
        return f"{r['tokens_per_s'] / (r['concurrency'] * BANDWIDTH / weight_bytes):.3f}"
    table(title, ["workers", "streams", "prompt tokens", "streams done", "failed", "output tokens/s",
                  "of the weight-read floor", "TTFT p50 (ms)", "TTFT p99 (ms)",
                  "server's TTFT p50 / p99 (ms, at most)"],
          [(w, r["concurrency"], r.get("prompt_tokens_p50"), r["streams"], r["failed"],
            r["tokens_per_s"], of_floor(r), r["ttft_p50_ms"], r["ttft_p99_ms"], server_ttft(r))
           for w, r in runs])
    for w, r in runs:
        for error, n in r["errors"].items():
            print(f"  {w} workers, {r['concurrency']} streams: {n} x {error}")


def hearth_part(a, models, env, tmp, results):
    runs = []
    for i, workers in enumerate(a.workers):
        repo = models.repository(workers, a.max_streams, resumable=False)
        before = device_mib(a)
        log = tmp / f"serve-{workers}w.log"
        serve = Serve(a, repo, models.name, env, log)
        entry = {"workers": workers, "max_streams": a.max_streams}
        results["hearth"].append(entry)
        try:
            warm(serve.port, models.name, 2 * workers)
            entry["worker_start_ms"] = [ms for w in range(workers) for _, ms in serve.ready_lines(w)[:1]]
            if before is not None:
                entry["device_mib"] = device_mib(a) - before
            entry["loads"] = []
            for c in a.streams:
                entry["loads"].append(load(serve.port, models.name, c, a.seconds, a.max_tokens,
                                           a.client_processes))
                runs.append((workers, entry["loads"][-1]))
                write_json(a, results)
            if a.kill_check and i == len(a.workers) - 1:
                entry["kill"] = kill_check(serve)
        finally:
            serve.stop()
            subprocess.run(["cp", str(log), a.out])
        write_json(a, results)
    shape = f" {a.shape}" if models.checkpoint is not None else ""
    load_table(f"hearth, {models.name}{shape}, max_streams {a.max_streams or 'unset'}, "
               f"max_tokens {a.max_tokens}", runs, models.made.get("weight_read_bytes"))
    for entry in results["hearth"]:
        extra = f", device memory {entry['device_mib']} MiB" if "device_mib" in entry else ""
        print(f"  {entry['workers']} workers: start {entry.get('worker_start_ms')} ms{extra}")
        if "kill" in entry:
            print(f"  SIGKILL of worker 0 while idle: replacement ready in {entry['kill']['ready_s']:.2f} s, "
                  f"a short stream served {entry['kill']['streaming_again_s']:.2f} s after the kill")


def kill_check(serve):
    """SIGKILL of an idle worker 0: seconds to its replacement's ready line
    and to the end of a short stream sent then."""
    pid = serve.ready_lines()[-1][0]
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    while len(serve.ready_lines()) < 2 and time.time() - killed < 120:
        time.sleep(0.01)
    ready = time.time() - killed
    r = stream(serve.port, serve.model, 0, 8)
    return {"ready_s": ready, "streaming_again_s": time.time() - killed, "stream_error": r["error"]}


def continuous_batching_part(a, models, env, results):
    """transformers' generate_batch, in a child process (this file with
    --continuous-batching-child): a failure there is reported, not fatal."""
    entry = results["continuous_batching"] = {"sizes": a.continuous_batching}
    checkpoint = models.checkpoint or "(none: the tiny decoder is no transformers checkpoint)"
    command = [sys.executable, __file__, "--continuous-batching-child", str(checkpoint),
               "--continuous-batching", ",".join(map(str, a.continuous_batching)),
               "--max-tokens", str(a.max_tokens), "--device", a.device, "--dtype", a.dtype,
               "--prompt-tokens", str(a.prompt_tokens)]
    if a.cb_num_blocks:
        command += ["--cb-num-blocks", str(a.cb_num_blocks)]
    if a.cb_max_batch_tokens:
        command += ["--cb-max-batch-tokens", str(a.cb_max_batch_tokens)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=a.cb_timeout)
        last = done.stdout.strip().splitlines()[-1:] or [""]
        if done.returncode != 0 or not last[0].startswith("{"):
            raise RuntimeError(f"exit {done.returncode}: " + (done.stderr or done.stdout).strip()[-1500:])
        entry.update(json.loads(last[0]))
    except Exception as e:  # noqa: BLE001: reported, and the other parts go on
        entry["error"] = f"{type(e).__name__}: {e}"
    write_json(a, results)
    if "error" in entry:
        print(f"\n### transformers generate_batch\n\n  failed: {entry['error']}\n", flush=True)
        return
    table(f"transformers generate_batch, one process (transformers {entry['transformers']}, "
          f"first call {entry['first_call_s']:.1f} s)",
          ["prompts", "output tokens", "seconds", "output tokens/s", "failed"],
          [(r["prompts"], r["tokens"], r["seconds"], r["tokens_per_s"], r["failed"]) for r in entry["runs"]])


def continuous_batching_child(a):
    """Prints one JSON line: generate_batch's output tokens per second for
    each size in --continuous-batching, on the checkpoint's first N prompts."""
    import torch
    import transformers
    checkpoint = a.continuous_batching_child
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    if a.prompt_tokens:
        make_prompts(checkpoint, a.prompt_tokens, max(a.continuous_batching))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, torch_dtype=getattr(torch, a.dtype), local_files_only=True).to(a.device).eval()
    inputs = [tokenizer(prompt(i))["input_ids"] for i in range(max(a.continuous_batching))]
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    generation = transformers.GenerationConfig(
        max_new_tokens=a.max_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else
        (eos[0] if isinstance(eos, list) else eos))
    accepted = inspect.signature(model.generate_batch).parameters
    sizing = {k: v for k, v in (("num_blocks", a.cb_num_blocks), ("max_batch_tokens", a.cb_max_batch_tokens))
              if v}
    kwargs = {}
    if "continuous_batching_config" in accepted:
        # transformers >= 5.3: the paged cache's sizes live in their own config.
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**sizing)
    else:
        for k, v in sizing.items():
            setattr(generation, k, v)
    if "progress_bar" in accepted:
        kwargs["progress_bar"] = False
    # One manager for every call, warmed up (CUDA graphs) by the first.
    persistent = "persistent_manager" in accepted
    if persistent:
        kwargs["persistent_manager"] = True

    def run(n):
        t0 = time.time()
        out = model.generate_batch(inputs=inputs[:n], generation_config=generation, **kwargs)
        if a.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.time() - t0
        outputs = list(out.values())
        failed = sum(1 for o in outputs if getattr(o, "error", None)) + n - len(outputs)
        tokens = sum(len(o.generated_tokens) for o in outputs)
        return {"prompts": n, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "failed": failed}

    first = run(max(a.continuous_batching))
    runs = [run(n) for n in a.continuous_batching]
    if hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                      "persistent_manager": persistent, "sizing": sizing,
                      "first_call_s": first["seconds"], "runs": runs}))


def baseline_part(a, models, env, results):
    """The baseline: N uvicorn processes, each its own copy."""
    if a.device != "cuda":
        print("\n### baseline\n\nskipped: generate_baseline_app.py serves a Llama checkpoint on the GPU\n")
        return
    workers = a.baseline_workers
    before = device_mib(a)
    blog = pathlib.Path(a.out) / "baseline.log"
    bproc = subprocess.Popen([sys.executable, "-m", "uvicorn", "generate_baseline_app:app", "--workers",
                              str(workers), "--port", "9137", "--app-dir", str(HERE)],
                             stdout=open(blog, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                             env=dict(env, HEARTH_BASELINE_CHECKPOINT=str(models.checkpoint)))
    entry = results["baseline"] = {"workers": workers}
    try:
        deadline = time.time() + 600
        while blog.read_text().count("Application startup complete") < workers:
            if time.time() > deadline or bproc.poll() is not None:
                raise SystemExit("baseline did not start:\n" + blog.read_text()[-3000:])
            time.sleep(0.2)
        warm(9137, models.name, 2 * workers)
        entry["device_mib"] = device_mib(a) - before
        entry["loads"] = []
        for c in a.baseline_streams:
            entry["loads"].append(load(9137, models.name, c, a.seconds, a.max_tokens, a.client_processes))
            write_json(a, results)
    finally:
        stop(bproc)
    write_json(a, results)
    load_table(f"baseline: uvicorn --workers {workers}, a copy each", [(workers, r) for r in entry["loads"]])
    print(f"  device memory {entry['device_mib']} MiB")


def chaos_part(a, models, env, tmp, results):
    repo = models.repository(a.chaos_workers, a.max_streams, resumable=True, hot_spares=a.chaos_hot_spares)
    log = tmp / "serve-chaos.log"
    serve = Serve(a, repo, models.name, env, log)
    entry = results["chaos"] = {"workers": a.chaos_workers, "streams": a.chaos_streams,
                                "seconds": a.chaos_seconds, "kill_every_s": a.chaos_every,
                                "max_streams": a.max_streams, "resumable": True,
                                "hot_spares": a.chaos_hot_spares}
    try:
        warm(serve.port, models.name, 2 * a.chaos_workers)
        # Each prompt's text with no kills, all at once as in the chaos run.
        refs, _ = Clients(serve.port, models.name, a.chaos_streams, 0, a.max_tokens, a.client_processes,
                          once=True).result()
        refs = [stream(serve.port, models.name, r["prompt"], a.max_tokens) if r["error"] else r
                for r in refs]  # a failed one once more, alone
        reference = {r["prompt"]: r["text"] for r in refs if r["error"] is None}
        entry["references_failed"] = a.chaos_streams - len(reference)

        clients = Clients(serve.port, models.name, a.chaos_streams, a.chaos_seconds, a.max_tokens,
                          a.client_processes)
        t0 = time.time()
        kills, skipped, killed = [], 0, set()
        seen = len(serve.ready_lines())
        next_kill = t0 + a.chaos_every
        while clients.running():
            now = time.time()
            lines = serve.ready_lines()
            if len(lines) > seen:  # a replacement of worker 0 is ready
                for k in kills:
                    if k["ready_s"] is None:
                        k["ready_s"], k["logged_start_ms"] = now - k["at"], lines[-1][1]
                seen = len(lines)
            if now >= next_kill and now < t0 + a.chaos_seconds:
                next_kill += a.chaos_every
                pid = lines[-1][0] if lines else None
                if pid is None or pid in killed:
                    skipped += 1  # worker 0's replacement is not ready yet
                else:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                    kills.append({"at": now, "pid": pid, "ready_s": None, "logged_start_ms": None})
            time.sleep(0.02)
        streams, wall = clients.result()

        ok = [r for r in streams if r["error"] is None]
        mismatched = [r for r in ok if r["prompt"] in reference and r["text"] != reference[r["prompt"]]]
        errors = collections.Counter(r["error"] for r in streams if r["error"] is not None)
        gap = max(streams, key=lambda r: r["max_gap"])
        ready = [k["ready_s"] for k in kills if k["ready_s"] is not None]
        entry.update({
            "wall_s": wall, "kills": len(kills), "kill_ticks_skipped": skipped,
            "streams_done": len(streams), "failed": len(streams) - len(ok),
            "completed": len(ok), "completed_text_differs": len(mismatched),
            "completed_without_reference": sum(1 for r in ok if r["prompt"] not in reference),
            "tokens_per_s": sum(r["tokens"] or 0 for r in ok) / wall,
            "longest_gap_s": gap["max_gap"], "longest_gap_failed": gap["error"] is not None,
            "ttft_max_s": max((r["ttft"] for r in ok if r["ttft"] is not None), default=None),
            "replacement_ready_s": ready,
            "logged_start_ms": [k["logged_start_ms"] for k in kills if k["logged_start_ms"] is not None],
            "errors": dict(errors.most_common(5)),
            "differs_example": ({"prompt": mismatched[0]["prompt"], "got": mismatched[0]["text"][:120],
                                 "reference": reference[mismatched[0]["prompt"]][:120]}
                                if mismatched else None)})
    finally:
        serve.stop()
        subprocess.run(["cp", str(log), a.out])
    write_json(a, results)
    spares = f", {a.chaos_hot_spares} hot spare(s)" if a.chaos_hot_spares else ""
    table(f"chaos: {a.chaos_streams} streams on {a.chaos_workers} workers (resumable{spares}), worker 0 "
          f"SIGKILLed every {a.chaos_every:g} s for {a.chaos_seconds:g} s", ["", "value"],
          [("SIGKILLs (ticks skipped: worker 0 not back yet)", f"{entry['kills']} ({skipped})"),
           ("streams ended", entry["streams_done"]),
           ("failed", entry["failed"]),
           ("completed, text differs from the uninterrupted one", entry["completed_text_differs"]),
           ("output tokens/s (completed streams)", entry["tokens_per_s"]),
           ("longest gap between two chunks of a stream (s)",
            f"{entry['longest_gap_s']:.2f}" + (" (a failed stream)" if entry["longest_gap_failed"] else "")),
           ("longest time to first token (s)",
            None if entry["ttft_max_s"] is None else f"{entry['ttft_max_s']:.2f}"),
           ("SIGKILL to the replacement's ready line (or a hot spare's takeover), median (s)",
            f"{statistics.median(ready):.3f}" if ready else None),
           ("replacement start as logged, median (ms)",
            f"{statistics.median(entry['logged_start_ms']):.0f}" if entry["logged_start_ms"] else None)])
    for error, n in entry["errors"].items():
        print(f"  {n} x {error}")
    if entry["differs_example"]:
        print(f"  differs, e.g. prompt {entry['differs_example']['prompt']}: "
              f"{entry['differs_example']['got']!r} vs {entry['differs_example']['reference']!r}")


# ---- main -----------------------------------------------------------------------


def write_json(a, results):
    pathlib.Path(a.json).write_text(json.dumps(results, indent=1))


def numbers(text):
    return [int(x) for x in text.split(",") if x.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build-gpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where the servers' logs are copied")
    ap.add_argument("--json", help="where all numbers are written (default: OUT/generate.json)")
    ap.add_argument("--webroot", default=".gpu/webroot/usr/lib/python3/dist-packages")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the tiny decoder, a dry run of everything but the baseline")
    ap.add_argument("--backend", default="python", choices=["python", "llm"],
                    help="serve the checkpoint with the Python Llama example or backend: llm")
    ap.add_argument("--gemm-engine", choices=["timed", "cublaslt", "hearth"],
                    help="backend: llm's parameters.gemm_engine (default: left out, which is timed)")
    ap.add_argument("--seconds", type=float, default=10, help="each load's length")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES),
                    help="the checkpoint's shape: 1b, or 8b (Llama 3 8B's, made on the GPU)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="pad each prompt to this many tokens (0: the short numbered prompt)")
    ap.add_argument("--workers", type=numbers, default=[4], help="hearth's worker counts, e.g. 1,2")
    ap.add_argument("--streams", type=numbers, default=[1, 4, 16], help="concurrent streams, e.g. 1,16,64,256")
    ap.add_argument("--max-streams", type=int, default=256,
                    help="the config's max_streams (streams a worker holds at once; 0 leaves it unset)")
    ap.add_argument("--kill-check", action=argparse.BooleanOptionalAction, default=True,
                    help="after the last worker count, SIGKILL an idle worker and time its replacement")
    ap.add_argument("--client-processes", type=int, default=0,
                    help="client processes a load's threads are spread over (0: one per 32 streams, "
                         "at most half the cores)")
    ap.add_argument("--continuous-batching", type=numbers, default=[],
                    help="prompt counts for transformers' generate_batch, e.g. 16,64,256 (empty: skipped)")
    ap.add_argument("--cb-num-blocks", type=int, default=0, help="its paged cache's blocks (0: its default)")
    ap.add_argument("--cb-max-batch-tokens", type=int, default=0, help="its tokens per batch (0: its default)")
    ap.add_argument("--cb-timeout", type=float, default=400)
    ap.add_argument("--continuous-batching-child", metavar="CHECKPOINT", help=argparse.SUPPRESS)
    ap.add_argument("--baseline-workers", type=int, default=4,
                    help="uvicorn workers of the baseline, a copy each (0: skipped)")
    ap.add_argument("--baseline-streams", type=numbers, default=[1, 4, 16])
    ap.add_argument("--chaos-seconds", type=float, default=0,
                    help="length of the chaos run (0: skipped), e.g. 60")
    ap.add_argument("--chaos-streams", type=int, default=64)
    ap.add_argument("--chaos-workers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the dtype of the Llama checkpoint made for the run (GPU)")
    ap.add_argument("--chaos-every", type=float, default=5, help="seconds between SIGKILLs of worker 0")
    ap.add_argument("--chaos-hot-spares", type=int, default=0,
                    help="hot spares of the chaos run's model (standby_mode: hot), each taking a killed "
                         "worker's place at once")
    a = ap.parse_args()
    if a.prompt_tokens < 0:
        ap.error(f"--prompt-tokens {a.prompt_tokens}: 0 or more")
    if a.shape != "1b" and a.device != "cuda":
        ap.error(f"--shape {a.shape} is made and served on the GPU (--device cuda)")
    if a.continuous_batching_child:
        continuous_batching_child(a)
        return
    a.json = a.json or str(pathlib.Path(a.out) / "generate.json")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-generate-bench-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), a.webroot,
                                                       os.environ.get("PYTHONPATH", "")]))
    results = {"command": sys.argv, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "device": a.device, "max_tokens": a.max_tokens, "prompt": prompt("N"), "hearth": []}
    try:
        models = Models(a, tmp, env)
        results.update(models.made)
        results["model"] = models.name
        print("checkpoint", models.made or models.name, flush=True)
        if a.prompt_tokens:
            count = max([*a.streams, *a.continuous_batching, *a.baseline_streams, a.chaos_streams,
                         2 * max(a.workers or [1])]) + 1
            how = make_prompts(models.checkpoint, a.prompt_tokens, count)
            results["prompt_tokens"] = {"asked": a.prompt_tokens, "counted_by": how}
            results["prompt"] = prompt(0)
            print(f"prompts: up to {a.prompt_tokens} tokens each, counted by {how}", flush=True)
        write_json(a, results)
        if a.workers:
            hearth_part(a, models, env, tmp, results)
        if a.continuous_batching:
            continuous_batching_part(a, models, env, results)
        if a.baseline_workers:
            try:
                baseline_part(a, models, env, results)
            except Exception as e:  # noqa: BLE001  (reported; the chaos run still goes)
                results["baseline"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"### uvicorn baseline failed: {type(e).__name__}: {e}", flush=True)
        if a.chaos_seconds:
            chaos_part(a, models, env, tmp, results)
        write_json(a, results)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the checkpoint (2 GiB) and the repositories


if __name__ == "__main__":
    main()
