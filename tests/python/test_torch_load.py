"""hearth.torch.load_into on modules with ties and buffers, against a real `hearth store`.

A tiny Llama-like module in plain torch (runs on Debian's torch 1.13): token
embedding tied to the output head, GQA attention with a non-persistent rotary
`inv_freq` buffer in one module shared by every layer, RMSNorm, and a
BatchNorm1d whose running statistics (and int64 num_batches_tracked) are
persistent buffers. Its checkpoints are written from a reference module, the
way Hugging Face writes them (the tied alias left out), and with the other
alias, both aliases, or both holding different values.

Each binding test checks that every parameter and persistent buffer is the
store's tensor (same data pointer), that the ties survive as one Parameter
object, and that the outputs equal the reference's exactly. The error tests
check each message and that a failed load changes nothing. The store's device
is $HEARTH_TEST_DEVICE (default "cpu").
"""

import copy
import importlib.util
import math
import os
import signal
import sys
import tempfile

import pytest

import hearth_testing as ht
from hearth_testing import DEVICE, ON_CUDA

torch = pytest.importorskip("torch", reason="torch is not installed for this interpreter")
import hearth  # noqa: E402
import hearth.torch as htorch  # noqa: E402

host_only = pytest.mark.skipif(ON_CUDA, reason=f"host-memory test; store on {DEVICE}")

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, FFN = 64, 32, 4, 2, 2, 48
HEAD_DIM = DIM // HEADS


# ---- the module -------------------------------------------------------------


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


class Rotary(torch.nn.Module):
    """inv_freq is a non-persistent buffer; reset_parameters recomputes it in place."""

    def __init__(self, head_dim, device=None):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", self.compute(device), persistent=False)

    def compute(self, device):
        exponents = torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim
        return 1.0 / (10000.0 ** exponents)

    def reset_parameters(self):
        self.inv_freq.copy_(self.compute(self.inv_freq.device))

    def forward(self, positions):
        freqs = torch.outer(positions.float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class RotaryWithoutInitialiser(Rotary):
    reset_parameters = None


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, rotary, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.q_proj = torch.nn.Linear(DIM, HEADS * HEAD_DIM, **kw)
        self.k_proj = torch.nn.Linear(DIM, KV_HEADS * HEAD_DIM, **kw)
        self.v_proj = torch.nn.Linear(DIM, KV_HEADS * HEAD_DIM, **kw)
        self.o_proj = torch.nn.Linear(HEADS * HEAD_DIM, DIM, **kw)
        self.rotary = rotary  # one module shared by every layer

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        cos, sin = self.rotary(torch.arange(s, device=x.device))
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(HEAD_DIM)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1).to(x.dtype)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


class Block(torch.nn.Module):
    def __init__(self, rotary, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.input_norm = RMSNorm(DIM, device, dtype)
        self.attn = Attention(rotary, device, dtype)
        self.post_norm = RMSNorm(DIM, device, dtype)
        self.gate_proj = torch.nn.Linear(DIM, FFN, **kw)
        self.up_proj = torch.nn.Linear(DIM, FFN, **kw)
        self.down_proj = torch.nn.Linear(FFN, DIM, **kw)

    def forward(self, x):
        x = x + self.attn(self.input_norm(x))
        h = self.post_norm(x)
        return x + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(torch.nn.Module):
    def __init__(self, device=None, dtype=None, rotary_class=Rotary):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, DIM, device=device, dtype=dtype)
        self.rotary = rotary_class(HEAD_DIM, device)
        self.layers = torch.nn.ModuleList(Block(self.rotary, device, dtype) for _ in range(LAYERS))
        self.norm = RMSNorm(DIM, device, dtype)
        self.bn = torch.nn.BatchNorm1d(DIM, device=device, dtype=dtype)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False, device=device, dtype=dtype)
        self.lm_head.weight = self.embed_tokens.weight  # tied

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.bn(self.norm(x).transpose(1, 2)).transpose(1, 2)
        return self.lm_head(x)


EMBED, HEAD = "embed_tokens.weight", "lm_head.weight"
INV_FREQ_NAMES = ["rotary.inv_freq"] + [f"layers.{i}.attn.rotary.inv_freq" for i in range(LAYERS)]


