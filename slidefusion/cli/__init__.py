"""The `slidefusion` command: one module per command, each thin: parse, then call library functions.

    train  cache  generate  export  demo  simulate  plan  evaluate  experiment

Each command module has `add_parser(subparsers)`, which registers its flags, its examples (shown at
the end of its --help, `help_text.examples`) and its `run(args)`. A bare `slidefusion` prints the help.
A user mistake (bad flag, config key, size, path, video) prints one line and exits with code 2; a
training run that diverges, sampling that produces NaN, a full disk or a failed process group stops
with one line and exit code 3. Under a launcher (torchrun) rank 0 alone reports bad input.
"""

import os
import sys
import warnings

from slidefusion.cli import cache, demo, evaluate, experiment, export, generate, help_text, plan, simulate, train
from slidefusion.cli.args import ArgumentParser, follower_rank, leave_after_rank_zero, one_line, rank_failure
from slidefusion.core.errors import UserError

COMMANDS = (train, cache, generate, export, demo, simulate, plan, evaluate, experiment)  # in `--help` order


def parser() -> ArgumentParser:
    root = ArgumentParser(prog="slidefusion", description="Video diffusion transformers: train and sample.")
    sub = root.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return help_text.finish(root)


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
            silent = getattr(error, "silent", None)  # set by a multi-rank train: True where rank 0 says it
            if kind == "error" and follower_rank() and silent is not False:  # bad input: rank 0 says it, once
                try:
                    leave_after_rank_zero(error, args.command_parser)
                except SystemExit as done:
                    return done.code
            if not silent:
                print(f"{prog}: {kind}: {one_line(error)}", file=sys.stderr)
            return getattr(error, "exit_code", 2)
        except ModuleNotFoundError as error:  # an optional dependency: name the extra that brings it
            if help_text.missing_extra(error) is None:
                raise
            print(f"{prog}: error: {help_text.missing_extra(error)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
        except Exception as error:  # noqa: BLE001 - only a process group's failure is caught, see rank_failure
            line = rank_failure(error)
            if line is None:
                raise
            print(f"{prog}: stopped: {line}", file=sys.stderr)
            return 3
    return 0


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one line each, so they do not bury the output or an error."""
    print(f"slidefusion: warning: {one_line(message)}", file=file or sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
