"""The CPU executor of backend: llm against a Llama forward written here in
plain torch, with transformers' math (LlamaRMSNorm, rotate-half RoPE with
float32 frequencies, repeat_kv, a causal float32 softmax, the SiLU-gated
MLP). Each test writes a tiny checkpoint (config.json and a safetensors file
written by hand), runs llm_probe ($HEARTH_LLM_PROBE) on it, and compares the
logits it writes, whole, in chunks and batched, and the tokens it draws,
greedy and sampled (the draw of llm_model.h, rewritten here in numpy); and
the executor against itself: the same bits however the prompts are chunked
and batched, and a resumed stream (prefilled
again with the tokens it had drawn) drawing what it would have drawn.

Needs torch (Debian's python3-torch); skips without it."""

import json
import math
import os
import subprocess

import pytest

torch = pytest.importorskip("torch", reason="needs torch (apt-get install python3-torch)")
np = pytest.importorskip("numpy", reason="needs numpy (apt-get install python3-numpy)")

PROBE = os.environ.get("HEARTH_LLM_PROBE")
if not PROBE:
    pytest.skip("HEARTH_LLM_PROBE (the llm_probe binary) is not set; ctest sets it",
                allow_module_level=True)

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llm_reference_model import BASE, MODELS, Model, write_safetensors  # noqa: E402,F401

def probe(model, tmp_path, prompts, *flags):
    out = tmp_path / "probe.out"
    args = [PROBE, model.directory, str(out)]
    for p in prompts:
        args += ["--prompt", ",".join(map(str, p))]
    args += [str(f) for f in flags]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{' '.join(args)}\n{run.stderr}"
    return out.read_bytes()


def probe_logits(model, tmp_path, prompts, chunk=0, *flags):
    """{(sequence, position): logits} as llm_probe wrote them, step by step."""
    raw = np.frombuffer(probe(model, tmp_path, prompts, "--chunk", chunk, *flags),
                        dtype=np.float32).reshape(-1, model.vocab)
    got, row, fed = {}, 0, [0] * len(prompts)
    while any(f < len(p) for f, p in zip(fed, prompts)):
        for i, p in enumerate(prompts):
            if fed[i] < len(p):
                fed[i] = min(len(p), fed[i] + chunk) if chunk else len(p)
                got[(i, fed[i] - 1)] = torch.from_numpy(raw[row].copy())
                row += 1
    assert row == raw.shape[0]
    return got


def assert_close(got, want, what):
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


PROMPTS = [[1, 17, 250, 3, 99, 42, 7, 7, 128, 64, 5],
           [1, 200],
           [1, 33, 66, 99, 132, 165, 198, 231, 8, 41, 74, 107, 140, 173, 206, 239, 16, 49, 82]]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_torch(tmp_path, name):
    model = Model(tmp_path / "model", name)
    want = [model.logits(p) for p in PROMPTS]
    # Whole prompts, one step for the batch.
    for (i, pos), got in probe_logits(model, tmp_path, PROMPTS).items():
        assert_close(got, want[i][pos], f"{name}: sequence {i}, whole, position {pos}")
    # One token a step: every position's logits, decoding on the cache.
    got = probe_logits(model, tmp_path, PROMPTS, 1)
    assert len(got) == sum(map(len, PROMPTS))
    for (i, pos), g in got.items():
        assert_close(g, want[i][pos], f"{name}: sequence {i}, one by one, position {pos}")
    # Chunks of 4 on shuffled blocks of 3, and chunks of 5 on blocks of 16.
    for flags in (("--block-size", 3, "--scatter"), ("--block-size", 16)):
        chunk = 4 if "--scatter" in flags else 5
        for (i, pos), g in probe_logits(model, tmp_path, PROMPTS, chunk, *flags).items():
            assert_close(g, want[i][pos], f"{name}: sequence {i}, chunks {flags}, position {pos}")


@pytest.mark.parametrize("name,dtype", [("llama", "bfloat16"), ("qwen2", "float16"),
                                        ("llama3_scaling", "bfloat16")])
def test_sixteen_bit_checkpoints(tmp_path, name, dtype):
    """The executor widens BF16 and F16 weights to float32: torch's float32
    math on the same stored values is the reference."""
    model = Model(tmp_path / "model", name, dtype=dtype)
    want = [model.logits(p) for p in PROMPTS]
    for (i, pos), g in probe_logits(model, tmp_path, PROMPTS, 3, "--scatter").items():
        assert_close(g, want[i][pos], f"{name} {dtype}: sequence {i}, position {pos}")


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_composition_changes_no_bit(tmp_path, name):
    """A token's logits are the same bits whole, one token a step, in chunks
    on shuffled blocks or on blocks of 16, beside whichever other rows: the
    bits of one token a step."""
    model = Model(tmp_path / "model", name)
    want = probe_logits(model, tmp_path, PROMPTS, 1)
    for chunk, flags in ((0, ()), (1, ()), (4, ("--block-size", 3, "--scatter")),
                         (5, ("--block-size", 16))):
        for key, g in probe_logits(model, tmp_path, PROMPTS, chunk, *flags).items():
            assert g.numpy().tobytes() == want[key].numpy().tobytes(), (
                f"{name}: sequence {key[0]}, position {key[1]}, chunks of {chunk} {flags}: "
                f"max difference {(g - want[key]).abs().max().item():.3g}")


