"""hearth.transformers against a real `hearth store`, on a checkpoint written by save_pretrained.

The checkpoint is made here, offline, by examples/llm_uvicorn/make_checkpoint.py:
a Llama-architecture model with random weights, bf16, tied input and output
embeddings (the files hold model.embed_tokens.weight only) and grouped-query
attention, plus a tokenizer, in several shards with
model.safetensors.index.json; the store is given the directory.

- causal_lm equals from_pretrained: same tensors, same buffers, the tie kept,
  every weight the store's (no copy), greedy generation token for token.
- load_into a LlamaForCausalLM built entirely on the meta device (the issue's
  failing case): the rotary buffers are filled by the model's _init_weights.
- make_checkpoint.py's --untied and --fill-vocab (the benches' 8B shape).
- 4 processes each building the model from the store cost one copy: on host
  memory every tensor lies in the one memfd all of them map, and their
  proportional set sizes add up to one copy; on a GPU every tensor is the
  store's, and the device memory the 4 take beyond 4 bare contexts is
  measured against the weights' size (printed, and written to
  $HEARTH_TEST_LOG_DIR/transformers-memory.txt when that is set).

Without transformers (CI: Debian's torch 1.13, no transformers) or with torch
< 2, these tests skip saying so; the first two tests below run everywhere.
On the GPU machine:

    HEARTH_TEST_DEVICE=cuda:0 HEARTH_CLI=$PWD/build-gpu/bin/hearth \\
        HEARTH_LIBRARY=$PWD/build-gpu/src/capi/libhearth.so PYTHONPATH=$PWD/python \\
        python3 -m pytest -q -rs tests/python/test_transformers.py -p no:cacheprovider
"""

import gc
import json
import os
import pathlib
import sys
import tempfile
import time

import pytest

import hearth_testing as ht
from hearth_testing import DEVICE, ON_CUDA
from llm_checkpoints import MIB, MISSING, SHARDED, make_checkpoint, store_path

needs_transformers = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


# ---- what runs everywhere ----------------------------------------------------------


def test_import_loads_neither_torch_nor_transformers():
    proc = ht.run_script("""
        import sys
        import hearth.transformers
        assert "torch" not in sys.modules and "transformers" not in sys.modules, sorted(
            m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
        print("ok")
        """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_without_transformers_the_error_says_so():
    proc = ht.run_script("""
        import sys
        sys.modules["transformers"] = None  # as if it were not installed
        import hearth.transformers
        for call in (lambda: hearth.transformers.causal_lm("llama", "/nonexistent"),
                     lambda: hearth.transformers.tokenizer("/nonexistent")):
            try:
                call()
            except ImportError as e:
                print("ImportError:", e)
        """)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert line.startswith("ImportError: hearth.transformers needs the `transformers` "
                               "package (pip install transformers)"), line
        assert sys.executable in line, line


# ---- the checkpoint and the store ------------------------------------------------------


def safetensors_names(directory):
    names = set()
    for path in pathlib.Path(directory).glob("*.safetensors"):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            names.update(k for k in json.loads(f.read(size)) if k != "__metadata__")
    return names


class Checkpoint:
    def __init__(self, directory, summary, store):
        self.directory = directory
        self.summary = summary
        self.store = store


@pytest.fixture(scope="module")
def llama():
    if MISSING:
        pytest.skip(MISSING)
    directory = pathlib.Path(tempfile.mkdtemp(prefix="hearth-llama-"))
    try:
        summary = make_checkpoint(directory / "ckpt",
                                  *(["--max-shard-size", "200KB"] if SHARDED else []))
        with ht.running_store({"llama": store_path(directory / "ckpt", summary)}) as store:
            yield Checkpoint(directory / "ckpt", summary, store)
    finally:
        import shutil
        shutil.rmtree(directory, ignore_errors=True)


def reference(checkpoint):
    """What transformers itself loads: from_pretrained, bf16, moved to the store's device."""
    import torch
    import transformers

    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint.directory, local_files_only=True, **{dtype_key: torch.bfloat16})
    return model.to(DEVICE).eval()


