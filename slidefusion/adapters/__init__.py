"""Kept for imports written before `slidefusion.families` (the README's `from slidefusion.adapters import
adapter_for, TextConditioning`): the same objects as `slidefusion.families`."""

from slidefusion.families import *  # noqa: F401,F403
from slidefusion.families import __all__  # noqa: F401
