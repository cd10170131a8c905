"""Tiny Llama-family checkpoints written by hand (config.json and a
safetensors file) and their forward in plain torch, with transformers' math
(LlamaRMSNorm, rotate-half RoPE with float32 frequencies, repeat_kv, a
causal float32 softmax, the SiLU-gated MLP): the reference of backend llm's
tests (tests/backends/llm/test_llm_reference.py, tests/serve/test_llm.py)."""

import json
import math
import os

import torch

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
