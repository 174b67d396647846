"""`slidefusion demo`: the bundled model on a prompt, and a labelled grid of prompts (`slidefusion.demo`)."""

from slidefusion.cli import args as types


def add_parser(sub) -> None:
    from slidefusion.pipeline import DEFAULT_PROMPT

    demo = sub.add_parser("demo", help="generate with the bundled model: OUT.mp4, OUT.gif and a labelled OUT-grid.gif")
    demo.add_argument("--prompt", type=types.text, default=DEFAULT_PROMPT)
    demo.add_argument("--out", type=types.output_file(), default="outputs/demo.mp4",
                      help="OUT.mp4, OUT.gif and OUT-grid.gif are written (default outputs/demo.mp4)")
    types.add_sampling_options(demo)
    demo.set_defaults(func=run)


def run(args) -> None:
    from slidefusion.demo import run_demo

    run_demo(args.out, args.prompt, steps=args.steps, guidance=args.guidance, seed=args.seed, frames=args.frames,
             height=args.height, width=args.width, device=args.device, progress=not args.quiet)
