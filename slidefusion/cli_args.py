"""Argument parsing shared by every subcommand: one parser class and the argparse value types.

`ArgumentParser.error` prints exactly one line, `slidefusion <command>: error: ... (see --help)`,
and exits with code 2; the value types below judge a flag with the same checks the typed configs
use (`slidefusion.validate`), so `--guidance nan` fails at parse time, naming the flag, before
any model is loaded. A new flag picks its type here instead of checking its value later.
"""

import argparse
from collections.abc import Callable
from pathlib import Path

from slidefusion import validate
from slidefusion.cli_help import config_flag_hint
from slidefusion.errors import UserError


def one_line(message: str) -> str:
    """`message` with its line breaks folded, so every error stays a single line."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors; `intermixed=True` lets positionals follow optionals
    (`train cfg --quiet run.steps=2`). Subparsers are made of this class too."""

    def __init__(self, *args, intermixed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.intermixed = intermixed
        self._mixing = False

    def error(self, message: str):
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
