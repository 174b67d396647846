"""Kept for imports written before `slidefusion.swap`: the same objects as `slidefusion.swap.config`."""

from slidefusion.swap.config import *  # noqa: F401,F403
from slidefusion.swap.config import PRETRAINED_ATTENTION, configured_options  # noqa: F401
