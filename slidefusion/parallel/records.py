"""What the parallel engine knows about a model beyond the adapter contract, as data.

`record_for(model)` is the single place that finds a model's facts: `adapter_for(model)` (blocks in
call order, their kinds, the attention sites, the token grid of a call), restricted to the families
that have a `ModelAccess` here. Nothing else in `slidefusion.parallel` looks at a model's class.

`ModelAccess` (one per family) says what the adapter contract does not: which module is the
token-wise output module whose output is gathered, how a block's token tensor is laid out, which
call arguments are per sample (CFG-parallel halves them), which are per token (sharded with the
tokens: Wan's rotary table, Wan 2.2's per-token timesteps), which block arguments are per row of the
block's token tensor (Latte's per-frame text and timestep rows), and whether the model hands each
block's output unchanged to the next (then a switch may span two blocks).
`AttentionAccess` (one per attention class) says how to reach its q/k/v projection, operator and
output projection - what head-parallel attention needs.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slidefusion.adapters import AttentionSite, ModelAdapter, adapter_for
from slidefusion.attention import DenseAttention3d, GridAttention, NeighborhoodAttention3d, WindowAttention3d
from slidefusion.errors import UserError, check

__all__ = ["ACCESS", "MODEL_ACCESS", "AttentionAccess", "AttentionSite", "ModelAccess", "access_for", "model_access",
           "record_for"]


@dataclass(frozen=True)
class AttentionAccess:
    """How head-parallel attention reaches one attention class.

    heads(m) -> int. project(m, x, args, kwargs, span): this rank's tokens x (G, n, C) -> qkv
    (G, n, 3, heads, D), every per-token step included (projection, QK norm, rotary); args/kwargs are
    the rest of the module's call (e.g. Wan's rotary_emb, already cut to this rank's tokens) and
    span = (start, n) says which of this rank's tokens x holds, so a token-shaped argument can be cut
    to match. attend(m, q, k, v): the class's own operator on grid-shaped (G, T, H, W, h, D) tensors,
    any subset of heads. output(m, o): (G, n, heads, D) -> (G, n, C). dense: the operator is softmax
    over every key at scale D^-0.5, so it may be computed in key chunks merged by log-sum-exp (sliced
    Ulysses). check(m): a UserError for a configuration of the class that the above does not cover."""

    heads: Callable[[nn.Module], int]
    project: Callable[..., Tensor]
    attend: Callable[..., Tensor]
    output: Callable[[nn.Module, Tensor], Tensor]
    dense: bool
    check: Callable[[nn.Module], None] = lambda m: None


# ---------------------------------------------------------------- our grid operators
def _grid_project(m: GridAttention, x: Tensor, args=(), kwargs=None, span=None) -> Tensor:
    g, n, c = x.shape
    return m.qkv(x).view(g, n, 3, m.heads, c // m.heads)  # (G, n, 3, heads, D)


def _grid_access(dense: bool) -> AttentionAccess:
    return AttentionAccess(heads=lambda m: m.heads, project=_grid_project, attend=lambda m, q, k, v: m.attend(q, k, v),
                           output=lambda m, o: m.proj(o.flatten(-2)), dense=dense)


# ---------------------------------------------------------------- diffusers' Attention and WanAttention
def _sdpa(m, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Softmax attention over every token of a grid (G, T, H, W, h, D), as the diffusers processors
    compute it (F.scaled_dot_product_attention at its default scale D^-0.5)."""
    shape = q.shape
    q, k, v = (t.flatten(1, 3).transpose(1, 2) for t in (q, k, v))  # (G, h, N, D)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(shape)


def _output(m, o: Tensor) -> Tensor:
    return m.to_out[1](m.to_out[0](o.flatten(-2)))  # projection, then the (inactive) dropout


def _check_diffusers_attention(m) -> None:
    """diffusers' `Attention` under AttnProcessor2_0, as Latte's self-attention uses it."""
    processor = type(m.processor).__name__
    check(processor == "AttnProcessor2_0",
          f"ulysses cannot split a diffusers Attention run by {processor}; valid: AttnProcessor2_0 (the default)")
    extras = {"spatial_norm": m.spatial_norm is not None, "group_norm": m.group_norm is not None,
              "residual_connection": m.residual_connection, "rescale_output_factor": m.rescale_output_factor != 1.0,
              "only_cross_attention": m.only_cross_attention}
    unsupported = [name for name, present in extras.items() if present]
    if unsupported:
        raise UserError(f"ulysses cannot split this diffusers Attention: {unsupported[0]} is not supported "
                        "(valid: a plain self-attention with optional per-head q/k norms)")


def _attention_project(m, x: Tensor, args=(), kwargs=None, span=None) -> Tensor:
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None) if kwargs is not None else None
    check(mask is None, "ulysses cannot split a self-attention that is given an attention mask")
    q, k, v = (p(x).unflatten(-1, (m.heads, -1)) for p in (m.to_q, m.to_k, m.to_v))  # (G, n, heads, D)
    q = q if m.norm_q is None else m.norm_q(q)  # the processor's norms act on D, per head and token
    k = k if m.norm_k is None else m.norm_k(k)
    return torch.stack((q, k, v), dim=2)


def _check_wan_attention(m) -> None:
    processor = type(m.processor).__name__
    check(processor == "WanAttnProcessor",
          f"ulysses cannot split a WanAttention run by {processor}; valid: WanAttnProcessor (the default)")
    check(not m.is_cross_attention and m.add_k_proj is None, "ulysses splits Wan's self-attention only")


