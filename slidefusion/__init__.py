"""slidefusion: offloaded single-GPU training and sequence-parallel serving of video DiTs.

`from slidefusion import use_slide_attention, restore_attention` (imported on first use, so that
`import slidefusion` stays cheap)."""

__version__ = "0.1.0"  # the one definition: pyproject.toml reads it

_LAZY = {"use_slide_attention": "slidefusion.swap", "restore_attention": "slidefusion.swap"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'slidefusion' has no attribute {name!r}")
