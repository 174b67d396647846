"""Host-resident training state: per group of parameters, flat contiguous buffers.

A group is one block of the `ModuleList` (streamed) or everything outside the blocks (resident on
the device). For each group the host holds, allocated once:

    master      fp32           the weights AdamW updates
    exp_avg     fp32           AdamW first moment
    exp_avg_sq  fp32           AdamW second moment
    compute     compute dtype  the copy that is uploaded (written by the optimizer's pass)

That is 4 + 4 + 4 + 2 = 14 bytes per parameter for bf16 compute. On CUDA the buffers are pinned
so uploads are true DMA. The model's own `nn.Parameter`s are re-pointed at views of `master`, so
`model.state_dict()` reads the live fp32 weights and no second host copy exists.
"""

from dataclasses import dataclass

import torch
from torch import nn

from slidefusion.errors import UserError


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

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter as a view into `flat` (which may be longer than this layout)."""
        return [flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.entries]


def layout_of(named: list[tuple[str, nn.Parameter]]) -> Layout:
    entries, offset = [], 0
    for name, param in named:
        entries.append(Entry(name, tuple(param.shape), offset, param.numel()))
        offset += param.numel()
    return Layout(tuple(entries), offset)


class GroupState:
    """The flat host buffers of one group, and the model parameters that view them."""

    def __init__(self, name: str, named: list[tuple[str, nn.Parameter]], compute_dtype: torch.dtype, pin: bool):
        self.name = name
        self.layout = layout_of(named)
        self.params = [p for _, p in named]
        n = self.layout.numel
        empty = lambda dtype: torch.empty(n, dtype=dtype, pin_memory=pin)
        self.master, self.exp_avg, self.exp_avg_sq = empty(torch.float32), empty(torch.float32), empty(torch.float32)
        self.compute = empty(compute_dtype)
        with torch.no_grad():
            for view, param in zip(self.layout.views(self.master), self.params):
                view.copy_(param.detach().float())
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.bind_master()
        self.refresh_compute()

    @property
    def numel(self) -> int:
        return self.layout.numel

    def bind_master(self) -> None:
        """Point the model's parameters at their fp32 master views (frees their own storage)."""
        for view, param in zip(self.layout.views(self.master), self.params):
            param.data = view
        self.seen_versions = self.versions()

    def bind(self, flat: torch.Tensor) -> None:
        """Point the model's parameters at views of `flat` (a device buffer) for a step."""
        for view, param in zip(self.layout.views(flat), self.params):
            param.data = view

    def versions(self) -> int:
        """Sum of the parameters' version counters: it moves when anyone writes through them
        (load_state_dict, init_from), never when the optimizer writes the flat buffers."""
        return sum(p._version for p in self.params)

    def written_outside(self) -> bool:
        return self.versions() != self.seen_versions

    def refresh_compute(self) -> None:
        self.compute.copy_(self.master)
        self.seen_versions = self.versions()

    def host_bytes(self) -> int:
        return self.numel * (12 + self.compute.element_size())


def split_groups(model: nn.Module, blocks: nn.ModuleList) -> tuple[list[list[tuple[str, nn.Parameter]]], list[tuple[str, nn.Parameter]]]:
    """The named parameters of each block and of the rest (state_dict names), or a UserError for
    a model the engine cannot stream: no blocks, blocks outside the model, shared or frozen
    block parameters."""
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise UserError(f"blocks must be a non-empty nn.ModuleList of the model's blocks, got "
                        f"{type(blocks).__name__}{' of length 0' if isinstance(blocks, nn.ModuleList) else ''}")
    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    owner: dict[int, str] = {}  # parameter id -> the block prefix that owns it
    per_block = []
    for index, block in enumerate(blocks):
        if id(block) not in module_names:
            raise UserError(f"blocks[{index}] is not a submodule of model; pass blocks=model.<its ModuleList>")
        prefix = module_names[id(block)]
        named = []
        for local, param in block.named_parameters():
            if id(param) in owner:
                raise UserError(f"parameter {prefix}.{local} is shared between {owner[id(param)]} and {prefix}; "
                                "the engine streams each block's own weights, so untie them")
            if not param.requires_grad:
                raise UserError(f"parameter {prefix}.{local} is frozen; the engine trains every block parameter "
                                "(freeze whole modules outside the blocks instead)")
            owner[id(param)] = prefix
            named.append((f"{prefix}.{local}", param))
        per_block.append(named)
    rest, seen = [], set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owner:
            if not name.startswith(owner[id(param)] + "."):
                raise UserError(f"parameter {name} is shared between {owner[id(param)]} and the rest of the model; untie it")
        elif param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            rest.append((name, param))
    return per_block, rest
