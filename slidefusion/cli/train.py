"""`slidefusion train CONFIG [key=value ...] [--offload] [--device D] [--resume latest|DIR | --init-from CKPT]`."""

from slidefusion.cli import args as types
from slidefusion.errors import UserError


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train from a YAML config with key=value overrides", intermixed=True)
    train.add_argument("config", help="YAML config, e.g. configs/shapes-small.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-4 run.steps=200")
    train.add_argument("--resume", metavar="latest|DIR", help="continue a run exactly from a checkpoint")
    train.add_argument("--init-from", metavar="CHECKPOINT", help="start a new run from matching pretrained weights")
    train.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    train.add_argument("--offload", action="store_true",
                       help="train with the offload engine: weights and AdamW state in host memory (offload.enabled=true)")
    train.add_argument("--device", type=types.device, help="training device, e.g. cuda or cpu (run.device=...)")
    train.set_defaults(func=run)


def overrides(args) -> list[str]:
    """The config overrides: the explicit key=value ones, then those the flags stand for (flags win)."""
    flags = ["offload.enabled=true"] if args.offload else []
    return [*args.overrides, *flags, *([f"run.device={args.device}"] if args.device else [])]


def run(args) -> None:
    from slidefusion.training import Trainer, load_config

    config = load_config(args.config, overrides(args))
    if args.resume and args.init_from:
        raise UserError("--resume and --init-from exclude each other: resume continues a run, init-from starts a new one")
    trainer = Trainer(config, quiet=args.quiet)
    with trainer.lock():  # held from before resuming until the last checkpoint is written
        if args.resume:
            print(f"resuming from {trainer.resume(args.resume)} at step {trainer.step}")
        if args.init_from:
            loaded, skipped = trainer.init_from(args.init_from)
            print(f"initialised {len(loaded)} tensors from {args.init_from}; {len(skipped)} left as initialised:")
            for name in skipped:
                print(f"  {name}")
        result = trainer.train()
    if result.losses:
        print(f"trained {len(result.losses)} steps in {result.seconds:.1f} s; final loss {result.losses[-1]:.4f}; "
              f"checkpoint {result.last_checkpoint}")
    else:
        print(f"nothing to do: the run is already at step {trainer.step} of {config.run.steps}")