def _rotate(h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Wan's rotary embedding on interleaved pairs (WanAttnProcessor's apply_rotary_emb)."""
    x1, x2 = h.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(h)
    out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
    out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
    return out.type_as(h)


def _wan_project(m, x: Tensor, args=(), kwargs=None, span=None) -> Tensor:
    """x (G, n, C), this rank's tokens [start, start + n) -> (G, n, 3, heads, D). Wan's RMSNorm spans
    every head of a token, so it is per token; the rotary table (1, N_r, 1, D) is this rank's and is
    cut to the chunk."""
    kwargs = kwargs or {}
    rotary = kwargs.get("rotary_emb", args[2] if len(args) > 2 else None)
    if m.fused_projections:
        q, k, v = m.to_qkv(x).chunk(3, dim=-1)
    else:
        q, k, v = m.to_q(x), m.to_k(x), m.to_v(x)
    q, k, v = (t.unflatten(2, (m.heads, -1)) for t in (m.norm_q(q), m.norm_k(k), v))
    if rotary is not None:
        cos, sin = (t.narrow(1, *span) for t in rotary)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return torch.stack((q, k, v), dim=2)


DIFFUSERS_ATTENTION = AttentionAccess(heads=lambda m: m.heads, project=_attention_project, attend=_sdpa,
                                      output=_output, dense=True, check=_check_diffusers_attention)
WAN_ATTENTION = AttentionAccess(heads=lambda m: m.heads, project=_wan_project, attend=_sdpa, output=_output,
                                dense=True, check=_check_wan_attention)

# Keyed by class (ours) or by "module.ClassName" (diffusers, imported only when a model uses it).
# Slide attention is absent on purpose: its offset network reads every head's channels at once, so
# it cannot run on a subset of heads, and head-parallel attention would change its result.
ACCESS: dict[type | str, AttentionAccess] = {
    DenseAttention3d: _grid_access(dense=True),
    WindowAttention3d: _grid_access(dense=False),
    NeighborhoodAttention3d: _grid_access(dense=False),
    "diffusers.models.attention_processor.Attention": DIFFUSERS_ATTENTION,
    "diffusers.models.transformers.transformer_wan.WanAttention": WAN_ATTENTION,
}


def access_for(module: nn.Module) -> AttentionAccess:
    """The access record of `module`'s class (or a base class's), after its configuration check."""
    for cls in type(module).__mro__:
        access = ACCESS.get(cls) or ACCESS.get(f"{cls.__module__}.{cls.__name__}")
        if access is not None:
            access.check(module)
            return access
    names = [key if isinstance(key, str) else key.__name__ for key in ACCESS]
    raise UserError(f"head-parallel attention (ulysses) cannot split {type(module).__name__} by heads; "
                    f"valid operators: {', '.join(n.rsplit('.', 1)[-1] for n in names)}")


# ---------------------------------------------------------------- per family
GRID, ROWS = "grid", "rows"


@dataclass(frozen=True)
class ModelAccess:
    """What the parallel engine needs of one family beyond its adapter.

    output: path of the token-wise module after the blocks; it runs on the shard and its output is
        gathered (our `final`, diffusers' `proj_out`: 16-64 values per token instead of the width).
    layout: how a block's token tensor is laid out - GRID: (B, T, H, W, C) (ours; a shard of
        positions is (B, T, S_r, 1, C)); ROWS: (B*T, S, C) into spatial and full blocks (a full
        block's is (B, N, C)), (B*S, T, C) into temporal ones (Latte, Wan).
    batched: the model call's per-sample arguments (CFG-parallel gives each half to one group).
    token_args: per-token call arguments -> their token dim (sharded with the tokens when present).
    token_outputs: module path -> token dim of its outputs (sharded as the module returns them).
    rows: per block kind, the block arguments with one row per row of its token tensor (cut with
        the rows a block computes).
    chained: the forward passes each block's output unchanged to the next block, so a switch
        between two layouts may start in one block's hook and end in the next one's.
    """

    output: str
    layout: str
    batched: tuple[str, ...]
    token_args: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    token_outputs: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    rows: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    chained: bool = False


_OURS = ModelAccess(output="final", layout=GRID, batched=("x", "t", "context", "context_mask"), chained=True)
MODEL_ACCESS: dict[str, ModelAccess] = {
    "dit3d": _OURS,
    "stdit": _OURS,
    "wan": ModelAccess(
        output="proj_out", layout=ROWS,
        batched=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
        token_args=MappingProxyType({"timestep": 1}),  # Wan 2.2 TI2V: (B, N), one timestep per token
        token_outputs=MappingProxyType({"rope": 1})),  # (cos, sin), each (1, N, 1, D)
    "latte": ModelAccess(
        output="proj_out", layout=ROWS,
        batched=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"),
        # Latte repeats the text states and timestep embedding per frame (spatial) or position (temporal)
        rows=MappingProxyType({"spatial": ("encoder_hidden_states", "timestep"), "temporal": ("timestep",)})),
}


def model_access(adapter: ModelAdapter) -> ModelAccess:
    return MODEL_ACCESS[adapter.family]


def _supported() -> str:
    from slidefusion.adapters import ADAPTERS

    return ", ".join(a.class_name for a in ADAPTERS.values() if a.family in MODEL_ACCESS)


def record_for(model) -> ModelAdapter:
    """The adapter of `model`'s class if the parallel engine has a plan for it, else a UserError
    naming the supported classes."""
    try:
        adapter = adapter_for(model)
    except UserError:
        adapter = None
    if adapter is None or adapter.family not in MODEL_ACCESS:
        raise UserError(f"model class {type(model).__name__} has no parallel plan; supported: {_supported()}")
    return adapter
