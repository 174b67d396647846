"""`slidefusion export --checkpoint CKPT --out DIR [--format slidefusion|diffusers|comfyui]`."""

from slidefusion.cli import args as types
from slidefusion.cli import help_text
from slidefusion.core.errors import UserError

FORMATS = ("slidefusion", "diffusers", "comfyui")
EXAMPLES = ["slidefusion export --checkpoint runs/first --out my-model",
            "slidefusion export --checkpoint runs/wan-finetune --out wan-tuned --format diffusers",
            "slidefusion export --checkpoint runs/wan-finetune --out comfy --format comfyui"]


def add_parser(sub) -> None:
    export = sub.add_parser("export", help="write a sampling-only copy of a checkpoint (EMA weights), a diffusers folder "
                                           "or ComfyUI files")
    export.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder (its latest)")
    export.add_argument("--out", required=True, type=types.output_folder,
                        help="destination folder; it must not exist yet unless --force")
    export.add_argument("--format", choices=FORMATS, default="slidefusion",
                        help="slidefusion: config + weights for `generate --checkpoint`; diffusers (a model.pretrained "
                             "run): a pipeline folder, or with lora.rank the LoRA weights for pipe.load_lora_weights; "
                             "comfyui (a Wan model.pretrained run): one file in Wan's original layout, a LoRA for "
                             "models/loras or a transformer for models/diffusion_models")
    export.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                        help="weights dtype (default: float16; diffusers: as the source folder stores them; "
                             "comfyui: float32 for a LoRA, bfloat16 for a full fine-tune)")
    export.add_argument("--max-shard-size", type=types.byte_size, default=None, metavar="SIZE",
                        help="diffusers: largest safetensors shard with its unit, e.g. 5GB (the default) or 500MB")
    export.add_argument("--force", action="store_true", help="replace --out if it is an existing folder")
    help_text.examples(export, EXAMPLES)
    export.set_defaults(func=run)


def run(args) -> None:
    import torch

    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    if args.format == "diffusers":
        from slidefusion.io.export import DEFAULT_SHARD
        from slidefusion.training.finetune.export import export_diffusers

        path, what = export_diffusers(args.checkpoint, args.out, dtype, force=args.force,
                                      max_shard_size=args.max_shard_size or DEFAULT_SHARD)
    elif args.format == "comfyui":
        from slidefusion.training.finetune.export import export_comfyui

        if args.max_shard_size is not None:
            raise UserError("--max-shard-size applies to --format diffusers only (ComfyUI reads one file)")
        path, what = export_comfyui(args.checkpoint, args.out, dtype, force=args.force)
    else:
        from slidefusion.io.checkpoint import export_checkpoint

        if args.max_shard_size is not None:
            raise UserError("--max-shard-size applies to --format diffusers only")
        path, what = export_checkpoint(args.checkpoint, args.out, dtype or torch.float16, force=args.force), "sampling-only"
    size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file()) / 2**20
    print(f"wrote {path} ({what}, {size:.1f} MiB)")
