"""The hook registry on its own: named hooks chain, come off in any order, re-enter below themselves,
and leave no trace on the module once the last one is gone."""

import copy
import itertools

import pytest
import torch
from torch import nn

from slidefusion.core import hooks
from slidefusion.core.errors import UserError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def _tag(tag: float, seen: list):
    """A hook that notes its name on the way in and adds `tag` to the output on the way out."""

    def hook(module, call_next, x):
        seen.append(tag)
        return call_next(x) + tag

    return hook


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_hooks_chain_and_come_off_in_any_order(order):
    model, x = _model(), torch.randn(3, 4)
    layer = model[0]
    before, state, keys = model(x), copy.deepcopy(model.state_dict()), set(vars(layer))
    seen = []
    for tag in (1.0, 10.0, 100.0):
        hooks.add_hook(layer, f"t.{int(tag)}", _tag(tag, seen))
    assert hooks.hook_names(layer) == ["t.1", "t.10", "t.100"]
    assert torch.allclose(layer(x), type(layer).forward(layer, x) + 111)
    assert seen == [100.0, 10.0, 1.0]  # the last added is outermost
    live = {1.0, 10.0, 100.0}
    for i in order:
        tag = (1.0, 10.0, 100.0)[i]
        hooks.remove_hook(layer, f"t.{int(tag)}")
        live.discard(tag)
        seen.clear()
        out = layer(x)
        assert torch.allclose(out, type(layer).forward(layer, x) + sum(live)) and sorted(seen) == sorted(live)
    assert set(vars(layer)) == keys and "forward" not in vars(layer)
    assert torch.equal(model(x), before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_hook_calling_its_module_again_starts_below_itself():
    layer = nn.Linear(2, 2)
    calls = []

    def outer(module, call_next, x):
        calls.append("outer")
        return module(x) * 2  # re-entry: must not meet `outer` again

    def inner(module, call_next, x):
        calls.append("inner")
        return call_next(x) + 1

    hooks.add_hook(layer, "a", inner)
    hooks.add_hook(layer, "b", outer)
    x = torch.randn(1, 2)
    assert torch.allclose(layer(x), (type(layer).forward(layer, x) + 1) * 2)
    assert calls == ["outer", "inner"]


def test_within_marks_work_outside_the_hook_s_own_call():
    layer = nn.Linear(2, 2)
    count = []
    hooks.add_hook(layer, "once", lambda module, call_next, x: count.append(1) or call_next(x))
    x = torch.randn(1, 2)
    with hooks.within(layer, "once"):
        layer(x)
    assert count == []
    layer(x)
    assert count == [1]


def test_stand_in_answers_under_the_other_hooks_and_goes():
    layer = nn.Linear(2, 2)
    hooks.add_hook(layer, "plus", lambda module, call_next, x: call_next(x) + 1)
    x = torch.randn(1, 2)
    with hooks.stand_in(layer, "stop", lambda x: torch.zeros(1, 2)):
        assert torch.equal(layer(x), torch.ones(1, 2))
    assert hooks.hook_names(layer) == ["plus"]
    hooks.remove_hook(layer, "plus")
    assert hooks.registry_of(layer) is None and "forward" not in vars(layer)


def test_an_instance_forward_set_before_is_kept_and_restored():
    layer = nn.Linear(2, 2)
    own = lambda x: x * 0  # noqa: E731 - another library's instance forward
    layer.forward = own
    hooks.add_hook(layer, "h", lambda module, call_next, x: call_next(x) + 1)
    assert torch.equal(layer(torch.ones(1, 2)), torch.ones(1, 2))
    hooks.remove_hook(layer, "h")
    assert layer.__dict__["forward"] is own


def test_prefix_removal_and_refusal():
    model = _model()
    hooks.add_hook(model[0], "parallel.a", lambda m, n, x: n(x))
    hooks.add_hook(model[2], "parallel.b", lambda m, n, x: n(x))
    hooks.add_hook(model[2], "offload", lambda m, n, x: n(x))
    with pytest.raises(UserError, match="has parallel hooks .*: no"):
        hooks.refuse_hooks(model, {"parallel": "no"})
    hooks.refuse_hooks(model, {"tiling": "fine"})
    assert hooks.remove_hooks(model, "parallel") == 2
    assert hooks.hook_names(model[2]) == ["offload"] and hooks.registry_of(model[0]) is None


def test_a_hooked_model_deep_copies_into_its_own_chain():
    model = _model()
    hooks.add_hook(model[0], "h", lambda m, n, x: n(x) * 0)
    twin = copy.deepcopy(model)
    hooks.remove_hook(model[0], "h")
    x = torch.randn(2, 4)
    assert torch.equal(twin[0](x), torch.zeros(2, 4)) and not torch.equal(model[0](x), torch.zeros(2, 4))
    assert hooks.registry_of(twin[0]).module is twin[0]


def test_a_name_twice_is_refused():
    layer = nn.Linear(2, 2)
    hooks.add_hook(layer, "h", lambda m, n, x: n(x))
    with pytest.raises(RuntimeError, match="already has a hook named 'h'"):
        hooks.add_hook(layer, "h", lambda m, n, x: n(x))
