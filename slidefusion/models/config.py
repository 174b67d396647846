"""Model configuration: one typed dataclass, validated when built, and named presets."""

from dataclasses import asdict, dataclass, field, fields

from slidefusion.core.errors import UserError, check, choose, unknown_value

# The architectures' names, the one list: models/dit.py maps each to its class in this order.
ARCHITECTURES = ("dit3d", "stdit")
# Far beyond any real model (the 105 B preset is 8192 wide, 71 deep), and small enough that even
# building the model on the meta device (for planning and memory estimates) stays instant.
LIMITS = {"in_channels": 1024, "hidden": 65536, "depth": 1024, "heads": 1024, "text_dim": 65536}


@dataclass
class ModelConfig:
    """Shape of a video DiT.

    `depth` counts blocks for `dit3d`, and (spatial, temporal) block pairs for `stdit`.
    `attention` names the self-attention operator from the registry; for `stdit` it is used inside
    each frame, and time always uses dense attention.
    `pooled_text` adds the masked mean of the text states, through an MLP, to the timestep
    embedding that drives every adaLN (SD3's and Flux's pooled text next to cross-attention), so
    each token sees the whole prompt directly; off by default, which is the model without it.
    """

    arch: str = "dit3d"
    in_channels: int = 3
    patch_size: tuple[int, int, int] = (1, 2, 2)
    hidden: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: float = 4.0
    text_dim: int = 384
    attention: str = "dense"
    attention_options: dict = field(default_factory=dict)
    pooled_text: bool = False

    def __post_init__(self):
        self.patch_size = tuple(self.patch_size)
        choose(self.arch, ARCHITECTURES, "model.arch")
        check(
            len(self.patch_size) == 3 and all(isinstance(p, int) and 1 <= p <= 64 for p in self.patch_size),
            f"model.patch_size={self.patch_size} must be three ints in 1..64 (pt, ph, pw)",
        )
        for name, most in LIMITS.items():
            value = getattr(self, name)
            check(isinstance(value, int) and 1 <= value <= most, f"model.{name}={value!r} must be an int in 1..{most}")
        check(isinstance(self.pooled_text, bool), f"model.pooled_text={self.pooled_text!r} must be true or false")
        check(0 < self.mlp_ratio <= 64, f"model.mlp_ratio={self.mlp_ratio} must be in (0, 64]")
        check(
            self.hidden % self.heads == 0,
            f"model.hidden={self.hidden} must be divisible by model.heads={self.heads}",
        )
        check(self.hidden % 2 == 0, f"model.hidden={self.hidden} must be even (sin-cos positions)")

    @property
    def out_channels(self) -> int:
        return self.in_channels

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise UserError(f"unknown model config key {unknown[0]!r}; valid: {', '.join(sorted(valid))}")
        return cls(**data)


# Paper-scale sizes follow the DiT width/depth ladder; parameter counts are for text_dim=4096
# (a T5-XXL-sized text encoder) and are checked in the tests: ~1 B, ~28 B, ~105 B.
PRESETS: dict[str, dict] = {
    "dit3d-tiny": dict(arch="dit3d", hidden=32, depth=2, heads=2, patch_size=(1, 2, 2)),
    "stdit-tiny": dict(arch="stdit", hidden=32, depth=2, heads=2, patch_size=(1, 2, 2)),
    "dit3d-small": dict(arch="dit3d", hidden=192, depth=6, heads=6, patch_size=(1, 4, 4)),
    "stdit-small": dict(arch="stdit", hidden=192, depth=3, heads=6, patch_size=(1, 4, 4)),
    "dit3d-1b": dict(arch="dit3d", in_channels=16, hidden=1280, depth=28, heads=20, text_dim=4096),
    "stdit-1b": dict(arch="stdit", in_channels=16, hidden=1280, depth=14, heads=20, text_dim=4096),
    "dit3d-28b": dict(arch="dit3d", in_channels=16, hidden=5120, depth=48, heads=40, text_dim=4096),
    "dit3d-105b": dict(arch="dit3d", in_channels=16, hidden=8192, depth=71, heads=64, text_dim=4096),
}


def preset(name: str, **overrides) -> ModelConfig:
    """The config registered as `name`, with `overrides` applied on top."""
    if name not in PRESETS:
        raise unknown_value("model.preset", name, PRESETS)
    return ModelConfig.from_dict({**PRESETS[name], **overrides})
