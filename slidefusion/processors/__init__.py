"""Kept for imports written before `slidefusion.swap`: the same objects as `slidefusion.swap`."""

from slidefusion.swap import *  # noqa: F401,F403
from slidefusion.swap import __all__  # noqa: F401
