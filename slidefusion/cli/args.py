"""Argument parsing shared by every command: one parser class, the argparse value types, shared flags.

`ArgumentParser.error` prints exactly one line, `slidefusion <command>: error: ... (see --help)`,
and exits with code 2; the value types below judge a flag with the same checks the typed configs
use (`slidefusion.core.validate`), so `--guidance nan` fails at parse time, naming the flag, before
any model is loaded. A new flag picks its type here instead of checking its value later. Under
torchrun, `leave_after_rank_zero` is how a rank other than 0 ends after bad input that rank 0 reports.
"""

import argparse
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from slidefusion.core import validate
from slidefusion.core.errors import UserError


def one_line(message: str) -> str:
    """`message` with its line breaks folded, so every error stays a single line."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())


RANK_ZERO_WAIT_S = 60.0  # how long a rank other than 0 waits for torchrun to stop it after bad input


def leave_after_rank_zero(error: Exception, parser: argparse.ArgumentParser | None = None) -> NoReturn:
    """Exit 2 in silence from a rank other than 0 after bad input, but not before rank 0 has said why.
    torchrun stops every other rank with SIGTERM as soon as one rank has exited: a rank that left
    first could cut rank 0 off before its line, and rank 0 would show as killed. So under torchrun
    this rank waits for that SIGTERM and answers it with exit 2 (every rank then exits 2 on its own);
    if none comes within RANK_ZERO_WAIT_S (rank 0 did not hit the same check), it says it itself."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # no torchrun agent will stop this rank
        raise SystemExit(2) from None
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))  # stdout/stderr hold nothing of this rank's
    time.sleep(RANK_ZERO_WAIT_S)
    prog = "slidefusion" if parser is None else parser.prog
    print(f"{prog}: rank {os.environ.get('RANK', '?')}: error: {one_line(str(error))}", file=sys.stderr)
    raise SystemExit(2) from None


def follower_rank() -> bool:
    """True in a rank other than 0 under a launcher (torchrun sets RANK): every rank reads the same
    command line and the same files, so rank 0 alone reports a mistake in them, once."""
    return os.environ.get("RANK", "0").strip() not in ("0", "")


def rank_failure(error: BaseException) -> str | None:
    """One line for a failure of the process group (a peer died or never joined, a collective timed
    out), or None for any other error. torch.distributed's errors carry pages of C++ context."""
    names = {cls.__name__ for cls in type(error).__mro__}
    modules = {cls.__module__ for cls in type(error).__mro__}
    text = str(error)
    if not ("ParallelError" in names or any(m.startswith("torch.distributed") for m in modules)
            or any(word in text for word in ("Connection closed by peer", "Connection reset by peer", "[gloo]"))):
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    rank = os.environ.get("RANK", "?")
    return (f"rank {rank}: the process group failed: {first[:300]}; another rank died, stopped answering or never "
            "started (its own message, if any, is above); nothing was written")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors; `intermixed=True` lets positionals follow optionals
    (`train cfg --quiet run.steps=2`). Subparsers are made of this class too."""

    def __init__(self, *args, intermixed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.intermixed = intermixed
        self._mixing = False

    def error(self, message: str):
        if follower_rank():
            leave_after_rank_zero(ValueError(message), self)
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        if self.intermixed and not self._mixing:  # the intermixed parse calls back in here twice
            self._mixing = True
            try:
                namespace, extras = self.parse_known_intermixed_args(args, namespace)
            finally:
                self._mixing = False
        else:
            namespace, extras = super().parse_known_args(args, namespace)
        if not hasattr(namespace, "command_parser"):  # the innermost (sub)command parses first
            namespace.command_parser = self
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # reported by the subcommand that was running, so its name leads the line
            hint = config_flag_hint(extras)  # `--lora.rank 4`: say to write lora.rank=4
            namespace.command_parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return namespace

    def format_help(self) -> str:
        before = getattr(self, "epilog_before", None)  # set by help_text.examples: built only when shown
        if before is not None:
            self.epilog, self.epilog_before = f"{before()}\n\n{self.epilog}", None
        return super().format_help()


def config_flag_hint(extras: list[str]) -> str:
    """'; write lora.rank=4 ...' when an unrecognised argument looks like a config key written as a
    flag (`--lora.rank 4` or `--lora.rank=4`), else ''."""
    for i, arg in enumerate(extras):
        found = re.fullmatch(r"--([A-Za-z_]\w*(?:\.\w+)+)(?:=(.*))?", arg)
        if found:
            value = found.group(2)
            if value is None:
                following = extras[i + 1] if i + 1 < len(extras) else ""
                value = following if following and not following.startswith("--") else "VALUE"
            return f"; write {found.group(1)}={value} (config keys are section.key=VALUE words, not flags)"
    return ""


def arg_type(name: str, check: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type from a `validate`-style check: its UserError becomes argparse's message
    (argparse then prefixes the flag: 'argument --guidance: ...')."""

    def parse(text: str):
        try:
            return check(text)
        except UserError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = name
    return parse


