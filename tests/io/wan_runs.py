"""Short fine-tunes of tiny Wan folders through the CLI, shared by the io tests."""

from pathlib import Path

from slidefusion.cli import main
from slidefusion.testing.pipelines import PIXELS

# Wan's original names for the parts of a text-to-video WanModel, written from the Wan repository's
# module tree (wan/modules/model.py), not from our own tables: what ComfyUI's model holds.
ORIGINAL_TOP = ("patch_embedding.weight", "patch_embedding.bias", "text_embedding.0.weight", "text_embedding.0.bias",
                "text_embedding.2.weight", "text_embedding.2.bias", "time_embedding.0.weight", "time_embedding.0.bias",
                "time_embedding.2.weight", "time_embedding.2.bias", "time_projection.1.weight",
                "time_projection.1.bias", "head.head.weight", "head.head.bias", "head.modulation")
ORIGINAL_BLOCK = tuple(f"{attn}.{p}.{leaf}" for attn in ("self_attn", "cross_attn") for p in "qkvo"
                       for leaf in ("weight", "bias")) + (
    "self_attn.norm_q.weight", "self_attn.norm_k.weight", "cross_attn.norm_q.weight", "cross_attn.norm_k.weight",
    "norm3.weight", "norm3.bias", "ffn.0.weight", "ffn.0.bias", "ffn.2.weight", "ffn.2.bias", "modulation")
# diffusers module -> Wan module, for the LoRA targets the tests train
WAN_MODULE = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
              "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
              "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
              "ffn.net.2": "ffn.2", "condition_embedder.time_proj": "time_projection.1", "proj_out": "head.head"}


def original_keys(layers: int) -> set[str]:
    return set(ORIGINAL_TOP) | {f"blocks.{i}.{name}" for i in range(layers) for name in ORIGINAL_BLOCK}


TI2V_PIXELS = (5, 32, 64)  # Wan 2.2's VAE compresses space 16x, its patch is 2


def train(folder: Path, out: Path, name: str, *extra: str, steps: int = 2, pixels=PIXELS["wan"]) -> Path:
    """A `steps`-step fine-tune of `folder` (a tiny Wan pipeline) on the shapes; returns the run folder."""
    frames, height, width = pixels
    args = ["train", "configs/wan-finetune.yaml", f"model.pretrained={folder}", "data.kind=shapes",
            "data.num_samples=2", f"data.frames={frames}", f"data.height={height}", f"data.width={width}",
            "run.device=cpu", f"run.steps={steps}", "run.batch_size=2", f"run.output_dir={out}", f"run.name={name}",
            "optim.lr=1e-2", "optim.warmup_steps=0", "--quiet", *extra]
    assert main(args) == 0
    return out / name
