"""Which parameters the engine holds, grouped by block, and where each lives in its group's flat buffers.

A group is one block (streamed, or resident on the device) or everything outside the blocks (the
"rest", resident). Inside a group the trainable parameters come first, then the frozen ones: the
optimizer state, gradients and master weights cover the trainable prefix only, the compute copy
covers both.
"""

from dataclasses import dataclass

import torch
from torch import nn

from slidefusion.errors import UserError

REST = -1  # the key of the rest group (blocks are keyed by their index in call order)
Named = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class Entry:
    """Where one parameter lives inside its group's flat buffers."""

    name: str  # the key in model.state_dict()
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    numel: int

    def views(self, flat: torch.Tensor, count: int | None = None) -> list[torch.Tensor]:
        """The first `count` (default: all) parameters as views into `flat` (which may be longer)."""
        return [flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.entries[:count]]


def layout_of(named: Named) -> Layout:
    entries, offset = [], 0
    for name, param in named:
        entries.append(Entry(name, tuple(param.shape), offset, param.numel()))
        offset += param.numel()
    return Layout(tuple(entries), offset)


@dataclass
class GroupSpec:
    """The parameters of one group, by state_dict name, trainable ones first."""

    name: str
    key: int
    prefix: str  # the group's module name in the model ("" for the rest)
    trainable: Named
    frozen: Named

    @property
    def named(self) -> Named:
        return self.trainable + self.frozen

    def local_names(self) -> list[str]:
        """The parameters' names inside the group's module, in layout order."""
        cut = len(self.prefix) + 1 if self.prefix else 0
        return [name[cut:] for name, _ in self.named]


def split_groups(model: nn.Module, blocks: list[nn.Module]) -> tuple[list[GroupSpec], GroupSpec]:
    """The parameters of each block and of the rest, or a UserError for a model the engine cannot
    stream: no blocks, a block outside the model, a parameter shared between groups."""
    if not isinstance(blocks, (list, tuple, nn.ModuleList)) or len(blocks) == 0 or not all(
            isinstance(b, nn.Module) for b in blocks):
        raise UserError(f"blocks must be a non-empty list of the model's blocks in call order, got {_describe(blocks)}")
    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    owner: dict[int, str] = {}  # parameter id -> the block prefix that owns it
    specs = []
    for index, block in enumerate(blocks):
        if id(block) not in module_names:
            raise UserError(f"blocks[{index}] is not a submodule of model; pass the model's own block modules")
        prefix = module_names[id(block)]
        named = []
        for local, param in block.named_parameters():
            if not param.is_floating_point():  # integer parameters travel as buffers do
                continue
            if id(param) in owner:
                raise UserError(f"parameter {prefix}.{local} is shared between {owner[id(param)]} and {prefix}; "
                                "the engine streams each block's own weights, so untie them")
            owner[id(param)] = prefix
            named.append((f"{prefix}.{local}", param))
        specs.append(_spec(f"blocks[{index}]", index, prefix, named))
    return specs, _spec("rest", REST, "", _rest(model, owner))


def _rest(model: nn.Module, owner: dict[int, str]) -> Named:
    rest, seen = [], set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owner:
            if not name.startswith(owner[id(param)] + "."):
                raise UserError(f"parameter {name} is shared between {owner[id(param)]} and the rest of the model; untie it")
        elif id(param) not in seen and param.is_floating_point():
            seen.add(id(param))
            rest.append((name, param))
    return rest


def _spec(name: str, key: int, prefix: str, named: Named) -> GroupSpec:
    return GroupSpec(name, key, prefix, [(n, p) for n, p in named if p.requires_grad],
                     [(n, p) for n, p in named if not p.requires_grad])


def _describe(blocks) -> str:
    kind = type(blocks).__name__
    return f"an empty {kind}" if isinstance(blocks, (list, tuple, nn.ModuleList)) and len(blocks) == 0 else kind
