"""In-place hooks: parallel code runs where a module already sits, and the model stays as it is.

`attach(module, hook)` routes `module(*args)` through `hook(module, *args)`, the way diffusers'
HookRegistry does: the module object, its class, parameters and state-dict keys are untouched, and
`detach` restores the class's forward. Hooks carry only what they were attached for (a site); what a
parallel call needs (process group, token grid, slices) is handed to them per call by `calling`,
so one hooked model can serve several engines, and outside a parallel call it runs exactly as before.
"""

import contextlib
import contextvars
import functools

from torch import nn

_HOOK = "_slidefusion_parallel_hook"
_CALL: contextvars.ContextVar = contextvars.ContextVar("slidefusion_parallel_call", default=None)


def attach(module: nn.Module, hook) -> None:
    """Route `module`'s forward through `hook(module, *args, **kwargs)` (replacing an earlier hook)."""
    object.__setattr__(module, _HOOK, hook)
    object.__setattr__(module, "forward", functools.partial(hook, module))


def detach(module: nn.Module) -> None:
    if hasattr(module, _HOOK):
        object.__delattr__(module, _HOOK)
        object.__delattr__(module, "forward")


def hooked(module: nn.Module):
    """The hook attached to `module`, or None."""
    return getattr(module, _HOOK, None)


def stock_forward(module: nn.Module, *args, **kwargs):
    """The module's own forward, bypassing its hook."""
    return type(module).forward(module, *args, **kwargs)


@contextlib.contextmanager
def calling(call):
    """Make `call` (an immutable per-call record) what the hooks see for the duration of the block."""
    token = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(token)


def current_call():
    """The record of the parallel call in progress, or None outside one."""
    return _CALL.get()


class ShardHook:
    """On the first block: hand it this rank's shard of the incoming tokens (`call.shard`)."""

    def __call__(self, module: nn.Module, x, *args, **kwargs):
        call = current_call()
        if call is None:
            return stock_forward(module, x, *args, **kwargs)
        return stock_forward(module, call.shard(x), *args, **kwargs)


class GatherHook:
    """On the model's token-wise output module (our `final`, diffusers' `proj_out`): run it on this
    rank's shard, then gather its output (`call.gather`), a few values per token instead of the width."""

    def __call__(self, module: nn.Module, *args, **kwargs):
        out = stock_forward(module, *args, **kwargs)
        call = current_call()
        return out if call is None else call.gather(out)