def reference_module(dtype=torch.float32):
    """The module whose values the checkpoints hold: random weights and running statistics."""
    g = torch.Generator().manual_seed(1234)
    module = TinyLlama(dtype=dtype)  # not .to(dtype), which would cast inv_freq too
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        module.bn.running_mean.copy_(torch.randn(DIM, generator=g) * 0.1)
        module.bn.running_var.copy_(torch.rand(DIM, generator=g) + 0.5)
        module.bn.num_batches_tracked.fill_(7)
    return module.eval()


def checkpoint_tensors(module, keep=(EMBED,)):
    """The module's state_dict with the tied names other than `keep` left out."""
    sd = dict(module.state_dict())
    for name in (EMBED, HEAD):
        if name not in keep:
            del sd[name]
    return sd


# ---- the store ------------------------------------------------------------------


@pytest.fixture(scope="module")
def store():
    directory = tempfile.mkdtemp(prefix="hearth-tl-")
    f32, bf16 = reference_module(), reference_module(torch.bfloat16)
    wrong_head = checkpoint_tensors(f32, keep=(EMBED, HEAD))
    wrong_head[HEAD] = wrong_head[HEAD] + 1.0
    with_inv_freq = checkpoint_tensors(f32)
    for name in INV_FREQ_NAMES:  # as old checkpoints had them; never to be used
        with_inv_freq[name] = torch.full((HEAD_DIM // 2,), 12345.0)
    checkpoints = {
        "tiny": checkpoint_tensors(f32),                          # as save_pretrained writes it
        "tiny_head": checkpoint_tensors(f32, keep=(HEAD,)),        # the other alias
        "tiny_both": checkpoint_tensors(f32, keep=(EMBED, HEAD)),  # both, equal
        "tiny_conflict": wrong_head,                               # both, different
        "tiny_inv_freq": with_inv_freq,
        "tiny_bf16": checkpoint_tensors(bf16),
    }
    files = {}
    for name, tensors in checkpoints.items():
        files[name] = os.path.join(directory, f"{name}.safetensors")
        ht.write_safetensors(files[name], tensors)
    try:
        with ht.running_store(files) as running:
            running.reference = {"tiny": f32, "tiny_bf16": bf16}
            yield running
    finally:
        import shutil
        shutil.rmtree(directory, ignore_errors=True)


def build(mode, dtype=torch.float32, rotary_class=Rotary):
    """A TinyLlama built for real, under meta_parameters(), or entirely on the meta device."""
    if mode == "real":
        return TinyLlama(dtype=dtype, rotary_class=rotary_class)
    if mode == "meta_parameters":
        with htorch.meta_parameters():
            return TinyLlama(dtype=dtype, rotary_class=rotary_class)
    return TinyLlama(device="meta", dtype=dtype, rotary_class=rotary_class)


def tokens():
    return torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(5))


def check_bound(module, weights, reference):
    """Every parameter and persistent buffer views the store; ties and outputs as the reference's."""
    stored = {name: t.data_ptr for name, t in weights.items()}
    tied = stored.get(EMBED, stored.get(HEAD))  # the first stored name in module order
    for name, tensor in module.state_dict(keep_vars=True).items():
        assert tensor.device == torch.device(DEVICE), name
        want = tied if name in (EMBED, HEAD) else stored[name]
        assert tensor.data_ptr() == want, f"{name} is not the store's tensor"
    assert module.lm_head.weight is module.embed_tokens.weight, "the tie was lost"
    assert isinstance(module.lm_head.weight, torch.nn.Parameter)
    assert module.bn.num_batches_tracked.dtype == torch.int64
    assert int(module.bn.num_batches_tracked) == 7
    # The non-persistent buffer: the module's own value, one tensor for every name, on the device.
    for name in INV_FREQ_NAMES:
        buffer = module.get_buffer(name)
        assert buffer is module.rotary.inv_freq, name
    assert module.rotary.inv_freq.device == torch.device(DEVICE)
    assert torch.equal(module.rotary.inv_freq.cpu(), reference.rotary.inv_freq.cpu())
    reference = copy.deepcopy(reference).to(DEVICE)
    with torch.no_grad():
        got, want = module.eval()(tokens().to(DEVICE)), reference(tokens().to(DEVICE))
    assert got.dtype == want.dtype
    assert torch.equal(got, want), f"outputs differ by up to {(got - want).abs().max()}"


# ---- binding --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["real", "meta_parameters", "meta"])
def test_tied_and_buffered_module_binds_zero_copy(store, mode):
    weights = hearth.attach("tiny", socket=store.socket)
    module = build(mode)
    assert htorch.load_into(module, weights) is module
    assert EMBED in weights and HEAD not in weights
    check_bound(module, weights, store.reference["tiny"])


@pytest.mark.parametrize("model", ["tiny_head", "tiny_both"])
def test_either_alias_of_a_tie_binds_it(store, model):
    weights = hearth.attach(model, socket=store.socket)
    module = htorch.load_into(build("meta_parameters"), weights)
    check_bound(module, weights, store.reference["tiny"])
    if model == "tiny_both":  # the first name in module order is the one bound
        assert module.lm_head.weight.data_ptr() == weights[EMBED].data_ptr


def test_bf16_module_binds(store):
    weights = hearth.attach("tiny_bf16", socket=store.socket)
    module = htorch.load_into(build("meta", dtype=torch.bfloat16), weights)
    assert module.embed_tokens.weight.dtype == torch.bfloat16
    assert module.rotary.inv_freq.dtype == torch.float32  # the module's own buffer
    check_bound(module, weights, store.reference["tiny_bf16"])


def test_stored_non_persistent_buffers_are_ignored(store):
    weights = hearth.attach("tiny_inv_freq", socket=store.socket)
    assert all(name in weights for name in INV_FREQ_NAMES)
    module = htorch.load_into(build("meta"), weights)
    assert float(module.rotary.inv_freq.max()) == 1.0  # computed, not the stored 12345
    for name in INV_FREQ_NAMES:
        assert module.get_buffer(name).data_ptr() != weights[name].data_ptr


def test_outputs_equal_load_state_dict(store):
    # The same module loaded the ordinary way (copies) computes exactly the same.
    copied = TinyLlama().to(DEVICE)
    copied.load_state_dict({k: v.to(DEVICE) for k, v in
                            store.reference["tiny"].state_dict().items()})
    module = htorch.load_into(build("meta_parameters"), "tiny", socket=store.socket)
    with torch.no_grad():
        assert torch.equal(module.eval()(tokens().to(DEVICE)), copied.eval()(tokens().to(DEVICE)))


def test_buffers_with_values_move_to_the_weights_device(store):
    module = build("real")
    before = module.rotary.inv_freq
    htorch.load_into(module, "tiny", socket=store.socket)
    if ON_CUDA:
        assert module.rotary.inv_freq.device == torch.device(DEVICE)
        assert module.layers[1].attn.rotary.inv_freq is module.rotary.inv_freq
    else:
        assert module.rotary.inv_freq is before  # already there: untouched


# ---- errors -------------------------------------------------------------------------


def snapshot(module):
    """Identity of every registered tensor: a failed load must leave all of them in place."""
    return [(prefix, leaf, id(t)) for prefix, sub in module.named_modules(remove_duplicate=False)
            for table in (sub._parameters, sub._buffers) for leaf, t in table.items()]


def load_error(module, model, socket):
    before = snapshot(module)
    with pytest.raises(hearth.InvalidArgument) as info:
        htorch.load_into(module, model, socket=socket)
    assert snapshot(module) == before, "a failed load changed the module"
    return str(info.value)


class Extra(TinyLlama):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.extra = torch.nn.Linear(2, 3)
        self.register_buffer("scratch", torch.zeros(4), persistent=False)


def test_missing_lists_only_what_is_really_missing(store):
    message = load_error(Extra(), "tiny", store.socket)
    assert "cannot load tiny into Extra" in message
    assert "missing in the store: extra.weight, extra.bias" in message, message
    for satisfied in (HEAD, "inv_freq", "scratch", "not in the module", "mismatch"):
        assert satisfied not in message, message


def test_a_tie_missing_under_every_name(store):
    class Untied(TinyLlama):  # lm_head no longer tied: the store lacks lm_head.weight
        def __init__(self):
            super().__init__()
            self.lm_head.weight = torch.nn.Parameter(torch.zeros(VOCAB, DIM))

    message = load_error(Untied(), "tiny", store.socket)
    assert "missing in the store: lm_head.weight" in message, message
    assert EMBED not in message, message

    class TiedElsewhere(torch.nn.Module):  # one Parameter under two names, neither stored
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 2, bias=False)
            self.b = torch.nn.Linear(2, 2, bias=False)
            self.b.weight = self.a.weight

    message = load_error(TiedElsewhere(), "tiny", store.socket)
    assert "missing in the store: a.weight (tied: b.weight)" in message, message


