"""What the parallel engine knows about a model, as data: one record per model class and one access
record per attention class. Nothing else in `slidefusion.parallel` looks at a model's class.

`OwnModel` answers for DiT3D and STDiT under the method names of the adapter contract (issue 10:
`adapter_for(model)` -> family, blocks, block_kinds, attention_sites, token_grid). When
`slidefusion.adapters` lands, `record_for` returns `adapter_for(model)` and the engine is unchanged.
`AttentionAccess` says how to reach one attention class's q/k/v projection, its operator and its
output projection - what head-parallel attention needs and the adapter contract does not say.
Phase B adds diffusers' `WanAttention` here (`to_q/to_k/to_v`, `norm_q/norm_k` over all heads,
rotary from the call): its `project` is token-wise, so token-chunked slicing fits it unchanged.
"""

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from slidefusion.attention import DenseAttention3d, GridAttention, NeighborhoodAttention3d, WindowAttention3d
from slidefusion.errors import UserError
from slidefusion.models import DiT3D, STDiT


@dataclass(frozen=True)
class AttentionSite:
    """A self-attention over video tokens (the adapter contract's record): block index, qualified
    module name in the model, the block's kind, and whether text tokens share its softmax."""

    block: int
    path: str
    kind: str
    joint: bool = False


@dataclass(frozen=True)
class AttentionAccess:
    """How head-parallel attention reaches one attention class.

    heads(m) -> int. project(m, x, args, kwargs, span): this rank's tokens x (G, n, C) -> qkv
    (G, n, 3, heads, D), every per-token step included (projection, QK norm, rotary); args/kwargs are
    the rest of the module's call (e.g. Wan's rotary_emb) and span = (start, n) says which of this
    rank's tokens x holds, so a token-shaped argument can be cut to match. attend(m, q, k, v): the class's own operator
    on grid-shaped (G, T, H, W, h, D) tensors, any subset of heads. output(m, o): (G, n, heads, D) ->
    (G, n, C). dense: the operator is softmax over every key at scale D^-0.5, so it may be computed in
    key chunks and merged by log-sum-exp (sliced Ulysses)."""

    heads: Callable[[nn.Module], int]
    project: Callable[..., Tensor]
    attend: Callable[..., Tensor]
    output: Callable[[nn.Module, Tensor], Tensor]
    dense: bool


def _grid_project(m: GridAttention, x: Tensor, args=(), kwargs=None, span=None) -> Tensor:
    g, n, c = x.shape
    return m.qkv(x).view(g, n, 3, m.heads, c // m.heads)  # (G, n, 3, heads, D)


def _grid_access(dense: bool) -> AttentionAccess:
    return AttentionAccess(heads=lambda m: m.heads, project=_grid_project, attend=lambda m, q, k, v: m.attend(q, k, v),
                           output=lambda m, o: m.proj(o.flatten(-2)), dense=dense)


# Slide attention is absent on purpose: its offset network reads every head's channels at once, so it
# cannot run on a subset of heads, and head-parallel attention would change its result.
ACCESS: dict[type, AttentionAccess] = {
    DenseAttention3d: _grid_access(dense=True),
    WindowAttention3d: _grid_access(dense=False),
    NeighborhoodAttention3d: _grid_access(dense=False),
}


def access_for(module: nn.Module) -> AttentionAccess:
    for cls in type(module).__mro__:
        if cls in ACCESS:
            return ACCESS[cls]
    raise UserError(f"head-parallel attention (ulysses) cannot split {type(module).__name__} by heads; "
                    f"valid operators: {', '.join(c.__name__ for c in ACCESS)}")


@dataclass(frozen=True)
class OwnModel:
    """The record of one of our own architectures; `paths` maps a block kind to its attention's path;
    `output` is the token-wise module after the blocks whose output the engine gathers (as diffusers'
    context-parallel plans gather at `proj_out`)."""

    family: str
    paths: dict
    output: str = "final"

    def blocks(self, model) -> list[nn.Module]:
        return list(model.blocks)

    def block_kinds(self, model) -> list[str]:
        return [block.kind for block in model.blocks]

    def attention_sites(self, model) -> list[AttentionSite]:
        return [AttentionSite(i, f"blocks.{i}.{self.paths[block.kind]}", block.kind)
                for i, block in enumerate(model.blocks)]

    def token_grid(self, model, latent_shape) -> tuple[int, int, int]:
        return model.token_grid(latent_shape)


RECORDS: dict[type, OwnModel] = {
    DiT3D: OwnModel("dit3d", {"full": "attn"}),
    STDiT: OwnModel("stdit", {"spatial": "attn.inner", "temporal": "attn.inner"}),
}


def record_for(model) -> OwnModel:
    """The record of `model`'s class, or a UserError naming the supported classes."""
    record = RECORDS.get(type(model))
    if record is None:
        raise UserError(f"model class {type(model).__name__} has no parallel plan; "
                        f"supported: {', '.join(c.__name__ for c in RECORDS)}")
    return record
