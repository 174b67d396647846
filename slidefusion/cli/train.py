"""`slidefusion train CONFIG [key=value ...] [--offload] [--device D] [--resume latest|DIR | --init-from CKPT]`.

On several ranks (`torchrun --nproc-per-node N -m slidefusion train ...`) every rank runs this
command; rank 0 alone prints, and a failure is one line (`on_ranks`).
"""

import os
import sys
import warnings
from contextlib import contextmanager

from slidefusion.cli import args as types
from slidefusion.cli import help_text
from slidefusion.core.errors import NonFiniteError, UserError

EXAMPLES = [
    "slidefusion train configs/tiny.yaml run.steps=20 run.name=first",
    "slidefusion train configs/wan-finetune.yaml model.pretrained=Wan2.1-T2V-1.3B-Diffusers data.root=my-videos "
    "lora.rank=16 --offload",
    "torchrun --nproc-per-node 8 -m slidefusion train configs/wan-finetune.yaml model.pretrained=Wan2.1-T2V-14B-Diffusers "
    "data.root=my-videos --offload",
]


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train from a YAML config with key=value overrides", intermixed=True,
                           description="Train from a YAML config. On several GPUs: torchrun --nproc-per-node N -m "
                                       "slidefusion train CONFIG ... (parallel.sp, parallel.fsdp: see the config's "
                                       "parallel section); each rank takes its rows of every step's batch.")
    train.add_argument("config", help="YAML config, e.g. configs/shapes-small.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-4 run.steps=200")
    train.add_argument("--resume", metavar="latest|DIR", help="continue a run exactly from a checkpoint")
    train.add_argument("--init-from", metavar="CHECKPOINT", help="start a new run from matching pretrained weights")
    train.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    train.add_argument("--offload", action="store_true",
                       help="train with the offload engine: weights and AdamW state in host memory (offload.enabled=true)")
    train.add_argument("--device", type=types.device, help="training device, e.g. cuda or cpu (run.device=...)")
    help_text.examples(train, EXAMPLES, before=help_text.config_keys)
    train.set_defaults(func=run)


def overrides(args) -> list[str]:
    """The config overrides: the explicit key=value ones, then those the flags stand for (flags win)."""
    flags = ["offload.enabled=true"] if args.offload else []
    return [*args.overrides, *flags, *([f"run.device={args.device}"] if args.device else [])]


def run(args) -> None:
    from slidefusion.training import Trainer, load_config
    from slidefusion.training.distributed import shard_note

    with on_ranks(args.command_parser.prog):  # under torchrun: one line per failure, from rank 0
        try:
            config = load_config(args.config, overrides(args))
            if args.resume and args.init_from:
                raise UserError("--resume and --init-from exclude each other: resume continues a run, init-from "
                                "starts a new one")
        except UserError as error:
            error.agreed = True  # every rank reads the same arguments
            raise
        trainer = Trainer(config, quiet=args.quiet)
        say = print if trainer.ranks.writer else (lambda *_: None)
        if trainer.ranks.active:
            say(shard_note(config))
        with trainer.lock():  # held from before resuming until the last checkpoint is written
            _train(trainer, args, say)


def _train(trainer, args, say) -> None:
    if args.resume:
        say(f"resuming from {trainer.resume(args.resume)} at step {trainer.step}")
    if args.init_from:
        loaded, skipped = trainer.init_from(args.init_from)
        say(f"initialised {len(loaded)} tensors from {args.init_from}; {len(skipped)} left as initialised:")
        for name in skipped:
            say(f"  {name}")
    result = trainer.train()
    if result.losses:
        say(f"trained {len(result.losses)} steps in {result.seconds:.1f} s; final loss {result.losses[-1]:.4f}; "
            f"checkpoint {result.last_checkpoint}")
    else:
        say(f"nothing to do: the run is already at step {trainer.step} of {trainer.total_steps}")


@contextmanager
def on_ranks(prog: str):
    """Run the command on every rank with one line per failure: an error every rank reached alike is
    printed by rank 0 alone (the others exit with its code, silently); another rank's death or
    silence ends this one with one line within the timeout, without waiting for a clean teardown
    (which a dead peer could hang)."""
    from slidefusion.training.distributed import launched, peer_failed, rank_of_process

    if not launched():
        yield
        return
    rank = rank_of_process()
    with warnings.catch_warnings():
        if rank != 0:
            warnings.simplefilter("ignore")  # rank 0 says it once
        try:
            yield
        except UserError as error:
            if rank != 0:  # a non-finite loss or weight is seen alike by every rank (mean loss, global check)
                error.silent = getattr(error, "agreed", False) or isinstance(error, NonFiniteError)
                error.args = (f"rank {rank}: {error}",)
            raise
        except Exception as error:  # noqa: BLE001 - classified: a peer's failure is one line, anything else a bug
            if not peer_failed(error):
                raise
            print(f"{prog}: stopped: rank {rank}: another rank failed or stopped answering "
                  f"({types.one_line(str(error))[:300]})", file=sys.stderr, flush=True)
            os._exit(3)  # stopped (exit 3): the last checkpoint is intact