def number(low=None, high=None, *, low_open: bool = False, high_open: bool = False):
    """A finite float in the range (e.g. `number(0, low_open=True)` for > 0)."""
    return arg_type("number", lambda t: validate.finite(t, None, low, high, low_open=low_open, high_open=high_open))


def integer(low: int | None = None, high: int | None = None):
    """An int in [low, high]."""
    return arg_type("integer", lambda t: validate.integer(t, None, low, high))


positive_int = integer(1)
natural_int = integer(0)
seed = arg_type("seed", lambda t: validate.seed(t, None))
byte_size = arg_type("size", lambda t: validate.byte_size(t, None))
bandwidth = arg_type("bandwidth", lambda t: validate.byte_size(t, None, per_second=True))
device = arg_type("device", lambda t: str(validate.device(t, None)))


def output_file(*suffixes: str):
    """A file path that can be written (checked at parse time, before any work); `suffixes` are
    the accepted endings, lower case with the dot."""
    return arg_type("path", lambda t: str(validate.output_path(t, None, suffixes)))


output_folder = arg_type("folder", lambda t: str(validate.output_path(t, None, folder=True)))


def _text(value: str) -> str:
    if not value.strip():
        raise UserError(f"{value!r} is empty; give some text")
    return value


text = arg_type("text", _text)


def _existing_file(value: str) -> str:
    path = Path(value)
    if not path.exists():
        raise UserError(f"{value!r} does not exist")
    if not path.is_file():
        raise UserError(f"{value!r} is a folder; give a file")
    return value


existing_file = arg_type("file", _existing_file)


def _existing_folder(value: str) -> str:
    path = Path(value)
    if not path.exists():
        raise UserError(f"{value!r} does not exist")
    if not path.is_dir():
        raise UserError(f"{value!r} is a file; give a folder")
    return value


existing_folder = arg_type("folder", _existing_folder)


def _existing_path(value: str) -> str:
    if not Path(value).exists():
        raise UserError(f"{value!r} does not exist")
    return value


existing_path = arg_type("path", _existing_path)  # a file or a folder


def int_list(count: int | None = None, low: int = 1):
    """Comma-separated ints >= `low` ('1,2,4'), exactly `count` of them when given."""

    def parse(value: str) -> tuple[int, ...]:
        parts = value.split(",")
        how = f"{count} " if count else ""
        try:
            numbers = tuple(validate.integer(p, None, low) for p in parts)
        except UserError:
            raise UserError(f"{value!r} must be {how}comma-separated integers >= {low}, e.g. "
                            + ",".join(str(max(low, 2**i)) for i in range(count or 3))) from None
        if count is not None and len(numbers) != count:
            raise UserError(f"{value!r} must be {count} comma-separated integers >= {low}")
        return numbers

    return arg_type("list", parse)


guidance = number(0, 100)  # classifier-free guidance: 1 is none, beyond ~20 nothing improves


def _model_preset(name: str) -> str:
    from slidefusion.models.config import preset

    preset(name)  # a UserError listing the presets
    return name


model_preset = arg_type("preset", _model_preset)


def add_sampling_options(parser: ArgumentParser, sizes: dict[str, str] | None = None) -> None:
    """The sampling flags `generate` and `demo` share: sizes, steps, guidance, seed, device.
    `sizes` replaces the help of --frames/--height/--width/--steps (demo: the bundled model's)."""
    sizes = sizes or {}
    parser.add_argument("--frames", type=positive_int, help=sizes.get("frames", "frames (default: the training clip "
                        "length; required with --pretrained, e.g. 33 for Wan: 1 + 4k)"))
    parser.add_argument("--height", type=positive_int, help=sizes.get("height", "height in pixels (default: the "
                        "training size; required with --pretrained)"))
    parser.add_argument("--width", type=positive_int, help=sizes.get("width", "width in pixels (default: the "
                        "training size; required with --pretrained)"))
    parser.add_argument("--steps", type=integer(1, 10_000), default=30,
                        help=sizes.get("steps", "sampling steps (default 30): Euler for our models, the folder's own "
                                       "scheduler for a diffusers folder or a fine-tune of one"))
    parser.add_argument("--guidance", type=guidance, default=4.0,
                        help="classifier-free guidance scale, 0..100 (default 4; 1 = no guidance)")
    parser.add_argument("--seed", type=seed, default=0, help="0..2**64-1 (default 0)")
    parser.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
