"""`slidefusion cache CONFIG [key=value ...]`: encode a fine-tune's latents and text states, then stop.

A later `slidefusion train` of the same config (same data, same folder's VAE and text encoders)
finds every cache file and encodes nothing (`training.finetune.caches`: files keyed by content).
"""

from slidefusion.cli import help_text

EXAMPLES = [
    "slidefusion cache configs/wan-finetune.yaml model.pretrained=Wan2.1-T2V-1.3B-Diffusers data.root=my-videos",
    "slidefusion cache configs/wan-finetune.yaml model.pretrained=Wan2.1-T2V-1.3B-Diffusers data.root=my-videos "
    "run.device=cuda --quiet",
]


def add_parser(sub) -> None:
    cache = sub.add_parser("cache", help="encode a fine-tune's latents and text states, then stop", intermixed=True)
    cache.add_argument("config", help="YAML config of the run, e.g. configs/wan-finetune.yaml")
    cache.add_argument("overrides", nargs="*", help="dotted overrides, as for train")
    cache.add_argument("--quiet", action="store_true", help="no progress bar or tables")
    help_text.examples(cache, EXAMPLES)
    cache.set_defaults(func=run)


def run(args) -> None:
    from slidefusion.training import Trainer, load_config
    from slidefusion.training.trainer import cache_only

    trainer = Trainer(load_config(args.config, args.overrides), quiet=args.quiet)
    print(f"caches ready under {cache_only(trainer)}; `slidefusion train` with the same data and folder reuses them")