def test_unexpected_and_mismatched_are_listed(store):
    class Smaller(TinyLlama):
        def __init__(self):
            super().__init__(dtype=torch.float64)
            del self.bn
            self.norm = RMSNorm(DIM + 1)
            self.norm.weight = torch.nn.Parameter(torch.ones(DIM + 1, dtype=torch.float64))

        def forward(self, ids):
            raise AssertionError("never run")

    message = load_error(Smaller(), "tiny", store.socket)
    assert ("not in the module: bn.bias, bn.num_batches_tracked, bn.running_mean, "
            "bn.running_var, bn.weight") in message, message
    assert "embed_tokens.weight: module float64, store float32" in message, message
    assert "norm.weight: module float64, store float32; module (33,), store (32,)" in message
    assert "missing" not in message, message


def test_tied_names_holding_different_values(store):
    message = load_error(build("meta_parameters"), "tiny_conflict", store.socket)
    assert ("tied names holding different tensors in the store: embed_tokens.weight and "
            "lm_head.weight") in message, message


def test_a_meta_buffer_nothing_can_fill(store):
    module = build("meta", rotary_class=RotaryWithoutInitialiser)
    message = load_error(module, "tiny", store.socket)
    assert "non-persistent buffers on the meta device that nothing can fill" in message, message
    assert "rotary.inv_freq (shared: layers.0.attn.rotary.inv_freq, " in message, message
    assert "RotaryWithoutInitialiser has no reset_parameters()" in message, message
    assert "meta_parameters()" in message, message
    assert module.rotary.inv_freq.is_meta


