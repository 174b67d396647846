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
