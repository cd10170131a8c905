"""PyTorch helpers: zero-copy torch tensors over a hearth attachment.

torch is imported inside the functions, so `import hearth.torch` costs nothing
and touches no GPU. The tensors share the store's read-only memory: never
write to them (in-place ops, optimizers) — writing kills the process.
"""

import inspect

import hearth as _hearth


def state_dict(model, socket=None, version=None, store_uid=None):
    """Returns {name: torch.Tensor} viewing `model`'s shared weights (no copy).

    `model` is a model name (attached now, in this process, with `socket`,
    `version` and `store_uid` as for hearth.attach) or a Mapping returned by
    hearth.attach().
    """
    import torch

    weights = _weights(model, socket, version, store_uid)
    return {name: torch.from_dlpack(tensor) for name, tensor in weights.items()}


def load_into(module, model, socket=None, version=None, store_uid=None):
    """Binds `module`'s parameters and buffers to the shared weights (no copy).

    Checks strictly first: every missing, unexpected and mis-shaped tensor is
    listed in one HearthError (InvalidArgument) and the module is left
    untouched. Then calls module.load_state_dict(..., assign=True), so the
    module's tensors become the shared read-only views. Returns the module.
    """
    sd = state_dict(model, socket, version, store_uid)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    misshaped = sorted(
        f"{name}: module {tuple(expected[name].shape)}, store {tuple(sd[name].shape)}"
        for name in set(expected) & set(sd)
        if tuple(expected[name].shape) != tuple(sd[name].shape))
    if missing or unexpected or misshaped:
        name = model if isinstance(model, str) else getattr(model, "model", "model")
        lines = [f"hearth: cannot load {name} into {type(module).__name__}:"]
        if missing:
            lines.append("  missing in the store: " + ", ".join(missing))
        if unexpected:
            lines.append("  not in the module: " + ", ".join(unexpected))
        if misshaped:
            lines.append("  shape mismatch: " + "; ".join(misshaped))
        raise _hearth.InvalidArgument("\n".join(lines), -1)
    if "assign" in inspect.signature(module.load_state_dict).parameters:
        module.load_state_dict(sd, strict=True, assign=True)
    else:  # torch < 2.1 has no assign=: bind the views ourselves
        _assign(module, sd)
    return module


def _assign(module, sd):
    import torch

    for name, tensor in sd.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if leaf in owner._parameters:
            # As assign=True does: keep the module's requires_grad flag.
            requires_grad = owner._parameters[leaf].requires_grad
            owner._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=requires_grad)
        else:
            owner._buffers[leaf] = tensor


def _weights(model, socket, version, store_uid):
    if isinstance(model, str):
        return _hearth.attach(model, socket=socket, version=version, store_uid=store_uid)
    if socket is not None or version is not None or store_uid is not None:
        raise ValueError("hearth.torch: socket/version/store_uid apply only when model is a name")
    return model
