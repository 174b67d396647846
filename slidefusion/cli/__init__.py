"""The `slidefusion` command: one module per command, each thin: parse, then call library functions.

    train  generate  export  demo  simulate  plan  evaluate  experiment

Each command module has `add_parser(subparsers)`, which registers its flags and its `run(args)`.
A user mistake (bad flag, config key, size, path, video) prints one line and exits with code 2; a
training run that diverges, or sampling that produces NaN, stops with one line and exit code 3.
"""

import os
import sys
import warnings

from slidefusion.cli import demo, evaluate, experiment, export, generate, plan, simulate, train
from slidefusion.cli.args import ArgumentParser, one_line
from slidefusion.errors import UserError

COMMANDS = (train, generate, export, demo, simulate, plan, evaluate, experiment)  # in `--help` order


def parser() -> ArgumentParser:
    root = ArgumentParser(prog="slidefusion", description="Video diffusion transformers: train and sample.")
    sub = root.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return root


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (0, 2 for a user mistake, 3 for a stopped run)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.showwarning = _warning_line
        try:
            args = parser().parse_args(argv)
        except SystemExit as done:  # argparse: --help (0) or a one-line error (2)
            return done.code if isinstance(done.code, int) else 0 if done.code is None else 2
        prog = args.command_parser.prog
        try:
            args.func(args)
        except UserError as error:
            kind = "stopped" if getattr(error, "exit_code", 2) != 2 else "error"
            print(f"{prog}: {kind}: {one_line(error)}", file=sys.stderr)
            return getattr(error, "exit_code", 2)
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
    return 0


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one line each, so they do not bury the output or an error."""
    print(f"slidefusion: warning: {one_line(message)}", file=file or sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
