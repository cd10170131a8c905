"""PyTorch helpers: zero-copy torch tensors over a hearth attachment.

torch is imported inside the functions, so `import hearth.torch` costs nothing
and touches no GPU. The tensors share the store's read-only memory: never
write to them (in-place ops, optimizers) — writing kills the process.

    with hearth.torch.meta_parameters():      # parameters cost nothing, buffers are real
        module = MyModel(config)
    hearth.torch.load_into(module, "llama")    # binds the store's tensors, no copy

What load_into guarantees (torch 1.13 and later):

- Every parameter and persistent buffer of `module` is bound to the store's
  tensor of its name: afterwards it *is* a view of the store's read-only
  memory (same data pointer, no copy), with the store's dtype and shape,
  which must equal the module's.
- Tied parameters (one Parameter object reachable under several names, as
  `named_parameters(remove_duplicate=False)` lists them, e.g. `lm_head.weight`
  and `model.embed_tokens.weight`) are bound to the ONE stored tensor that the
  store holds under any of those names, and stay tied: every name refers to
  the same new Parameter object. If the store holds several of the names,
  their dtypes, shapes and values must be equal; the first name in module
  order is bound.
- Non-persistent buffers (`register_buffer(..., persistent=False)`, such as a
  rotary `inv_freq`) belong to the module: they are never required from the
  store, and a stored tensor of that name is ignored. A buffer that has a
  value stays as it is, moved to the weights' device if it is elsewhere (a
  copy of the module's own small tensor). A buffer on the meta device has no
  value: it is created on the weights' device and filled by its owning
  module's own initialisation — `owner.reset_parameters()`, or for a
  `transformers` model its `_init_weights(owner)` (what `from_pretrained`
  runs for such buffers) — but only where the owner holds nothing else (no
  parameters, no persistent buffers), so that the initialiser cannot write
  the shared read-only weights. If there is no such initialiser, or it leaves
  the buffer unfilled (a floating buffer still all NaN, an integer one still
  all its type's minimum: the placeholders it starts as), load_into fails
  naming the buffer. Building the module under `meta_parameters()` avoids
  the question: its buffers are computed by its own __init__, for real.
- After load_into no parameter or buffer of `module` is on the meta device.
- Any mismatch (missing, unexpected, dtype, shape, tied names holding
  different values, a meta buffer nothing can fill) raises one
  InvalidArgument listing all of them, and the module is left unchanged.

Tensors bound directly: module.load_state_dict and its hooks are not run.
Tensors kept as plain attributes (not registered as parameter or buffer) are
not touched.
"""

import contextlib
import sys
import threading

import hearth as _hearth

__all__ = ["state_dict", "load_into", "meta_parameters"]


def state_dict(model, socket=None, version=None, store_uid=None):
    """Returns {name: torch.Tensor} viewing `model`'s shared weights (no copy).

    `model` is a model name (attached now, in this process, with `socket`,
    `version` and `store_uid` as for hearth.attach) or a Mapping returned by
    hearth.attach().
    """
    import torch

    weights = _weights(model, socket, version, store_uid)
    return {name: torch.from_dlpack(tensor) for name, tensor in weights.items()}


# ---- building without parameters ---------------------------------------------

_meta_lock = threading.RLock()


@contextlib.contextmanager
def meta_parameters():
    """Modules built inside have their parameters on the meta device, their buffers real.

    Every `torch.nn.Parameter` registered while the context is active (through
    `register_parameter` or attribute assignment) is replaced by one of the
    same shape, dtype and requires_grad on the meta device: it holds no memory,
    and initialising it (reset_parameters, init.normal_) does nothing. Buffers
    are left alone, so a module's own __init__ computes its buffers (a rotary
    `inv_freq`) for real, on the device it would use without this context;
    load_into then moves them to the weights' device. A parameter already on
    the meta device is registered as it is, so ties made during construction
    (`lm_head.weight = embed_tokens.weight`) survive.

    The original tensors are still allocated for a moment (torch.empty, pages
    never touched) and dropped. The context patches torch.nn.Module for the
    whole process while it is active: do not build modules on other threads
    meanwhile (contexts on several threads are serialised).
    """
    import torch

    with _meta_lock:
        original = torch.nn.Module.register_parameter

        def register_parameter(self, name, param):
            if type(param) is torch.nn.Parameter and param.device.type != "meta":
                meta = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                meta.__dict__.update(param.__dict__)
                param = meta
            original(self, name, param)

        torch.nn.Module.register_parameter = register_parameter
        try:
            yield
        finally:
            torch.nn.Module.register_parameter = original


# ---- binding -----------------------------------------------------------------


class _Slot:
    """One tensor object of the module, under every name that reaches it."""

    __slots__ = ("kind", "tensor", "names", "owners", "persistent")

    def __init__(self, kind, tensor):
        self.kind = kind          # "parameter" or "buffer"
        self.tensor = tensor
        self.names = []           # qualified names, in module order
        self.owners = []          # (submodule, attribute name), one per name
        self.persistent = False   # buffers: in the state_dict under some name


