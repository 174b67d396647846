"""What the planner knows of a model: parameters per block and the widths activations scale with.

Three sources, one record (`ModelShape`), every count made on a model built on the meta device (no
parameter formula to keep in step with a class): our own presets, the published diffusers models the
families list (`ModelAdapter.presets`, e.g. Wan 2.1 1.3B and 14B), and a diffusers transformer
folder's `config.json` (`--model DIR`, a pipeline folder's `transformer/` too).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slidefusion.attention.registry import memory_model
from slidefusion.core.errors import UserError
from slidefusion.families import ModelAdapter, adapter_for_class, adapters_with


@dataclass(frozen=True)
class ModelShape:
    name: str
    block_params: tuple[int, ...]  # per block, in call order
    rest_params: int  # outside the blocks
    hidden: int
    heads: int
    mlp_ratio: float  # MLP width / hidden
    patch: tuple[int, int, int]
    attention: str  # the model's own self-attention: dense | window | slide | flash
    text_tokens: int = 0  # cross-attention keys per sample (0: not counted)
    tileable: bool = True  # blocks run tile by tile (`offload.tile`): a declared halo, or dense query tiles
    # d x d projections per token a step computes again when dense attention is query-tiled: ours
    # compute keys/values and queries apart (2, in backward); a stock diffusers processor makes all
    # three each time (9: 3 in forward, 6 in backward; see offload.token_tiles)
    query_tile_projections: int = 2

    @property
    def params(self) -> int:
        return sum(self.block_params) + self.rest_params


STOCK_QUERY_TILE_PROJECTIONS = 9  # see ModelShape.query_tile_projections
DIFFUSERS_ATTENTION = "flash"  # the stock processors' fused softmax attention: no scores are kept


def _plannable() -> str:
    return ", ".join(a.class_name for a in adapters_with("widths"))


def meta_transformer(adapter: ModelAdapter, config: dict) -> nn.Module:
    """The family's diffusers transformer built from `config` on the meta device (nothing allocated;
    diffusers fills the keys the config lacks with the class's defaults), or a UserError."""
    import diffusers

    cls = getattr(diffusers, adapter.class_name)
    try:
        with torch.device("meta"):
            return cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    except (TypeError, ValueError, KeyError, IndexError) as error:
        raise UserError(f"--model: a malformed {adapter.class_name} config ({type(error).__name__}: {error})") from None


def shape_of_model(model: nn.Module, adapter: ModelAdapter, name: str = "",
                   attention: str = DIFFUSERS_ATTENTION) -> ModelShape:
    """The shape of a diffusers transformer (built on meta is enough), counted block by block."""
    if adapter.widths is None:
        raise UserError(f"--model: the planner cannot size {adapter.class_name} (its activation widths are not "
                        f"declared); valid: {_plannable()}")
    from slidefusion.offload.tiling.tile_runner import tiling_refusal

    blocks = tuple(sum(p.numel() for p in b.parameters()) for b in adapter.blocks(model))
    hidden, heads, ratio = adapter.widths(model)
    rest = sum(p.numel() for p in model.parameters()) - sum(blocks)
    return ModelShape(name or adapter.class_name, blocks, rest, hidden, heads, ratio, adapter.patch_size(model),
                      attention, adapter.text.max_length, tileable=tiling_refusal(model) is None,
                      query_tile_projections=STOCK_QUERY_TILE_PROJECTIONS)


def published_shape(name: str) -> ModelShape | None:
    """The shape of a published model a family lists by `name`, or None."""
    for adapter in adapters_with("presets"):
        if name in adapter.presets:
            return shape_of_model(meta_transformer(adapter, dict(adapter.presets[name])), adapter, name)
    return None


def shape_of_config(config, name: str = "") -> ModelShape:
    """The shape of one of our `ModelConfig`s, counted on a model built on the meta device."""
    from slidefusion.models import build_model

    model = build_model(config, "meta")
    blocks = tuple(sum(p.numel() for p in block.parameters()) for block in model.blocks)
    attention = memory_model(config.attention) or "dense"  # an operator the planner does not model: the worst case
    return ModelShape(name or config.arch, blocks, sum(p.numel() for p in model.parameters()) - sum(blocks), config.hidden,
                      config.heads, config.mlp_ratio, tuple(config.patch_size), attention)


def model_shape(model: str) -> ModelShape:
    """`--model`: one of our presets, a published diffusers model a family lists, or a diffusers
    transformer folder."""
    from slidefusion.models import PRESETS, preset

    published = published_shape(model)
    if published is not None:
        return published
    if Path(model).is_dir():
        return _folder_shape(Path(model))
    if model not in PRESETS:
        names = [*(n for a in adapters_with("presets") for n in a.presets), *PRESETS]
        raise UserError(f"--model={model!r} is neither a preset nor a folder; valid presets: "
                        f"{', '.join(names)}, or a diffusers transformer folder")
    return shape_of_config(preset(model), model)


def _folder_shape(folder: Path) -> ModelShape:
    path = next((p for p in (folder / "config.json", folder / "transformer" / "config.json") if p.is_file()), None)
    if path is None:
        raise UserError(f"--model={str(folder)!r} has no config.json (nor transformer/config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"--model: {path} is not readable JSON ({error})") from None
    kind = cfg.get("_class_name") if isinstance(cfg, dict) else None
    plannable = {a.class_name for a in adapters_with("widths")}
    if kind not in plannable:
        raise UserError(f"--model: {path} describes {kind!r}; the planner supports {_plannable()}")
    adapter = adapter_for_class(kind)
    return shape_of_model(meta_transformer(adapter, cfg), adapter, str(folder))
