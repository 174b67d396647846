"""Weights into the engine without materialising the model twice, and buffers onto the device.

Build the model with its parameters on the meta device (shapes only: `accelerate.init_empty_weights()`,
which leaves buffers real), build the engine on it (its host buffers are the only copy), then stream
the checkpoint in: `engine.load_weights((name, tensor) for each tensor of each safetensors shard)`.
Every tensor goes straight into its host buffers and can be freed at once.
"""

import torch
from torch import nn

from slidefusion.errors import UserError


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers and integer parameters go to the device for good. A buffer on the meta device must
    be in the state dict (it is filled by `load_weights`); one that is not could never be filled."""
    persistent = set(model.state_dict(keep_vars=True))
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None:
                continue
            key = f"{prefix}.{name}" if prefix else name
            if buffer.is_meta:
                if key not in persistent:
                    raise UserError(f"buffer {key} is on the meta device and not in the state dict, so no checkpoint "
                                    "can fill it; build the model with accelerate.init_empty_weights() (parameters only)")
                continue
            setattr(module, name, buffer.to(device))
        for param in module.parameters(recurse=False):
            if not param.is_floating_point():
                param.data = param.data.to(device)


def load_named_tensors(model: nn.Module, state, named_tensors, device: torch.device) -> None:
    """Write each `(name, tensor)` into the host state (parameters) or the model (buffers), then
    check that every parameter, and every buffer still on the meta device, was written exactly once."""
    places = {e.name: (g, e) for g in state.groups.values() for e in g.layout.entries}
    buffers = _buffer_slots(model)
    written: set[str] = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name in written:
                raise UserError(f"load_weights: {name} was given twice")
            if name in places:
                group, entry = places[name]
                _check_shape(name, tensor, entry.shape)
                group.write(entry.offset, entry.numel, tensor)
            elif name in buffers:
                _write_buffer(name, tensor, *buffers[name], device)
            else:
                raise UserError(f"load_weights: unexpected key {name}; this model has e.g. {next(iter(places), '')}")
            written.add(name)
    required = [*places, *(k for k, (module, attr) in buffers.items() if getattr(module, attr).is_meta)]
    missing = [k for k in required if k not in written]
    if missing:
        raise UserError(f"load_weights: {len(missing)} weights missing, first {missing[0]}")


def _buffer_slots(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Persistent buffers by state_dict name -> (owning module, attribute)."""
    persistent = set(model.state_dict(keep_vars=True))
    slots = {}
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            if buffer is not None and key in persistent:
                slots[key] = (module, name)
    return slots


def _write_buffer(name: str, tensor: torch.Tensor, module: nn.Module, attr: str, device: torch.device) -> None:
    buffer = getattr(module, attr)
    _check_shape(name, tensor, tuple(buffer.shape))
    if buffer.is_meta:
        setattr(module, attr, tensor.to(device=device, dtype=buffer.dtype, copy=True))
    else:
        buffer.copy_(tensor)


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise UserError(f"load_weights: {name} has shape {tuple(tensor.shape)}; this model needs {tuple(shape)}")