def test_a_meta_buffer_beside_parameters_is_not_reinitialised(store):
    class Owner(torch.nn.Module):  # reset_parameters here would overwrite the shared weight
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(3, device="meta"))
            self.register_buffer("table", torch.empty(3, device="meta"), persistent=False)

        def reset_parameters(self):
            raise AssertionError("must not be called")

    message = load_error(Owner(), "tiny", store.socket)
    assert "table (Owner also holds parameters or persistent buffers" in message, message


def test_an_initialiser_that_leaves_a_buffer_unfilled(store):
    class Lazy(Rotary):
        def reset_parameters(self):
            pass  # fills nothing

    module = build("meta", rotary_class=Lazy)
    message = load_error(module, "tiny", store.socket)
    assert "Lazy.reset_parameters() left the non-persistent buffer rotary.inv_freq" in message
    assert module.rotary.inv_freq.is_meta


# ---- read-only and one copy ---------------------------------------------------------


@host_only
def test_writing_a_bound_parameter_kills_only_that_process(store):
    proc = ht.run_script("""
        import sys, torch, hearth.torch
        from test_torch_load import build
        module = hearth.torch.load_into(build("meta_parameters"), "tiny", socket=sys.argv[1])
        print("bound", float(module.lm_head.weight[0, 0]), flush=True)
        with torch.no_grad():
            module.embed_tokens.weight.add_(1)
        print("write succeeded", flush=True)
        """, store.socket)
    assert "bound " in proc.stdout, proc.stderr
    assert "write succeeded" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr[-2000:])
    assert store.proc.poll() is None, "the store died"
    expected = store.reference["tiny"].embed_tokens.weight
    assert torch.equal(htorch.state_dict("tiny", socket=store.socket)[EMBED], expected)


