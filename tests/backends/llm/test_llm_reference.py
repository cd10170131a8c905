"""The CPU executor of backend: llm against a Llama forward written here in
plain torch, with transformers' math (LlamaRMSNorm, rotate-half RoPE with
float32 frequencies, repeat_kv, a causal float32 softmax, the SiLU-gated
MLP). Each test writes a tiny checkpoint (config.json and a safetensors file
written by hand), runs llm_probe ($HEARTH_LLM_PROBE) on it, and compares the
logits it writes, whole, in chunks and batched, and the tokens it draws,
greedy and sampled (the draw of llm_model.h, rewritten here in numpy); and
the executor against itself: the same bits however the prompts are chunked
and batched, on 1 or 2 OpenBLAS threads, and a resumed stream (prefilled
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

# Shapes of the tiny models: hidden 64, 2 layers, 4 heads over 2 kv heads.
BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}

MODELS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
              "rope_scaling": None, "tie_word_embeddings": False},
    # Llama 3.1's rope scaling, with an original context of 64 positions so
    # that the 8 frequencies of a head of 16 fall in all three bands.
    "llama3_scaling": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                       "rope_theta": 500000.0, "tie_word_embeddings": False,
                       "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}},
    # Biases on q, k and v; lm_head tied to the embeddings.
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "tie_word_embeddings": True, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 2, "rope_theta": 1000000.0},
    # head_dim given, and not hidden / heads: q is 128 wide, o_proj [64, 128].
    "mistral_head_dim": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                         "head_dim": 32, "sliding_window": None,
                         "tie_word_embeddings": False},
}

TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(path, tensors):
    """{name: torch.Tensor} as a safetensors file: an 8-byte header length,
    the JSON header (names, dtypes, shapes, offsets), then the bytes."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        header[name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for raw in blobs:
            f.write(raw)


class Model:
    """A tiny checkpoint in `directory`, and its weights as float32 (the
    stored values, upcast) for the reference."""

    def __init__(self, directory, name, dtype="float32", seed=0):
        self.config = dict(BASE, **MODELS[name], torch_dtype=dtype)
        c = self.config
        self.hidden, self.heads, self.kv_heads = (c["hidden_size"], c["num_attention_heads"],
                                                  c["num_key_value_heads"])
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.vocab, self.layers = c["vocab_size"], c["num_hidden_layers"]
        self.qwen2 = c["architectures"] == ["Qwen2ForCausalLM"]
        self.tied = c["tie_word_embeddings"]

        g = torch.Generator().manual_seed(seed)

        def uniform(*shape, mean=0.0, bound=1.0):
            return (torch.rand(*shape, generator=g) * 2 - 1) * bound + mean

        h, q, kv, inter = (self.hidden, self.heads * self.head_dim,
                           self.kv_heads * self.head_dim, c["intermediate_size"])
        w = 1 / math.sqrt(h)
        t = {"model.embed_tokens.weight": uniform(self.vocab, h),
             "model.norm.weight": uniform(h, mean=1.0, bound=0.2)}
        if not self.tied:
            t["lm_head.weight"] = uniform(self.vocab, h, bound=3 * w)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            t[p + "input_layernorm.weight"] = uniform(h, mean=1.0, bound=0.2)
            t[p + "post_attention_layernorm.weight"] = uniform(h, mean=1.0, bound=0.2)
            t[p + "self_attn.q_proj.weight"] = uniform(q, h, bound=2 * w)
            t[p + "self_attn.k_proj.weight"] = uniform(kv, h, bound=2 * w)
            t[p + "self_attn.v_proj.weight"] = uniform(kv, h, bound=2 * w)
            t[p + "self_attn.o_proj.weight"] = uniform(h, q, bound=1 / math.sqrt(q))
            if self.qwen2:
                t[p + "self_attn.q_proj.bias"] = uniform(q, bound=0.5)
                t[p + "self_attn.k_proj.bias"] = uniform(kv, bound=0.5)
                t[p + "self_attn.v_proj.bias"] = uniform(kv, bound=0.5)
            t[p + "mlp.gate_proj.weight"] = uniform(inter, h, bound=2 * w)
            t[p + "mlp.up_proj.weight"] = uniform(inter, h, bound=2 * w)
            t[p + "mlp.down_proj.weight"] = uniform(h, inter, bound=1 / math.sqrt(inter))
        stored = {k: v.to(TORCH_DTYPE[dtype]) for k, v in t.items()}
        self.w = {k: v.float() for k, v in stored.items()}

        self.directory = str(directory)
        os.makedirs(self.directory, exist_ok=True)
        write_safetensors(os.path.join(self.directory, "model.safetensors"), stored)
        with open(os.path.join(self.directory, "config.json"), "w") as f:
            json.dump(self.config, f, indent=2)

    # ---- transformers' math, in float32

    def inv_freq(self):
        c, dim = self.config, self.head_dim
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        s = c.get("rope_scaling")
        if not s:
            return inv
        # _compute_llama3_parameters
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        inv_llama = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, inv_llama)

    def rms_norm(self, x, weight):
        variance = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + self.config["rms_norm_eps"]))

    @staticmethod
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def logits(self, ids):
        """[len(ids), vocab]: the logits after every token of one sequence."""
        w, n, d = self.w, len(ids), self.head_dim
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        freqs = torch.arange(n).float()[:, None] @ self.inv_freq()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.full((n, n), float("-inf")).triu(1)
        for i in range(self.layers):
            p = f"model.layers.{i}."

            def proj(name, h):
                weight, bias = w[p + name + ".weight"], w.get(p + name + ".bias")
                return torch.nn.functional.linear(h, weight, bias)

            h = self.rms_norm(x, w[p + "input_layernorm.weight"])
            q = proj("self_attn.q_proj", h).view(n, self.heads, d).transpose(0, 1)
            k = proj("self_attn.k_proj", h).view(n, self.kv_heads, d).transpose(0, 1)
            v = proj("self_attn.v_proj", h).view(n, self.kv_heads, d).transpose(0, 1)
            q = q * cos + self.rotate_half(q) * sin
            k = k * cos + self.rotate_half(k) * sin
            # repeat_kv: head j reads kv head j // (heads / kv_heads).
            rep = self.heads // self.kv_heads
            k = k[:, None].expand(self.kv_heads, rep, n, d).reshape(self.heads, n, d)
            v = v[:, None].expand(self.kv_heads, rep, n, d).reshape(self.heads, n, d)
            scores = q @ k.transpose(1, 2) * d ** -0.5 + mask
            attn = torch.softmax(scores, dim=-1, dtype=torch.float32) @ v
            x = x + proj("self_attn.o_proj", attn.transpose(0, 1).reshape(n, self.heads * d))
            h = self.rms_norm(x, w[p + "post_attention_layernorm.weight"])
            gated = torch.nn.functional.silu(proj("mlp.gate_proj", h)) * proj("mlp.up_proj", h)
            x = x + proj("mlp.down_proj", gated)
        head = w["model.embed_tokens.weight"] if self.tied else w["lm_head.weight"]
        return self.rms_norm(x, w["model.norm.weight"]) @ head.T


