"""The one hook registry: named hooks on an unchanged module that chain and come off in any order.

Offload streaming, tiling, the parallel plans and the slide-attention swap all change what a module
does when it is called without changing the module: its class, parameters and state-dict keys stay
as they are. They do it here, and nowhere else is a module's instance `forward` set or deleted.

    add_hook(block, "offload", hook)        # hook(module, call_next, *args, **kwargs) -> output
    remove_hook(block, "offload")           # any order; the last one leaves the module as it was

A module's hooks form a chain, the last added outermost: a call runs the outermost hook, whose
`call_next(*args, **kwargs)` runs the next one in, and the innermost one's reaches the module's own
forward (or an instance `forward` some other library had set before the first hook came, which is
kept and restored). Hooks added with `inner=True` sit innermost: a stand-in for the module's own
forward (`stand_in`), under whatever else is attached.

Re-entry: a hook that calls its module again (the offload engine runs the block it streams; a tiled
block recomputes itself in backward) does not meet itself or the hooks outside it again: while a
hook runs, a call of the module starts at the hook below it. Work that calls the module outside the
hook's own call (an autograd backward) says where it stands with `within(module, name)`.

Names are dotted, the first part naming the user ("offload", "tiling", "parallel", "swap"), so a
user can remove all its hooks from a model (`remove_hooks`) and refuse to stack on another user's
(`refuse_hooks`) with one line, at attach time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

from torch import nn

from slidefusion.core.errors import UserError

REGISTRY_ATTR = "_slidefusion_hooks"
Hook = Callable[..., object]  # hook(module, call_next, *args, **kwargs) -> the module's output


class HookRegistry:
    """The hooks of one module; while it has any it is the module's instance `forward`.

    names: innermost first; active: the names of hooks whose call is in progress, innermost last
    (a call of the module starts below the last of them)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.names: list[str] = []
        self.hooks: dict[str, Hook] = {}
        self.active: list[str] = []
        self.previous = module.__dict__.get("forward")  # an instance forward set before us: kept

    def __call__(self, *args, **kwargs):
        start = self.names.index(self.active[-1]) - 1 if self.active else len(self.names) - 1
        return self._run(start, args, kwargs)

    def _run(self, level: int, args: tuple, kwargs: dict):
        if level < 0:  # the module's own forward (a plain call: torch.compile traces it)
            if self.previous is not None:
                return self.previous(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)
        name = self.names[level]
        self.active.append(name)
        try:
            return self.hooks[name](self.module, _Next(self, name), *args, **kwargs)
        finally:
            self.active.pop()

    def below(self, name: str, args: tuple, kwargs: dict):
        """The chain below hook `name` on these arguments (what `call_next` runs)."""
        return self._run(self.names.index(name) - 1, args, kwargs)


class _Next:
    """`call_next` of one hook: the rest of the chain below it. An object (not a closure), so that
    work a hook defers (an autograd backward) can keep it and call it later."""

    __slots__ = ("registry", "name")

    def __init__(self, registry: HookRegistry, name: str):
        self.registry, self.name = registry, name

    def __call__(self, *args, **kwargs):
        return self.registry.below(self.name, args, kwargs)


def registry_of(module: nn.Module) -> HookRegistry | None:
    """The module's registry, or None while it has no hooks."""
    return module.__dict__.get(REGISTRY_ATTR)


def add_hook(module: nn.Module, name: str, hook: Hook, *, inner: bool = False) -> None:
    """Attach `hook` to `module` as `name`: outermost, or innermost with `inner`. A module carries
    each name once (a second one is a programming error, not a user's)."""
    registry = registry_of(module)
    if registry is None:
        registry = HookRegistry(module)
        module.__dict__[REGISTRY_ATTR] = registry
        module.__dict__["forward"] = registry
    if name in registry.hooks:
        raise RuntimeError(f"{type(module).__name__} already has a hook named {name!r}")
    registry.hooks[name] = hook
    registry.names.insert(0 if inner else len(registry.names), name)


def remove_hook(module: nn.Module, name: str) -> Hook:
    """Take hook `name` off `module` (the others keep their order) and return it; with the last
    one the registry goes and the module's `__dict__` is as it was before the first hook."""
    registry = registry_of(module)
    if registry is None or name not in registry.hooks:
        raise RuntimeError(f"{type(module).__name__} has no hook named {name!r}")
    if name in registry.active:
        raise RuntimeError(f"hook {name!r} cannot be removed from inside its own call")
    registry.names.remove(name)
    hook = registry.hooks.pop(name)
    if not registry.names:
        del module.__dict__[REGISTRY_ATTR]
        if registry.previous is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = registry.previous
    return hook


def get_hook(module: nn.Module, name: str) -> Hook | None:
    """The hook named `name` on `module`, or None."""
    registry = registry_of(module)
    return None if registry is None else registry.hooks.get(name)


def hook_names(module: nn.Module) -> list[str]:
    """The names of `module`'s hooks, innermost first."""
    registry = registry_of(module)
    return [] if registry is None else list(registry.names)


def hooked_modules(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module, str]]:
    """(module path, module, hook name) for every hook on `model` and its submodules whose name is
    `prefix` or starts with `prefix.` (every hook for "")."""
    for path, module in model.named_modules(remove_duplicate=False):
        for name in hook_names(module):
            if not prefix or name == prefix or name.startswith(prefix + "."):
                yield path, module, name


def remove_hooks(model: nn.Module, prefix: str) -> int:
    """Remove every hook named `prefix` or `prefix.*` from `model` and its submodules; their count."""
    found = list(hooked_modules(model, prefix))
    for _, module, name in found:
        if get_hook(module, name) is not None:  # a module listed twice (shared) lost it already
            remove_hook(module, name)
    return len(found)


def refuse_hooks(model: nn.Module, refused: Mapping[str, str]) -> None:
    """A one-line UserError if `model` carries a hook of a user in `refused` (name prefix -> why
    the two cannot stack and what to do instead)."""
    for prefix, why in refused.items():
        for path, _, name in hooked_modules(model, prefix):
            raise UserError(f"{type(model).__name__} has {prefix} hooks ({name} on {path or 'the model'}): {why}")


@contextlib.contextmanager
def within(module: nn.Module, name: str):
    """Calls of `module` inside the block start below hook `name`, as they do during that hook's
    own call: for work of the hook that runs outside it (recomputation in an autograd backward)."""
    registry = registry_of(module)
    if registry is None or name not in registry.hooks:
        raise RuntimeError(f"{type(module).__name__} has no hook named {name!r}")
    registry.active.append(name)
    try:
        yield
    finally:
        registry.active.pop()


@contextlib.contextmanager
def stand_in(module: nn.Module, name: str, forward: Callable):
    """For the duration of the block, `forward(*args, **kwargs)` answers in place of `module`'s own
    forward, under any hooks it carries (an innermost hook that never calls on)."""
    add_hook(module, name, lambda _module, _next, *args, **kwargs: forward(*args, **kwargs), inner=True)
    try:
        yield
    finally:
        remove_hook(module, name)


__all__ = ["REGISTRY_ATTR", "HookRegistry", "add_hook", "get_hook", "hook_names", "hooked_modules", "refuse_hooks",
           "registry_of", "remove_hook", "remove_hooks", "stand_in", "within"]
