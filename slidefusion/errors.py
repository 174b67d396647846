"""Kept for imports written before `slidefusion.core`: the same objects as `slidefusion.core.errors`."""

from slidefusion.core.errors import DiskFullError, NonFiniteError, UserError, check, choose, unknown_value

__all__ = ["DiskFullError", "NonFiniteError", "UserError", "check", "choose", "unknown_value"]
