"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay to min_lr; a function
of (config, step, total) alone."""

import math

import pytest

from slidefusion.core.errors import UserError
from slidefusion.optim import OptimConfig
from slidefusion.training.schedule import lr_at


def _lrs(schedule: str, total: int = 10, warmup: int = 2, min_lr: float = 1e-5):
    optim = OptimConfig(lr=1e-3, warmup_steps=warmup, schedule=schedule, min_lr=min_lr)
    return [lr_at(optim, step, total) for step in range(total)]


def test_warm_up_then_the_schedule():
    for schedule in ("constant", "linear", "cosine"):
        lrs = _lrs(schedule)
        assert lrs[:2] == pytest.approx([5e-4, 1e-3])  # (step + 1) / warmup_steps of lr
        assert lrs[2] == pytest.approx(1e-3)  # the decay starts at lr
    assert _lrs("constant")[2:] == pytest.approx([1e-3] * 8)
    linear = _lrs("linear")
    assert linear[2:] == pytest.approx([1e-5 + (1e-3 - 1e-5) * (1 - k / 8) for k in range(8)])
    cosine = _lrs("cosine")
    assert cosine[2:] == pytest.approx([1e-5 + (1e-3 - 1e-5) * (1 + math.cos(math.pi * k / 8)) / 2 for k in range(8)])
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:])) and min(cosine) >= 1e-5


def test_no_warm_up_and_past_the_end():
    optim = OptimConfig(lr=1e-3, warmup_steps=0, schedule="linear", min_lr=0.0)
    assert lr_at(optim, 0, 4) == pytest.approx(1e-3) and lr_at(optim, 10, 4) == 0.0


@pytest.mark.parametrize("kwargs, needle", [({"schedule": "exp"}, "optim.schedule='exp' is unknown; valid: constant, linear, cosine"),
                                            ({"min_lr": -1.0}, "optim.min_lr"), ({"min_lr": 1.0}, "optim.min_lr")])
def test_bad_schedules_are_refused(kwargs, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(")):
        OptimConfig(lr=1e-3, **kwargs)
