"""Hugging Face transformers models over a store's weights: one copy, any number of processes.

    import hearth.transformers
    model = hearth.transformers.causal_lm("llama", "/models/llama")   # weights: the store's
    tokenizer = hearth.transformers.tokenizer("/models/llama")        #   "llama"; the rest:
    inputs = tokenizer("Hello", return_tensors="pt").to(model.device) #   the directory
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)

`causal_lm` builds the model that `AutoModelForCausalLM.from_pretrained(directory)`
would build, without reading a single weight from the directory:

1. the configuration from the directory's `config.json` (AutoConfig);
2. the model from it with `from_config`, in the dtype of the store's tensors,
   under hearth.torch.meta_parameters(): parameters on the meta device (no
   memory, no initialisation), buffers (a rotary `inv_freq`) computed by the
   model's own code on the CPU, as from_pretrained computes them; ties made
   by the model (`tie_word_embeddings`) kept;
3. hearth.torch.load_into: every parameter and persistent buffer becomes a
   view of the store's read-only copy (no copy, on the store's device), the
   tied output embedding bound to the one stored tensor whichever name the
   checkpoint holds, non-persistent buffers moved to the store's device;
4. eval mode, and the directory's `generation_config.json` when it has one.

The model lives on the store's device (`hearth store --device`): its weights
cannot move without a copy. It generates exactly what from_pretrained of the
same checkpoint, in the same dtype on the same device, generates. Never train
it or write to its parameters: they are read-only shared memory, and writing
kills the process.

`transformers` and torch are imported on first call, so `import
hearth.transformers` costs nothing and touches no GPU; without transformers
the call raises ImportError saying so. `prepare(directory)` does that
importing ahead of need, with no GPU: at the top of a `backend: python`
model.py, so that the model's zygote imports it once for all its workers.
"""

import os
import sys

import hearth.torch as _htorch

__all__ = ["causal_lm", "load", "prepare", "tokenizer"]


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "hearth.transformers needs the `transformers` package (pip install transformers), "
            f"which this interpreter ({sys.executable}) cannot import: {e}") from e
    return transformers


def _checkpoint_dir(checkpoint_dir, what):
    path = os.fspath(checkpoint_dir)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"hearth.transformers: {what}: {path!r} is not a directory "
                                "(a Hugging Face checkpoint directory with config.json)")
    return path


def _version(transformers):
    parts = []
    for part in transformers.__version__.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _weights_dtype(torch, weights):
    """The floating dtype holding most of the store's bytes (None if there is none)."""
    bytes_by_dtype = {}
    for tensor in weights.values():
        t = torch.from_dlpack(tensor)
        if t.is_floating_point():
            bytes_by_dtype[t.dtype] = bytes_by_dtype.get(t.dtype, 0) + t.numel() * t.element_size()
    if not bytes_by_dtype:
        return None
    return max(bytes_by_dtype, key=bytes_by_dtype.get)


def prepare(checkpoint_dir):
    """Imports, touching no device, what causal_lm and tokenizer will need for
    `checkpoint_dir`: transformers, the modules of the architectures its
    config.json names (transformers imports a model's module only when its
    class is first asked for: seconds for Llama), and the tokenizer classes.
    Returns the architectures' classes found."""
    transformers = _transformers()
    import torch  # noqa: F401

    path = _checkpoint_dir(checkpoint_dir, "checkpoint_dir")
    import json
    with open(os.path.join(path, "config.json")) as f:
        names = json.load(f).get("architectures") or []
    found = [getattr(transformers, n) for n in names if isinstance(n, str) and hasattr(transformers, n)]
    for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "GenerationConfig",
                 "PreTrainedTokenizerFast"):
        getattr(transformers, name, None)
    return found


def load(auto_class, model, checkpoint_dir=None, *, config=None, socket=None, version=None,
         store_uid=None, attn_implementation=None, trust_remote_code=False):
    """A transformers model of `auto_class` (e.g. AutoModelForCausalLM) over the store's weights.

    `model` is the store's model name (attached with `socket`, `version` and
    `store_uid` as for hearth.attach) or a Mapping returned by hearth.attach().
    The configuration is `config` (a PretrainedConfig) or the `config.json` of
    `checkpoint_dir`; the directory also gives `generation_config.json`.
    `attn_implementation` ("sdpa", "eager", ...) is passed to from_config.
    Raises hearth.InvalidArgument (from hearth.torch.load_into) naming every
    tensor that does not match the configuration.
    """
    transformers = _transformers()
    import torch

    if checkpoint_dir is not None:
        checkpoint_dir = _checkpoint_dir(checkpoint_dir, "checkpoint_dir")
    if config is None:
        if checkpoint_dir is None:
            raise ValueError("hearth.transformers: give checkpoint_dir (with config.json) or config")
        config = transformers.AutoConfig.from_pretrained(
            checkpoint_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    weights = _htorch._weights(model, socket, version, store_uid)

    kwargs = {"trust_remote_code": trust_remote_code}
    dtype = _weights_dtype(torch, weights)
    if dtype is not None:
        # transformers 4.56 renamed torch_dtype= to dtype=; 5 warns about the old name.
        kwargs["dtype" if _version(transformers) >= (4, 56) else "torch_dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with _htorch.meta_parameters():
        built = auto_class.from_config(config, **kwargs)
    # from_config ties during construction (post_init); tying again is harmless and covers
    # models whose ties are made only by an explicit call.
    built.tie_weights()
    _htorch.load_into(built, weights)
    built.eval()

    if checkpoint_dir is not None and os.path.isfile(
            os.path.join(checkpoint_dir, "generation_config.json")):
        can_generate = getattr(built, "can_generate", None)
        if can_generate is not None and can_generate():
            built.generation_config = transformers.GenerationConfig.from_pretrained(
                checkpoint_dir, local_files_only=True)
    return built


def causal_lm(model, checkpoint_dir=None, **kwargs):
    """AutoModelForCausalLM over the store's weights: `load(AutoModelForCausalLM, ...)`."""
    return load(_transformers().AutoModelForCausalLM, model, checkpoint_dir, **kwargs)


def tokenizer(checkpoint_dir, **kwargs):
    """AutoTokenizer.from_pretrained(checkpoint_dir, local_files_only=True, **kwargs).

    Tokenizers hold no weights: each process loads its own from the directory.
    """
    transformers = _transformers()
    kwargs.setdefault("local_files_only", True)
    return transformers.AutoTokenizer.from_pretrained(
        _checkpoint_dir(checkpoint_dir, "tokenizer"), **kwargs)
