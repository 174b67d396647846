"""The `slidefusion` command: thin argument parsing over library functions.

A user mistake (bad flag, config key, size, path, video) prints one line and exits with code 2; a
training run that diverges, or sampling that produces NaN, stops with one line and exit code 3.
"""

import os
import sys
import time
import warnings
from pathlib import Path

from slidefusion import cli_args as types
from slidefusion import cli_help
from slidefusion.cli_args import ArgumentParser, one_line
from slidefusion.errors import UserError

_REQUIRED = object()
_positive_int = types.positive_int  # kept for callers of the old private name


def cmd_train(args) -> None:
    from slidefusion.training import Trainer, load_config

    from slidefusion.offload.cli import offload_overrides

    config = load_config(args.config, [*args.overrides, *offload_overrides(args)])
    if args.resume and args.init_from:
        raise UserError("--resume and --init-from exclude each other: resume continues a run, init-from starts a new one")
    trainer = Trainer(config, quiet=args.quiet)
    with trainer.lock():  # held from before resuming until the last checkpoint is written
        _train(trainer, args)


def _train(trainer, args) -> None:
    config = trainer.config
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
    from slidefusion.pipeline import FolderPipeline, VideoPipeline

    if getattr(args, "pretrained", None):
        if checkpoint not in (_REQUIRED, None) or getattr(args, "init", "checkpoint") == "random" or args.model:
            raise UserError("--pretrained brings its own model: drop --checkpoint, --init random and --model")
        return FolderPipeline.from_pretrained(args.pretrained, device=args.device)
    if getattr(args, "init", "checkpoint") == "random":
        if not args.model:
            raise UserError("--init random needs --model PRESET (e.g. stdit-tiny)")
        if checkpoint not in (_REQUIRED, None):
            raise UserError("--checkpoint and --init random exclude each other: random weights need no checkpoint")
        return VideoPipeline.from_preset(args.model, seed=args.seed, device=args.device)
    if getattr(args, "model", None):
        raise UserError("--model is only for --init random; a checkpoint brings its own model")
    if checkpoint is _REQUIRED:
        raise UserError("--checkpoint DIR is required unless --pretrained DIR or --init random --model PRESET is given")
    return VideoPipeline.from_checkpoint(checkpoint, device=args.device)


def _generate(checkpoint, prompt: str, outs: list[Path], args) -> None:
    from slidefusion.data.video_io import check_video_path, write_video
    from slidefusion.pipeline import save_latents
    from slidefusion.validate import output_path

    for out in outs:  # a bad file name must fail before minutes of sampling, not after
        check_video_path(out)
        output_path(out, "--out")
    start = time.perf_counter()
    if getattr(args, "pretrained", None):  # sizes against the folder's VAE and patch, before loading weights
        from slidefusion.pretrained import check_generation, open_folder

        folder = open_folder(args.pretrained)
        if None not in (args.frames, args.height, args.width):
            check_generation(folder, args.frames, args.height, args.width)
    pipe = _pipeline(args, checkpoint)
    latents = pipe.latents(prompt, frames=args.frames, height=args.height, width=args.width, steps=args.steps,
                           guidance=args.guidance, seed=args.seed, progress=not args.quiet)
    if getattr(args, "save_latents", None):  # demo has no such option
        print(f"wrote {save_latents(args.save_latents, latents)}")
    video = pipe.decode(latents)
    for out in outs:
        write_video(out, video, fps=pipe.fps)
        print(f"wrote {out}")
    print(f"{prompt!r}: {video.shape[1]} frames of {video.shape[2]}x{video.shape[3]} in {time.perf_counter() - start:.1f} s")


def cmd_generate(args) -> None:
    from slidefusion.parallel.cli import generate_parallel, generate_pretrained_parallel, reject_parallel_options

    if args.pretrained:
        missing = [f"--{k}" for k in ("frames", "height", "width") if getattr(args, k) is None]
        if missing:
            raise UserError(f"--pretrained needs {', '.join(missing)}: the video size in pixels (for Wan, frames "
                            "1 + 4k and sides multiples of 16, e.g. --frames 33 --height 480 --width 832)")
    if args.parallel and args.pretrained:
        if args.checkpoint is not _REQUIRED or args.init == "random" or args.model:
            raise UserError("--pretrained brings its own model: drop --checkpoint, --init random and --model")
        return generate_pretrained_parallel(args)
    if getattr(args, "parallel", None):
        return generate_parallel(args, lambda a: _pipeline(a, a.checkpoint))
    reject_parallel_options(args)
    _generate(args.checkpoint, args.prompt, [Path(args.out)], args)


def cmd_demo(args) -> None:
    from slidefusion.demo import run_demo

    run_demo(args.out, args.prompt, steps=args.steps, guidance=args.guidance, seed=args.seed, frames=args.frames,
             height=args.height, width=args.width, device=args.device, progress=not args.quiet)


def cmd_export(args) -> None:
    import torch

    from slidefusion.training.checkpoint import export_checkpoint

    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    if args.format == "diffusers":
        from slidefusion.training.finetune.export import DEFAULT_SHARD, export_diffusers

        path, what = export_diffusers(args.checkpoint, args.out, dtype, force=args.force,
                                      max_shard_size=args.max_shard_size or DEFAULT_SHARD)
    else:
        if args.max_shard_size is not None:
            raise UserError("--max-shard-size applies to --format diffusers only")
        path, what = export_checkpoint(args.checkpoint, args.out, dtype or torch.float16, force=args.force), "sampling-only"
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
    print(f"wrote {path} ({what}, {size:.1f} MiB)")


