"""What the planner knows of a model: parameters per block and the widths activations scale with.

Three sources, one record (`ModelShape`): our own presets (built on the meta device and counted),
the published Wan 2.1 transformers, and a diffusers transformer folder's `config.json` (`--model
DIR`, a pipeline folder's `transformer/` too). Wan's parameter count is a formula over its config,
checked against diffusers' `WanTransformer3DModel` in tests/offload/test_offload_planner.py.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from slidefusion.errors import UserError


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


# The published Wan 2.1 text-to-video transformers, as diffusers configures WanTransformer3DModel;
# both take umT5-XXL text (4096 wide, 512 tokens) and latents of a 4x temporal / 8x spatial VAE.
WAN_COMMON = dict(patch_size=[1, 2, 2], attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                  freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=None,
                  added_kv_proj_dim=None, pos_embed_seq_len=None)
WAN_PRESETS = {"wan2.1-1.3b": dict(WAN_COMMON, num_attention_heads=12, ffn_dim=8960, num_layers=30),
               "wan2.1-14b": dict(WAN_COMMON, num_attention_heads=40, ffn_dim=13824, num_layers=40)}
WAN_TEXT_TOKENS = 512
STOCK_QUERY_TILE_PROJECTIONS = 9  # see ModelShape.query_tile_projections
SUPPORTED_CLASSES = ("WanTransformer3DModel",)


def wan_params(cfg: dict) -> tuple[int, int]:
    """(parameters per block, parameters outside the blocks) of a WanTransformer3DModel config."""
    d, f = cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"]
    added, image = cfg.get("added_kv_proj_dim"), cfg.get("image_dim")
    attention = 4 * (d * d + d) + 2 * d  # q, k, v, out with biases; RMS norms of q and k
    block = 2 * attention + (2 * d * f + f + d) + 6 * d  # self, cross, feed-forward, scale-shift table
    block += 2 * d if cfg.get("cross_attn_norm", True) else 0
    block += 2 * (added * d + d) + d if added else 0  # image keys/values of the I2V models
    patch = math.prod(cfg["patch_size"])
    out = cfg.get("out_channels") or cfg["in_channels"]
    rest = cfg["in_channels"] * d * patch + d  # patch embedding (a Conv3d)
    rest += (cfg["freq_dim"] * d + d) + (d * d + d) + (6 * d * d + 6 * d)  # time embedding and projection
    rest += (cfg["text_dim"] * d + d) + (d * d + d)  # text projection
    if image:
        rest += 2 * image + (image * image + image) + (image * d + d) + 2 * d + (cfg.get("pos_embed_seq_len") or 0) * image
    rest += d * out * patch + out * patch + 2 * d  # output projection and scale-shift table
    return block, rest


def wan_shape(cfg: dict, name: str) -> ModelShape:
    block, rest = wan_params(cfg)
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    return ModelShape(name, (block,) * cfg["num_layers"], rest, d, cfg["num_attention_heads"], cfg["ffn_dim"] / d,
                      tuple(cfg["patch_size"]), "flash", WAN_TEXT_TOKENS, query_tile_projections=STOCK_QUERY_TILE_PROJECTIONS)


def shape_of_config(config, name: str = "") -> ModelShape:
    """The shape of one of our `ModelConfig`s, counted on a model built on the meta device."""
    from slidefusion.models import build_model

    model = build_model(config, "meta")
    blocks = tuple(sum(p.numel() for p in block.parameters()) for block in model.blocks)
    attention = config.attention if config.attention in ("dense", "window", "slide") else "dense"
    return ModelShape(name or config.arch, blocks, sum(p.numel() for p in model.parameters()) - sum(blocks), config.hidden,
                      config.heads, config.mlp_ratio, tuple(config.patch_size), attention)


def model_shape(model: str) -> ModelShape:
    """`--model`: one of our presets, a Wan 2.1 preset, or a diffusers transformer folder."""
    from slidefusion.models import PRESETS, preset

    if model in WAN_PRESETS:
        return wan_shape(WAN_PRESETS[model], model)
    if Path(model).is_dir():
        return _folder_shape(Path(model))
    if model not in PRESETS:
        raise UserError(f"--model={model!r} is neither a preset nor a folder; valid presets: "
                        f"{', '.join([*WAN_PRESETS, *PRESETS])}, or a diffusers transformer folder")
    return shape_of_config(preset(model), model)


def _folder_shape(folder: Path) -> ModelShape:
    path = next((p for p in (folder / "config.json", folder / "transformer" / "config.json") if p.is_file()), None)
    if path is None:
        raise UserError(f"--model={str(folder)!r} has no config.json (nor transformer/config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"--model: {path} is not readable JSON ({error})") from None
    kind = cfg.get("_class_name")
    if kind not in SUPPORTED_CLASSES:
        raise UserError(f"--model: {path} describes {kind!r}; the planner supports {', '.join(SUPPORTED_CLASSES)}")
    _check_folder_config(path, cfg)
    defaults = dict(WAN_PRESETS["wan2.1-14b"], rope_max_seq_len=1024)  # diffusers' own defaults for missing keys
    try:
        return wan_shape({**defaults, **{k: v for k, v in cfg.items() if not k.startswith("_")}}, str(folder))
    except (TypeError, KeyError) as error:
        raise UserError(f"--model: {path} has a malformed WanTransformer3DModel config ({error})") from None


def _check_folder_config(path: Path, cfg: dict) -> None:
    """The sizes in `cfg` as the trainer checks them before building (a count of heads >= 1, ...) and,
    where the folder holds weights, the parameters they imply against those weights: a plan of a
    model that cannot be built, or of another model than its weights, would be nonsense."""
    import diffusers

    from slidefusion.pretrained.config_check import check_size, check_transformer_config
    from slidefusion.pretrained.folder import WEIGHTS, WEIGHTS_INDEX, weight_entries

    cls = getattr(diffusers, cfg["_class_name"])
    check_transformer_config(cls, cfg, f"--model: {path}")
    if (path.parent / WEIGHTS).is_file() or (path.parent / WEIGHTS_INDEX).is_file():
        check_size(cls, {k: v for k, v in cfg.items() if not k.startswith("_")}, weight_entries(path.parent),
                   f"--model: {path}")