def _slots(module):
    """The module's parameters and buffers, grouped by tensor identity."""
    slots = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for kind, table in (("parameter", sub._parameters), ("buffer", sub._buffers)):
            for leaf, tensor in table.items():
                if tensor is None:
                    continue
                slot = slots.get(id(tensor))
                if slot is None:
                    slot = slots[id(tensor)] = _Slot(kind, tensor)
                slot.names.append(f"{prefix}.{leaf}" if prefix else leaf)
                slot.owners.append((sub, leaf))
                if kind == "parameter" or leaf not in sub._non_persistent_buffers_set:
                    slot.persistent = True
    return list(slots.values())


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _describe(slot):
    if len(slot.names) == 1:
        return slot.names[0]
    relation = "tied" if slot.kind == "parameter" else "shared"
    return f"{slot.names[0]} ({relation}: {', '.join(slot.names[1:])})"


class _BufferFill:
    """The meta non-persistent buffers of one owner module and the initialiser that fills them."""

    def __init__(self, slots, initialiser, initialiser_name):
        self.slots = slots                # of the owner's meta non-persistent buffers
        self.initialiser = initialiser    # callable(): fills them
        self.initialiser_name = initialiser_name


def _initialiser(root, owner):
    """(callable, description) of `owner`'s own buffer initialisation, or (None, why not)."""
    if any(p is not None for p in owner._parameters.values()) or any(
            b is not None and leaf not in owner._non_persistent_buffers_set
            for leaf, b in owner._buffers.items()):
        return None, (f"{type(owner).__name__} also holds parameters or persistent buffers, "
                      "which its initialiser would overwrite")
    reset = getattr(owner, "reset_parameters", None)
    if callable(reset):
        return reset, f"{type(owner).__name__}.reset_parameters()"
    model = _enclosing_pretrained_model(root, owner)
    if model is not None:
        return (lambda: model._init_weights(owner),
                f"{type(model).__name__}._init_weights({type(owner).__name__})")
    return None, f"{type(owner).__name__} has no reset_parameters()"


def _enclosing_pretrained_model(root, owner):
    """The innermost transformers PreTrainedModel in `root` that contains `owner`, or None.

    transformers is looked up, never imported: a model of it exists only if it is loaded.
    """
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers else None
    if pretrained is None:
        return None
    found = None
    for candidate in root.modules():  # outer modules come before the modules they contain
        if isinstance(candidate, pretrained) and hasattr(candidate, "_init_weights") and \
                any(m is owner for m in candidate.modules()):
            found = candidate
    return found


def _fill_placeholder(torch, buffer, device):
    """A tensor like `buffer` on `device` holding a value no initialiser would leave."""
    out = torch.empty_like(buffer, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    elif out.dtype != torch.bool:
        out.fill_(torch.iinfo(out.dtype).min)
    return out


def _unfilled(torch, tensor):
    if tensor.numel() == 0 or tensor.dtype == torch.bool:
        return False
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).all())
    return bool((tensor == torch.iinfo(tensor.dtype).min).all())


