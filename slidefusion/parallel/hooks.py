"""The parallel plans' hooks: parallel code runs where a module already sits, and the model stays as it is.

Every hook goes through the one registry (`slidefusion.core.hooks`) under a name starting with
"parallel", so it chains with other users' hooks and `detach_all` removes exactly these. A hook is
`hook(module, call_next, *args, **kwargs)`: `call_next` is the module's forward below it. Hooks carry
only what they were attached for (a site, a block kind); what a parallel call needs (process group,
this call's tokens, slices) is handed to them per call by `calling`, so outside a parallel call a
hooked module runs exactly as before. The model's own forward runs on every rank; the hooks change
only what its modules see.
"""

import contextlib
import contextvars
import functools
import inspect

from torch import Tensor, nn

from slidefusion.core import hooks as registry

PREFIX = "parallel"
_CALL: contextvars.ContextVar = contextvars.ContextVar("slidefusion_parallel_call", default=None)
# Offload streaming and tiling train one process; the parallel plans split inference over ranks.
# Neither engine expects the other's calls, so a model carries one of them at a time.
REFUSED = {"offload": "the offload engine trains one process; close it before parallelize",
           "tiling": "tiled blocks run one process; untile_blocks(model) before parallelize"}


def attach(module: nn.Module, name: str, hook) -> None:
    """Add `hook(module, call_next, *args, **kwargs)` to `module` as "parallel.<name>", outermost."""
    registry.add_hook(module, f"{PREFIX}.{name}", hook)


def detach(module: nn.Module, name: str) -> None:
    registry.remove_hook(module, f"{PREFIX}.{name}")


def detach_all(model: nn.Module) -> None:
    """Remove every parallel hook from `model` and its submodules (others' hooks stay)."""
    registry.remove_hooks(model, PREFIX)


def hooked(module: nn.Module, name: str):
    """The parallel hook `name` on `module`, or None."""
    return registry.get_hook(module, f"{PREFIX}.{name}")


@functools.lru_cache(maxsize=None)
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def bind(module: nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The call's arguments by parameter name (`.arguments`, editable), `self` included."""
    return _signature(type(module)).bind(module, *args, **kwargs)


def first_argument(bound: inspect.BoundArguments) -> str:
    """The name of the module's first parameter after self (its token tensor)."""
    return list(bound.signature.parameters)[1]


def call_bound(call_next, bound: inspect.BoundArguments):
    """`call_next` (the module's forward below the hook) on (possibly edited) bound arguments."""
    return call_next(*bound.args[1:], **bound.kwargs)


def rebound(bound: inspect.BoundArguments, **changes) -> inspect.BoundArguments:
    """A copy of `bound` with some arguments replaced."""
    return inspect.BoundArguments(bound.signature, {**bound.arguments, **changes})


@contextlib.contextmanager
def calling(call):
    """Make `call` (the per-call record) what the hooks see for the duration of the block."""
    token = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(token)


def current_call():
    """The record of the parallel call in progress, or None outside one."""
    return _CALL.get()


class ShardHook:
    """On the first block: hand it this rank's positions of the whole incoming tokens (Ulysses)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, module: nn.Module, call_next, *args, **kwargs):
        call = current_call()
        if call is None:
            return call_next(*args, **kwargs)
        bound = bind(module, args, kwargs)
        name = first_argument(bound)
        return call_bound(call_next, rebound(bound, **{name: call.tokens.shard(bound.arguments[name], self.kind)}))


class RowsHook:
    """On a temporal block under Ulysses: cut its per-row arguments (`names`, one row per sample
    and position) to this rank's positions, as its token tensor already is."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def __call__(self, module: nn.Module, call_next, *args, **kwargs):
        call = current_call()
        if call is None:
            return call_next(*args, **kwargs)
        bound = bind(module, args, kwargs)
        cut = {name: call.tokens.cut_rows(bound.arguments[name], *call.tokens.span)
               for name in self.names if isinstance(bound.arguments.get(name), Tensor)}
        return call_bound(call_next, rebound(bound, **cut))


class TokenHook:
    """On a module whose outputs are per token (Wan's rotary table): keep this rank's tokens."""

    def __init__(self, dim: int):
        self.dim = dim

    def __call__(self, module: nn.Module, call_next, *args, **kwargs):
        out = call_next(*args, **kwargs)
        call = current_call()
        if call is None:
            return out
        if isinstance(out, Tensor):
            return call.tokens.cut(out, self.dim)
        return type(out)(call.tokens.cut(t, self.dim) for t in out)


class GatherHook:
    """On the model's token-wise output module (our `final`, diffusers' `proj_out`): run it on this
    rank's shard, then gather its output (`call.gather`), a few values per token instead of the width."""

    def __call__(self, module: nn.Module, call_next, *args, **kwargs):
        out = call_next(*args, **kwargs)
        call = current_call()
        return out if call is None else call.gather(out)