def _sampling_options(parser: ArgumentParser) -> None:
    parser.add_argument("--frames", type=types.positive_int, help="frames (default: the training clip length; "
                        "required with --pretrained, e.g. 33 for Wan: 1 + 4k)")
    parser.add_argument("--height", type=types.positive_int, help="height in pixels (default: the training size; "
                        "required with --pretrained)")
    parser.add_argument("--width", type=types.positive_int, help="width in pixels (default: the training size; "
                        "required with --pretrained)")
    parser.add_argument("--steps", type=types.integer(1, 10_000), default=30,
                        help="sampling steps (default 30): Euler for our models, the folder's own scheduler "
                        "for a diffusers folder or a fine-tune of one")
    parser.add_argument("--guidance", type=types.guidance, default=4.0,
                        help="classifier-free guidance scale, 0..100 (default 4; 1 = no guidance)")
    parser.add_argument("--seed", type=types.seed, default=0, help="0..2**64-1 (default 0)")
    parser.add_argument("--device", type=types.device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def parser() -> ArgumentParser:
    from slidefusion.parallel.cli import add_parallel_options, add_simulate_parser
    from slidefusion.eval.cli import add_evaluate_parser, add_experiment_parser
    from slidefusion.offload.cli import add_offload_options, add_plan_parser
    from slidefusion.pipeline import DEFAULT_PROMPT

    root = ArgumentParser(prog="slidefusion", description="Video diffusion transformers: train and sample.")
    sub = root.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train from a YAML config with key=value overrides", intermixed=True)
    train.add_argument("config", help="YAML config, e.g. configs/shapes-small.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-4 run.steps=200")
    train.add_argument("--resume", metavar="latest|DIR", help="continue a run exactly from a checkpoint")
    train.add_argument("--init-from", metavar="CHECKPOINT", help="start a new run from matching pretrained weights")
    train.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    add_offload_options(train)
    train.set_defaults(func=cmd_train)

    generate = sub.add_parser("generate", help="generate a video from a prompt")
    generate.add_argument("--checkpoint", default=_REQUIRED, help="checkpoint folder or run folder (its latest)")
    generate.add_argument("--pretrained", metavar="DIR", type=types.existing_folder,
                          help="a local diffusers pipeline folder (Wan, CogVideoX, HunyuanVideo, LTX-Video, Mochi, Latte), "
                               "sampled with its own scheduler")
    generate.add_argument("--prompt", type=types.text, required=True)
    generate.add_argument("--out", type=types.output_file(".mp4", ".gif"), default="outputs/video.mp4",
                          help=".mp4 (H.264) or .gif")
    generate.add_argument("--init", choices=["checkpoint", "random"], default="checkpoint",
                          help="random: an untrained --model PRESET, no checkpoint needed")
    generate.add_argument("--model", metavar="PRESET", type=types.model_preset, help="model preset for --init random")
    generate.add_argument("--save-latents", metavar="PATH", type=types.output_file(".safetensors"),
                          help="also write the final latents (a .safetensors file, key 'latents')")
    _sampling_options(generate)
    add_parallel_options(generate)
    generate.set_defaults(func=cmd_generate)

    export = sub.add_parser("export", help="write a sampling-only copy of a checkpoint (EMA weights), or a diffusers folder")
    export.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder (its latest)")
    export.add_argument("--out", required=True, type=types.output_folder,
                        help="destination folder; it must not exist yet unless --force")
    export.add_argument("--format", choices=["slidefusion", "diffusers"], default="slidefusion",
                        help="slidefusion: config + weights for `generate --checkpoint`; diffusers (a model.pretrained "
                             "run): a pipeline folder, or with lora.rank the LoRA weights for pipe.load_lora_weights")
    export.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                        help="weights dtype (default: float16; diffusers: as the source folder stores them)")
    export.add_argument("--max-shard-size", type=types.byte_size, default=None, metavar="SIZE",
                        help="diffusers: largest safetensors shard, e.g. 5GB (the default)")
    export.add_argument("--force", action="store_true", help="replace --out if it is an existing folder")
    export.set_defaults(func=cmd_export)

    demo = sub.add_parser("demo", help="generate with the bundled model: OUT.mp4, OUT.gif and a labelled OUT-grid.gif")
    demo.add_argument("--prompt", type=types.text, default=DEFAULT_PROMPT)
    demo.add_argument("--out", type=types.output_file(), default="outputs/demo.mp4",
                      help="OUT.mp4, OUT.gif and OUT-grid.gif are written (default outputs/demo.mp4)")
    _sampling_options(demo)
    demo.set_defaults(func=cmd_demo)
    add_simulate_parser(sub)
    add_plan_parser(sub)
    add_evaluate_parser(sub)
    add_experiment_parser(sub)
    return cli_help.finish(root)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (0, 2 for a user mistake, 3 for a stopped run)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else argv
    with warnings.catch_warnings():
        warnings.showwarning = _warning_line
        root = parser()
        if not argv:  # a bare `slidefusion` lists the commands and succeeds, as `pip` and `docker` do
            root.print_help()
            return 0
        try:
            args = root.parse_args(argv)
        except SystemExit as done:  # argparse: --help (0) or a one-line error (2)
            return done.code if isinstance(done.code, int) else 0 if done.code is None else 2
        prog = args.command_parser.prog
        try:
            args.func(args)
        except UserError as error:
            kind = "stopped" if getattr(error, "exit_code", 2) != 2 else "error"
            print(f"{prog}: {kind}: {one_line(error)}", file=sys.stderr)
            return getattr(error, "exit_code", 2)
        except ModuleNotFoundError as error:  # an optional dependency: name the extra that brings it
            if cli_help.missing_extra(error) is None:
                raise
            print(f"{prog}: error: {cli_help.missing_extra(error)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
    return 0


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one line each, so they do not bury the output or an error."""
    print(f"slidefusion: warning: {one_line(message)}", file=file or sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
