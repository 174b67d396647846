"""The `slidefusion` command: thin argument parsing over library functions.

A user mistake (bad config key, size, path, video) prints one line and exits with code 2.
"""

import argparse
import os
import sys
import time
from pathlib import Path

from slidefusion.errors import UserError


_REQUIRED = object()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def cmd_train(args) -> None:
    from slidefusion.training import Trainer, load_config

    from slidefusion.offload.cli import offload_overrides

    config = load_config(args.config, [*args.overrides, *offload_overrides(args)])
    if args.resume and args.init_from:
        raise UserError("--resume and --init-from exclude each other: resume continues a run, init-from starts a new one")
    trainer = Trainer(config, quiet=args.quiet)
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


def _pipeline(args, checkpoint):
    from slidefusion.pipeline import VideoPipeline

    if getattr(args, "init", "checkpoint") == "random":
        if not args.model:
            raise UserError("--init random needs --model PRESET (e.g. stdit-tiny)")
        return VideoPipeline.from_preset(args.model, seed=args.seed, device=args.device)
    if checkpoint is _REQUIRED:
        raise UserError("--checkpoint DIR is required unless --init random --model PRESET is given")
    return VideoPipeline.from_checkpoint(checkpoint, device=args.device)


def _generate(checkpoint, prompt: str, outs: list[Path], args) -> None:
    from slidefusion.data.video_io import check_video_path, write_video
    from slidefusion.pipeline import save_latents

    for out in outs:  # a bad file name must fail before minutes of sampling, not after
        check_video_path(out)
    start = time.perf_counter()
    pipe = _pipeline(args, checkpoint)
    latents = pipe.latents(prompt, frames=args.frames, height=args.height, width=args.width, steps=args.steps,
                           guidance=args.guidance, seed=args.seed, progress=not args.quiet)
    if getattr(args, "save_latents", None):  # demo has no such option
        print(f"wrote {save_latents(args.save_latents, latents)}")
    video = pipe.decode(latents)
    for out in outs:
        write_video(out, video, fps=pipe.config.data.fps)
        print(f"wrote {out}")
    print(f"{prompt!r}: {video.shape[1]} frames of {video.shape[2]}x{video.shape[3]} in {time.perf_counter() - start:.1f} s")


def cmd_generate(args) -> None:
    if getattr(args, "parallel", None):
        from slidefusion.parallel.cli import generate_parallel

        return generate_parallel(args, lambda a: _pipeline(a, a.checkpoint))
    _generate(args.checkpoint, args.prompt, [Path(args.out)], args)


def cmd_demo(args) -> None:
    from slidefusion.demo import run_demo

    run_demo(args.out, args.prompt, steps=args.steps, guidance=args.guidance, seed=args.seed, frames=args.frames,
             height=args.height, width=args.width, device=args.device, progress=not args.quiet)


def cmd_export(args) -> None:
    import torch

    from slidefusion.training.checkpoint import export_checkpoint

    path = export_checkpoint(args.checkpoint, args.out, getattr(torch, args.dtype))
    size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    print(f"wrote {path} ({size:.1f} MiB)")


def _sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--frames", type=_positive_int, help="frames (default: the training clip length)")
    parser.add_argument("--height", type=_positive_int, help="height in pixels (default: the training size)")
    parser.add_argument("--width", type=_positive_int, help="width in pixels (default: the training size)")
    parser.add_argument("--steps", type=_positive_int, default=30, help="Euler steps (default 30)")
    parser.add_argument("--guidance", type=float, default=4.0, help="classifier-free guidance scale (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def parser() -> argparse.ArgumentParser:
    from slidefusion.parallel.cli import add_parallel_options, add_simulate_parser
    from slidefusion.eval.cli import add_evaluate_parser, add_experiment_parser
    from slidefusion.offload.cli import add_offload_options, add_plan_parser
    from slidefusion.pipeline import DEFAULT_PROMPT

    root = argparse.ArgumentParser(prog="slidefusion", description="Video diffusion transformers: train and sample.")
    sub = root.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train from a YAML config with key=value overrides")
    train.add_argument("config", help="YAML config, e.g. configs/shapes-small.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-4 run.steps=200")
    train.add_argument("--resume", metavar="latest|DIR", help="continue a run exactly from a checkpoint")
    train.add_argument("--init-from", metavar="CHECKPOINT", help="start a new run from matching pretrained weights")
    train.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    add_offload_options(train)
    train.set_defaults(func=cmd_train)

    generate = sub.add_parser("generate", help="generate a video from a prompt")
    generate.add_argument("--checkpoint", default=_REQUIRED, help="checkpoint folder or run folder (its latest)")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--out", default="outputs/video.mp4", help=".mp4 (H.264) or .gif")
    generate.add_argument("--init", choices=["checkpoint", "random"], default="checkpoint",
                          help="random: an untrained --model PRESET, no checkpoint needed")
    generate.add_argument("--model", metavar="PRESET", help="model preset for --init random")
    generate.add_argument("--save-latents", metavar="PATH", help="also write the final latents (safetensors, key 'latents')")
    _sampling_options(generate)
    add_parallel_options(generate)
    generate.set_defaults(func=cmd_generate)

    export = sub.add_parser("export", help="write a sampling-only copy of a checkpoint (EMA weights, half precision)")
    export.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder (its latest)")
    export.add_argument("--out", required=True, help="destination folder")
    export.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    export.set_defaults(func=cmd_export)

    demo = sub.add_parser("demo", help="generate with the bundled model: OUT.mp4, OUT.gif and a labelled OUT-grid.gif")
    demo.add_argument("--prompt", default=DEFAULT_PROMPT)
    demo.add_argument("--out", default="outputs/demo.mp4")
    _sampling_options(demo)
    demo.set_defaults(func=cmd_demo)
    add_simulate_parser(sub)
    add_plan_parser(sub)
    add_evaluate_parser(sub)
    add_experiment_parser(sub)
    return root


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as error:
        print(f"slidefusion: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("slidefusion: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