def test_refusal_is_reported(tmp_path):
    model = Model(tmp_path / "model", "llama")
    config = dict(model.config, hidden_act="gelu")
    with open(os.path.join(model.directory, "config.json"), "w") as f:
        json.dump(config, f)
    args = [PROBE, model.directory, str(tmp_path / "out"), "--prompt", "1,2"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert 'config.json: hidden_act "gelu" is not implemented' in run.stderr


# ---- the draw of llm_model.h, independently

MASK = (1 << 64) - 1


def split_mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def gumbel_uniform(seed, position, token):
    h = split_mix64(seed ^ split_mix64(((position << 32) & MASK) ^ token))
    return np.float32((h >> 40) + 0.5) * np.float32(1.0 / 16777216.0)


def draw(logits, position, temperature, top_k, top_p, seed):
    logits = logits.numpy().astype(np.float32)
    if temperature == 0:
        return int(np.argmax(logits))
    keep = np.ones(len(logits), dtype=bool)
    if 0 < top_k < len(logits):
        keep &= logits >= np.sort(logits)[::-1][top_k - 1]
    scaled = logits / np.float32(temperature)
    if top_p < 1:
        z = scaled[keep].astype(np.float64)
        prob = np.zeros(len(logits))
        prob[keep] = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        order = np.sort(prob[keep])[::-1]
        # The largest t with sum(p >= t) >= top_p.
        threshold = next(t for t in order if prob[keep][prob[keep] >= t].sum() >= np.float32(top_p))
        keep &= prob >= threshold
    best, best_score = -1, None
    for token in np.flatnonzero(keep):
        u = gumbel_uniform(seed, position, int(token))
        score = scaled[token] + np.float32(-np.log(-np.log(u)))
        if best_score is None or score > best_score:
            best, best_score = int(token), score
    return best


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama3_scaling"])
@pytest.mark.parametrize("sampling", [(0.0, 0, 1.0, 0), (0.8, 20, 0.9, 1234), (1.3, 0, 0.7, 99)],
                         ids=["greedy", "top_k_top_p", "top_p"])
def test_generation_matches_torch(tmp_path, name, sampling):
    """32 tokens per sequence, drawn by the executor's Step (prefill in
    chunks of 4 beside other sequences' decoding), against torch's logits
    and the draw rewritten above."""
    temperature, top_k, top_p, seed = sampling
    model = Model(tmp_path / "model", name)
    steps = 32
    raw = probe(model, tmp_path, PROMPTS, "--chunk", 4, "--generate", steps, "--scatter",
                "--temperature", temperature, "--top-k", top_k, "--top-p", top_p, "--seed", seed)
    got = np.frombuffer(raw, dtype=np.int32).reshape(len(PROMPTS), steps)
    for i, prompt in enumerate(PROMPTS):
        ids, want = list(prompt), []
        for position in range(steps):
            token = draw(model.logits(ids)[-1], position, temperature, top_k, top_p, seed)
            want.append(token)
            ids.append(token)
        assert got[i].tolist() == want, f"{name} {sampling}: sequence {i}"


@pytest.mark.parametrize("sampling", [(0.0, 0, 1.0, 0), (0.8, 20, 0.9, 1234)],
                         ids=["greedy", "top_k_top_p"])
def test_resumed_generation_draws_the_same_tokens(tmp_path, sampling):
    """Streams interrupted after j of their 32 tokens, prefilled again with
    their prompt and those j tokens (whole, or in chunks of 7 beside the
    others' decoding), draw the 32 - j tokens they would have drawn."""
    temperature, top_k, top_p, seed = sampling
    model = Model(tmp_path / "model", "llama")
    steps = 32
    draw = ["--temperature", temperature, "--top-k", top_k, "--top-p", top_p, "--seed", seed]
    full = np.frombuffer(probe(model, tmp_path, PROMPTS, "--chunk", 4, "--generate", steps,
                               "--scatter", *draw), dtype=np.int32).reshape(len(PROMPTS), steps)
    for j in (1, 13, 31):
        resumed = [p + full[i][:j].tolist() for i, p in enumerate(PROMPTS)]
        for chunk in (0, 7):
            raw = probe(model, tmp_path, resumed, "--chunk", chunk, "--generate", steps - j,
                        "--drawn", j, *draw)
            got = np.frombuffer(raw, dtype=np.int32).reshape(len(PROMPTS), steps - j)
            for i in range(len(PROMPTS)):
                assert got[i].tolist() == full[i][j:].tolist(), (
                    f"{sampling}: sequence {i} resumed after {j} tokens, chunks of {chunk}")
