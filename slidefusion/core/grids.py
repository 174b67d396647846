"""The token grid: how many patches a latent video holds along time, height and width.

Every model, estimate and engine reads the grid from here, so one rule decides it: each latent
size must be a positive multiple of its patch size, and the grid is the quotient. A size the patch
does not divide is refused by name, never rounded (a model would crash or crop on it later).
"""

from collections.abc import Sequence

from slidefusion.core.errors import UserError

AXES = ("frames", "height", "width")


def token_grid(latent: Sequence[int], patch: Sequence[int], owner: str = "the model") -> tuple[int, int, int]:
    """(T', H', W') = (T / pt, H / ph, W / pw) for latent sizes (T, H, W) in latent cells and the
    patch (pt, ph, pw); a UserError naming the axis unless each size is a positive multiple.
    `owner` names whose patch it is in that message."""
    sizes, patch = tuple(int(s) for s in latent), tuple(int(p) for p in patch)
    if len(sizes) != 3 or len(patch) != 3:
        raise UserError(f"a token grid needs three latent sizes and three patch sizes, got {sizes} and {patch}")
    for axis, size, step in zip(AXES, sizes, patch):
        if size < step or size % step:
            raise UserError(f"latent {axis}={size} must be a positive multiple of {owner}'s patch size {step}")
    return tuple(size // step for size, step in zip(sizes, patch))


__all__ = ["AXES", "token_grid"]