def load_into(module, model, socket=None, version=None, store_uid=None):
    """Binds `module`'s parameters and persistent buffers to the shared weights (no copy).

    `model` is a model name (attached now, with `socket`, `version` and
    `store_uid` as for hearth.attach) or a Mapping returned by hearth.attach().
    Ties, non-persistent buffers and the meta device are handled as the module
    docstring states. Checks strictly first: every missing, unexpected,
    mis-typed and mis-shaped tensor is listed in one HearthError
    (InvalidArgument) and the module is left untouched. Returns the module.
    """
    import torch

    weights = _weights(model, socket, version, store_uid)
    sd = {name: torch.from_dlpack(tensor) for name, tensor in weights.items()}
    device = _weights_device(torch, weights, sd)
    what = model if isinstance(model, str) else getattr(model, "model", "model")

    slots = _slots(module)
    bound = []          # (slot, stored name)
    missing, mismatched, conflicting = [], [], []
    claimed = set()
    buffers_to_move = []  # non-persistent slots with a value elsewhere than `device`
    meta_buffers = []     # non-persistent slots on the meta device
    for slot in slots:
        stored = [name for name in slot.names if name in sd]
        claimed.update(stored)
        if not slot.persistent:
            if slot.tensor.is_meta:
                meta_buffers.append(slot)
            elif slot.tensor.device != device:
                buffers_to_move.append(slot)
            continue
        if not stored:
            missing.append(_describe(slot))
            continue
        first = sd[stored[0]]
        problems = []
        if slot.tensor.dtype != first.dtype:
            problems.append(f"module {_dtype_name(slot.tensor.dtype)}, "
                            f"store {_dtype_name(first.dtype)}")
        if tuple(slot.tensor.shape) != tuple(first.shape):
            problems.append(f"module {tuple(slot.tensor.shape)}, store {tuple(first.shape)}")
        if problems:
            mismatched.append(f"{stored[0]}: {'; '.join(problems)}")
            continue
        for other in stored[1:]:
            t = sd[other]
            if t.dtype != first.dtype or tuple(t.shape) != tuple(first.shape) or \
                    not torch.equal(t, first):
                conflicting.append(f"{stored[0]} and {other}")
        bound.append((slot, stored[0]))
    unexpected = sorted(set(sd) - claimed)

    fills, unfillable = _plan_buffer_fills(module, meta_buffers)
    if missing or unexpected or mismatched or conflicting or unfillable:
        lines = [f"hearth: cannot load {what} into {type(module).__name__}:"]
        if missing:
            lines.append("  missing in the store: " + ", ".join(missing))
        if unexpected:
            lines.append("  not in the module: " + ", ".join(unexpected))
        if mismatched:
            lines.append("  dtype or shape mismatch: " + "; ".join(mismatched))
        if conflicting:
            lines.append("  tied names holding different tensors in the store: "
                         + "; ".join(conflicting))
        if unfillable:
            lines.append("  non-persistent buffers on the meta device that nothing can fill "
                         "(build the module under hearth.torch.meta_parameters(), or give "
                         "them values): " + "; ".join(unfillable))
        raise _hearth.InvalidArgument("\n".join(lines), -1)

    _fill_meta_buffers(torch, module, what, fills, buffers_to_move, device)
    for slot, name in bound:
        if slot.kind == "parameter":
            # As load_state_dict(assign=True) does: keep the module's requires_grad flag.
            tensor = torch.nn.Parameter(sd[name], requires_grad=slot.tensor.requires_grad)
            for owner, leaf in slot.owners:
                owner._parameters[leaf] = tensor
        else:
            for owner, leaf in slot.owners:
                owner._buffers[leaf] = sd[name]

    on_meta = [name for name, t in list(module.named_parameters()) + list(module.named_buffers())
               if t.is_meta]
    if on_meta:  # a broken invariant of the checks above: say so rather than run on meta
        raise _hearth.HearthError(f"hearth: after loading {what}, still on the meta device: "
                                  + ", ".join(on_meta))
    return module


def _plan_buffer_fills(module, meta_buffers):
    """Groups meta non-persistent buffers by owner; returns (fills, descriptions of the unfillable)."""
    by_owner = {}
    for slot in meta_buffers:
        owner = slot.owners[0][0]
        by_owner.setdefault(id(owner), (owner, []))[1].append(slot)
    fills, unfillable = [], []
    for owner, slots in by_owner.values():
        initialiser, description = _initialiser(module, owner)
        if initialiser is None:
            unfillable.append(", ".join(_describe(s) for s in slots) + f" ({description})")
        else:
            fills.append(_BufferFill(slots, initialiser, description))
    return fills, unfillable


def _fill_meta_buffers(torch, module, what, fills, buffers_to_move, device):
    """Moves the buffers that have values, fills the meta ones; on failure restores all."""
    saved = []  # (owner, leaf, original tensor)

    def put(slot, tensor):
        for owner, leaf in slot.owners:
            saved.append((owner, leaf, owner._buffers[leaf]))
            owner._buffers[leaf] = tensor

    try:
        for slot in buffers_to_move:
            put(slot, slot.tensor.to(device))
        for fill in fills:
            for slot in fill.slots:
                put(slot, _fill_placeholder(torch, slot.tensor, device))
            with torch.no_grad():
                fill.initialiser()
            for slot in fill.slots:
                owner, leaf = slot.owners[0]
                tensor = owner._buffers.get(leaf)
                label = _describe(slot)
                if tensor is None or tensor.is_meta or _unfilled(torch, tensor):
                    raise _hearth.InvalidArgument(
                        f"hearth: cannot load {what} into {type(module).__name__}: "
                        f"{fill.initialiser_name} left the non-persistent buffer {label} "
                        "without a value (build the module under "
                        "hearth.torch.meta_parameters(), or give it a value)", -1)
                if tensor.device != device:  # the initialiser made a new one elsewhere
                    tensor = tensor.to(device)
                # Every name of a shared buffer gets what the initialiser left under the first.
                put(slot, tensor)
    except BaseException:
        for owner, leaf, tensor in reversed(saved):
            owner._buffers[leaf] = tensor
        raise


def _weights_device(torch, weights, sd):
    device = getattr(weights, "device", None)
    if device is None and sd:
        return next(iter(sd.values())).device
    return torch.device(device or "cpu")


def _weights(model, socket, version, store_uid):
    if isinstance(model, str):
        return _hearth.attach(model, socket=socket, version=version, store_uid=store_uid)
    if socket is not None or version is not None or store_uid is not None:
        raise ValueError("hearth.torch: socket/version/store_uid apply only when model is a name")
    return model