def probe(model, tmp_path, prompts, *flags, threads=1):
    out = tmp_path / "probe.out"
    args = [PROBE, model.directory, str(out)]
    for p in prompts:
        args += ["--prompt", ",".join(map(str, p))]
    args += [str(f) for f in flags]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OPENBLAS_NUM_THREADS=str(threads)))
    assert run.returncode == 0, f"{' '.join(args)}\n{run.stderr}"
    return out.read_bytes()


def probe_logits(model, tmp_path, prompts, chunk=0, *flags, threads=1):
    """{(sequence, position): logits} as llm_probe wrote them, step by step."""
    raw = np.frombuffer(probe(model, tmp_path, prompts, "--chunk", chunk, *flags, threads=threads),
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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_composition_changes_no_bit(tmp_path, name, threads):
    """A token's logits are the same bits whole, one token a step, in chunks
    on shuffled blocks or on blocks of 16, beside whichever other rows, on 1
    or 2 OpenBLAS threads: the bits of one token a step on one thread."""
    model = Model(tmp_path / "model", name)
    want = probe_logits(model, tmp_path, PROMPTS, 1)
    for chunk, flags in ((0, ()), (1, ()), (4, ("--block-size", 3, "--scatter")),
                         (5, ("--block-size", 16))):
        for key, g in probe_logits(model, tmp_path, PROMPTS, chunk, *flags,
                                   threads=threads).items():
            assert g.numpy().tobytes() == want[key].numpy().tobytes(), (
                f"{name}: sequence {key[0]}, position {key[1]}, chunks of {chunk} {flags} on "
                f"{threads} threads: max difference {(g - want[key]).abs().max().item():.3g}")


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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("sampling", [(0.0, 0, 1.0, 0), (0.8, 20, 0.9, 1234)],
                         ids=["greedy", "top_k_top_p"])
def test_resumed_generation_draws_the_same_tokens(tmp_path, sampling, threads):
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
                        "--drawn", j, *draw, threads=threads)
            got = np.frombuffer(raw, dtype=np.int32).reshape(len(PROMPTS), steps - j)
            for i in range(len(PROMPTS)):
                assert got[i].tolist() == full[i][j:].tolist(), (
                    f"{sampling}: sequence {i} resumed after {j} tokens, chunks of {chunk}, "
                    f"{threads} threads")
