"""The one exception type for user mistakes.

Anything a user can get wrong (a config key, a size, a path) raises `UserError` with a one-line
message that names the parameter and says what would be valid. The CLI turns it into that line on
stderr and exit code 2, without a traceback. Programming errors stay ordinary exceptions.
"""


class UserError(ValueError):
    """Bad input from the user: a one-line message naming the parameter and the valid choices."""


def check(condition: bool, message: str) -> None:
    """Raise `UserError(message)` unless `condition` holds."""
    if not condition:
        raise UserError(message)


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