WORKER = r"""
import hashlib, json, os, sys
import torch
import hearth, hearth.torch
import hearth_testing as ht
from test_torch_load import build, tokens

socket, device = sys.argv[1], sys.argv[2]
weights = hearth.attach("tiny", socket=socket)
module = hearth.torch.load_into(build("meta_parameters"), weights)
total = sum(float(t.sum(dtype=torch.float64)) for t in module.state_dict().values())  # every page
with torch.no_grad():
    logits = module.eval()(tokens().to(device))
maps = ht.arena_maps() if device == "cpu" else []
pointers = {name: t.data_ptr() for name, t in module.state_dict().items()}
report = {
    "pid": os.getpid(),
    "maps": maps,
    "in_store": all(pointers[n] == weights[n if n in weights else "embed_tokens.weight"].data_ptr
                    for n in pointers),
    "in_mapping": all(any(b <= p < e for b, e, _ in maps) for p in pointers.values()),
    "logits": hashlib.sha256(logits.cpu().numpy().tobytes()).hexdigest(),
    "total": total,
}
print(json.dumps(report), flush=True)
sys.stdin.readline()  # stay attached until the parent has looked
"""


def test_four_processes_share_one_copy(store):
    weight_bytes = sum(t.nbytes for t in hearth.attach("tiny", socket=store.socket).values())
    procs = [ht.spawn_reporter(WORKER, store.socket, DEVICE) for _ in range(4)]
    try:
        reports = [ht.report_of(p, 120) for p in procs]
        ht.wait_for(lambda: ht.store_attached_count(store.socket, "tiny") >= 4,
                    "4 leases on tiny", procs=procs)
        assert len({r["logits"] for r in reports}) == 1
        assert len({r["total"] for r in reports}) == 1
        assert all(r["in_store"] for r in reports), "a worker holds a tensor of its own"
        if not ON_CUDA:
            assert all(r["in_mapping"] for r in reports), reports
            inodes = {(m[2],) for r in reports for m in r["maps"]}
            assert all(len(r["maps"]) == 1 for r in reports), [r["maps"] for r in reports]
            assert len(inodes) == 1, f"the workers map different arenas: {inodes}"
            smaps = [ht.arena_smaps(r["pid"]) for r in reports]
            pss = sum(s["Pss"] for s in smaps)
            # One copy among the four: page rounding and kB truncation aside.
            assert 0.9 * weight_bytes <= pss <= weight_bytes + 4 * 4096 + 4 * 1024, (pss, smaps)
            assert all(s["Rss"] >= weight_bytes for s in smaps), smaps
            assert all(s["Private_Dirty"] == 0 for s in smaps), smaps
    finally:
        ht.finish_reporters(procs)


def test_a_meta_buffer_filled_by_the_enclosing_transformers_model(store, monkeypatch):
    # transformers' own models are tested in test_transformers.py; this checks, where
    # transformers is absent, that load_into asks the innermost PreTrainedModel around the
    # buffer's owner to _init_weights(owner), as from_pretrained does for such buffers.
    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed: test_transformers.py covers its models")
    import types

    class PreTrainedModel(torch.nn.Module):
        pass

    monkeypatch.setitem(sys.modules, "transformers",
                        types.SimpleNamespace(PreTrainedModel=PreTrainedModel))
    calls = []

    class Model(PreTrainedModel):
        def __init__(self):
            super().__init__()
            self.inner = TinyLlama(device="meta", rotary_class=RotaryWithoutInitialiser)

        def _init_weights(self, module):
            calls.append(type(module).__name__)
            if isinstance(module, Rotary):
                module.inv_freq.copy_(module.compute(module.inv_freq.device))

    class Wrapper(torch.nn.Module):  # not a PreTrainedModel itself
        def __init__(self):
            super().__init__()
            self.model = Model()

    weights = {f"model.inner.{k}": v for k, v in
               htorch.state_dict("tiny", socket=store.socket).items()}
    wrapper = htorch.load_into(Wrapper(), weights)
    assert calls == ["RotaryWithoutInitialiser"]
    inner = wrapper.model.inner
    assert inner.lm_head.weight is inner.embed_tokens.weight
    assert torch.equal(inner.rotary.inv_freq.cpu(), store.reference["tiny"].rotary.inv_freq)
    with torch.no_grad():
        got = inner.eval()(tokens().to(DEVICE))
        want = copy.deepcopy(store.reference["tiny"]).to(DEVICE)(tokens().to(DEVICE))
    assert torch.equal(got, want)