def prompts():
    import torch

    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 300, (1, n), generator=g) for n in (1, 5, 17, 40)] + \
        [torch.randint(3, 300, (2, 9), generator=g)]


def greedy(model, ids, new_tokens=32):
    import torch

    ids = ids.to(model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=model.generation_config.eos_token_id)
    return out[:, ids.shape[1]:].cpu().tolist()


# ---- the tests that need transformers -------------------------------------------------


@needs_transformers
def test_the_checkpoint_is_tied_gqa_bf16(llama):
    import transformers

    config = transformers.AutoConfig.from_pretrained(llama.directory, local_files_only=True)
    assert config.tie_word_embeddings and config.num_key_value_heads < config.num_attention_heads
    names = safetensors_names(llama.directory)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names, sorted(names)
    if SHARDED:
        index = json.loads((llama.directory / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 2, index
        assert len(llama.summary["safetensors"]) >= 2, llama.summary
    import hearth

    weights = hearth.attach("llama", socket=llama.store.socket)
    assert sorted(weights) == sorted(names)
    assert {t.dtype for t in weights.values()} == {"BF16"}
    assert weights.device == DEVICE


@needs_transformers
def test_make_checkpoint_untied_with_a_token_for_every_id(tmp_path):
    """--untied writes an lm_head of its own; --fill-vocab gives the tokenizer
    a token, with text, for every id of the model's vocabulary (the 8B shape
    of bench/serve/generate_bench.py draws ids past the trained tokenizer's),
    without changing how text encodes."""
    import transformers

    plain = make_checkpoint(tmp_path / "plain", "--vocab", "700")
    full = make_checkpoint(tmp_path / "full", "--vocab", "700", "--untied", "--fill-vocab")
    assert plain["tokenizer_vocab"] < 700, plain
    assert full["tokenizer_vocab"] == 700, full
    config = transformers.AutoConfig.from_pretrained(tmp_path / "full", local_files_only=True)
    assert not config.tie_word_embeddings
    assert "lm_head.weight" in safetensors_names(tmp_path / "full")
    assert "lm_head.weight" not in safetensors_names(tmp_path / "plain")
    before = transformers.AutoTokenizer.from_pretrained(tmp_path / "plain", local_files_only=True)
    after = transformers.AutoTokenizer.from_pretrained(tmp_path / "full", local_files_only=True)
    text = "one copy of the weights, many worker processes"
    assert after(text)["input_ids"] == before(text)["input_ids"]
    for token in range(plain["tokenizer_vocab"], 700):
        assert after.decode([token]) == f"x{token}", token


@needs_transformers
def test_prepare_imports_the_architecture_with_no_device(llama):
    """What a zygote runs at model.py's import: transformers and the Llama
    classes imported, CUDA never initialised."""
    proc = ht.run_script(f"""
        import sys
        import hearth.transformers
        classes = hearth.transformers.prepare({str(llama.directory)!r})
        import torch
        assert [c.__name__ for c in classes] == ["LlamaForCausalLM"], classes
        assert "transformers.models.llama.modeling_llama" in sys.modules
        assert not torch.cuda.is_initialized()
        print("ok")
        """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@needs_transformers
def test_causal_lm_equals_from_pretrained(llama):
    import torch

    import hearth
    import hearth.transformers

    weights = hearth.attach("llama", socket=llama.store.socket)
    ours = hearth.transformers.causal_lm(weights, llama.directory)
    theirs = reference(llama)
    assert not ours.training
    assert ours.device == torch.device(DEVICE)

    # The tie, and every parameter and persistent buffer the store's tensor.
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    for name, tensor in ours.state_dict().items():
        stored = weights["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert tensor.data_ptr() == stored.data_ptr, f"{name} is a copy"

    # The same tensors and buffers as transformers' own load, bit for bit.
    want = theirs.state_dict()
    got = ours.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name
    want_buffers = dict(theirs.named_buffers())
    got_buffers = dict(ours.named_buffers())
    assert sorted(got_buffers) == sorted(want_buffers)
    for name in want_buffers:
        assert got_buffers[name].device == want_buffers[name].device, name
        assert got_buffers[name].dtype == want_buffers[name].dtype, name
        assert torch.equal(got_buffers[name], want_buffers[name]), f"buffer {name} differs"
    assert ours.generation_config.eos_token_id == theirs.generation_config.eos_token_id
    assert ours.generation_config.bos_token_id == theirs.generation_config.bos_token_id

    # Greedy generation, token for token.
    outputs = []
    for ids in prompts():
        a, b = greedy(ours, ids), greedy(theirs, ids)
        assert a == b, f"prompt {ids.tolist()}: hearth {a}, from_pretrained {b}"
        outputs.extend(tuple(row) for row in a)
    assert len(set(outputs)) > 1, "every prompt generated the same tokens"
    with torch.inference_mode():
        ids = prompts()[2].to(DEVICE)
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


@needs_transformers
def test_load_into_a_llama_built_on_the_meta_device(llama):
    import torch
    import transformers

    import hearth
    import hearth.torch

    config = transformers.AutoConfig.from_pretrained(llama.directory, local_files_only=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    assert model.model.rotary_emb.inv_freq.is_meta
    weights = hearth.attach("llama", socket=llama.store.socket)
    if int(transformers.__version__.split(".")[0]) < 5:
        # transformers 4's _init_weights does not compute rotary buffers: a clear error.
        with pytest.raises(hearth.InvalidArgument, match="inv_freq"):
            hearth.torch.load_into(model, weights)
        return
    hearth.torch.load_into(model, weights)
    model.eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    theirs = reference(llama)
    for name, buffer in theirs.named_buffers():
        assert torch.equal(model.get_buffer(name), buffer), f"buffer {name} differs"
    for ids in prompts()[:3]:
        assert greedy(model, ids) == greedy(theirs, ids)


# ---- four processes, one copy ------------------------------------------------------------

WORKER = r"""
import json, os, sys
import torch
import hearth, hearth.transformers
import hearth_testing as ht

socket, directory, device = sys.argv[1], sys.argv[2], sys.argv[3]
weights = hearth.attach("llama", socket=socket)
model = hearth.transformers.causal_lm(weights, directory)
ids = torch.arange(3, 19).reshape(1, -1).to(model.device)
with torch.inference_mode():
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                         min_new_tokens=16, do_sample=False,
                         pad_token_id=model.generation_config.eos_token_id)
    # Reads every page, with no temporary copy (which the device-memory check would count).
    touched = sum(float(t.sum(dtype=torch.float64)) for t in model.state_dict().values())
if device.startswith("cuda"):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what the generation cached is not what the weights cost
pointers = {name: t.data_ptr() for name, t in model.state_dict().items()}
maps = ht.arena_maps() if device == "cpu" else []
report = {
    "pid": os.getpid(),
    "tokens": out[0].tolist(),
    "touched": touched,
    "maps": maps,
    "in_store": all(p == weights["model.embed_tokens.weight" if n == "lm_head.weight" else n].data_ptr
                    for n, p in pointers.items()),
    "in_mapping": all(any(b <= p < e for b, e, _ in maps) for p in pointers.values()),
    "torch_allocated": torch.cuda.memory_allocated() if device.startswith("cuda") else 0,
    "torch_reserved": torch.cuda.memory_reserved() if device.startswith("cuda") else 0,
}
print(json.dumps(report), flush=True)
sys.stdin.readline()  # stay as it is until the parent has measured
"""

BARE_CONTEXT = r"""
import json, sys
import torch
x = torch.randn(256, 256, device=sys.argv[1], dtype=torch.bfloat16)
q = torch.randn(1, 4, 16, 32, device=sys.argv[1], dtype=torch.bfloat16)
(x @ x).sum().item()  # cuBLAS, as a worker's first forward loads it
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
"""


spawn, report_of, finish = ht.spawn_reporter, ht.report_of, ht.finish_reporters


def device_used(torch):
    free, total = torch.cuda.mem_get_info(torch.device(DEVICE))
    return total - free


def settled_used(torch, baseline=None, timeout=30):
    """Device memory in use once it stops changing (or is back to `baseline`)."""
    deadline = time.monotonic() + timeout
    last = device_used(torch)
    while time.monotonic() < deadline:
        if baseline is not None and last <= baseline + 8 * MIB:
            return last
        time.sleep(0.1)
        now = device_used(torch)
        if baseline is None and abs(now - last) < MIB:
            return now
        last = now
    return last


def log_measurement(text):
    print(text)
    directory = os.environ.get("HEARTH_TEST_LOG_DIR")
    if directory:
        with open(os.path.join(directory, "transformers-memory.txt"), "a") as f:
            f.write(text + "\n")


@pytest.fixture(scope="module")
def big_llama():
    """On a GPU, a checkpoint large enough (~1.2 GB) that a copy per process would show."""
    if MISSING:
        pytest.skip(MISSING)
    if not ON_CUDA:
        yield None
        return
    directory = pathlib.Path(tempfile.mkdtemp(prefix="hearth-llama-big-"))
    try:
        summary = make_checkpoint(
            directory / "ckpt", "--vocab", "32000", "--hidden", "2048", "--intermediate", "5632",
            "--layers", "12", "--heads", "16", "--kv-heads", "4", "--initializer-range", "0.02",
            *(["--max-shard-size", "300MB"] if SHARDED else []))
        with ht.running_store({"llama": store_path(directory / "ckpt", summary)}) as store:
            yield Checkpoint(directory / "ckpt", summary, store)
    finally:
        import shutil
        shutil.rmtree(directory, ignore_errors=True)


@needs_transformers
def test_four_processes_cost_one_copy(llama, big_llama):
    import torch

    import hearth

    checkpoint = big_llama or llama
    socket = checkpoint.store.socket
    weight_bytes = sum(t.nbytes for t in hearth.attach("llama", socket=socket).values())
    if ON_CUDA:
        gc.collect()
        torch.cuda.empty_cache()
        before = settled_used(torch)
        bare = spawn(BARE_CONTEXT, DEVICE)
        try:
            report_of(bare)
            context = settled_used(torch) - before
        finally:
            finish([bare])
        settled_used(torch, baseline=before)

    procs = [spawn(WORKER, socket, checkpoint.directory, DEVICE) for _ in range(4)]
    try:
        reports = [report_of(p) for p in procs]
        ht.wait_for(lambda: ht.store_attached_count(socket, "llama") >= 4, "4 leases on llama",
                    procs=procs)
        assert len({tuple(r["tokens"]) for r in reports}) == 1, [r["tokens"] for r in reports]
        assert len({r["touched"] for r in reports}) == 1
        assert all(r["in_store"] for r in reports), "a worker holds a copy of a tensor"
        if ON_CUDA:
            used = settled_used(torch) - before
            beyond = used - 4 * context
            log_measurement(
                f"hearth.transformers, 4 processes on {DEVICE}: weights {weight_bytes / MIB:.0f} "
                f"MiB (one copy, held by the store); one bare torch context {context / MIB:.0f} "
                f"MiB; the 4 workers together {used / MIB:.0f} MiB, "
                f"{beyond / MIB:.0f} MiB beyond 4 bare contexts; torch allocator per worker "
                f"{[round(r['torch_reserved'] / MIB) for r in reports]} MiB reserved")
            for r in reports:  # the weights are not in any worker's own allocations
                assert r["torch_allocated"] < weight_bytes / 4, r
            # A copy per worker would add 4 x the weights; activations, KV cache and kernels
            # of a 16-token generation take far less than one copy in all.
            assert beyond < weight_bytes, (used, context, weight_bytes)
        else:
            assert all(r["in_mapping"] for r in reports), "a tensor lies outside the arena"
            assert all(len(r["maps"]) == 1 for r in reports), [r["maps"] for r in reports]
            assert len({r["maps"][0][2] for r in reports}) == 1, "the workers map different arenas"
            smaps = [ht.arena_smaps(r["pid"]) for r in reports]
            pss = sum(s["Pss"] for s in smaps)
            log_measurement(f"hearth.transformers, 4 processes on host memory: weights "
                            f"{weight_bytes} bytes, arena PSS summed over the 4: {pss} bytes")
            assert 0.9 * weight_bytes <= pss <= weight_bytes + 64 * 1024, (pss, smaps)
            assert all(s["Rss"] >= weight_bytes for s in smaps), smaps
    finally:
        finish(procs)
