"""The one exception type for user mistakes, and the one "unknown value" message.

Anything a user can get wrong (a config key, a size, a path) raises `UserError` with a one-line
message that names the parameter and says what would be valid. The CLI turns it into that line on
stderr and exit code 2, without a traceback. Programming errors stay ordinary exceptions.
"""

from collections.abc import Iterable


class UserError(ValueError):
    """Bad input from the user: a one-line message naming the parameter and the valid choices."""


def check(condition: bool, message: str) -> None:
    """Raise `UserError(message)` unless `condition` holds."""
    if not condition:
        raise UserError(message)


def unknown_value(key: str, value, valid: Iterable, *, noun: str = "unknown") -> UserError:
    """The error for a value outside a fixed set: "key='x' is unknown; valid: a, b, c".

    `key` names the parameter as the user wrote it (a flag, a config key, an argument); `valid` is
    the registry or tuple the value is checked against, so the message can never drift from it.
    `noun` replaces "unknown" where the value is known but not allowed here ("not available ...")."""
    names = ", ".join("None" if v is None else str(v) for v in valid)
    return UserError(f"{key}={value!r} is {noun}; valid: {names or 'none'}")


def choose(value, valid: Iterable, key: str):
    """`value` if it is one of `valid`, else the `unknown_value` error; returns `value` unchanged."""
    valid = tuple(valid)
    if value not in valid:
        raise unknown_value(key, value, valid)
    return value


class NonFiniteError(UserError):
    """Training or sampling produced NaN or infinity and stopped before writing anything from it.

    Not a typing mistake but still the user's to fix (usually the learning rate), so it is one
    line like any `UserError`; the CLI exits with `exit_code` to tell it apart from bad input.
    """

    exit_code = 3


class DiskFullError(UserError):
    """A write ran out of disk space (or quota). Nothing already there was lost: every writer writes
    to a temporary name first. One line saying what ran out and how much was needed; the CLI exits
    with `exit_code` (the command stopped; the input was not wrong)."""

    exit_code = 3
