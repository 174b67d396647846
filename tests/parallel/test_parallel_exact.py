"""Every schedule on 2, 3 and 4 gloo ranks equals the single-process run within 1e-5 (fp32).

One spawned job per rank count runs all cases in one process group. Shapes are uneven on purpose:
T=5 and S=15 tokens per frame split unevenly over 2-4 ranks, T=3 leaves a rank without frames on 4
ranks. Ulysses runs models with 5 heads, which 2, 3 and 4 ranks split unevenly; sliced Ulysses cuts
75 full-3D tokens into 2-3 chunks per rank, and a 6-token grid leaves some chunks empty."""

import pytest
import torch
from parallel_helpers import random_model, run_cases, run_sample

from slidefusion.errors import UserError
from slidefusion.models import build_model, preset
from slidefusion.parallel import ParallelConfig, spawn
from slidefusion.parallel.plan import SCHEDULES, plan_for

SHAPE = (1, 3, 5, 6, 10)  # latents: 5 frames of 3 x 5 tokens
FEW_FRAMES = (1, 3, 3, 6, 10)
TINY = (1, 3, 1, 4, 6)  # 6 tokens: on 4 ranks 2, 2, 1, 1, so 4 slices leave chunks empty

# (name, model, shape, config, expected error or None); errors depend on the rank count where noted.
def cases(world):
    out = []
    for name in ("dsp", "scalefusion", "scalefusion-inter"):
        for slices in ((1,) if name == "dsp" else (2, 3)):
            out.append((f"{name}/{slices}", "stdit-tiny", SHAPE, ParallelConfig(name, slices, timeout_s=60)))
    out += [
        ("scalefusion/auto", "stdit-tiny", SHAPE, ParallelConfig("scalefusion", "auto", timeout_s=60)),
        ("inter/few-frames", "stdit-tiny", FEW_FRAMES, ParallelConfig("scalefusion-inter", 2, timeout_s=60)),
        ("ulysses/stdit", "stdit-5h", SHAPE, ParallelConfig("ulysses", 1, timeout_s=60)),
        ("cfg/scalefusion", "stdit-tiny", SHAPE, ParallelConfig("scalefusion", 2, cfg_parallel=True, timeout_s=60)),
        ("dsp/dit3d", "dit3d-tiny", SHAPE, ParallelConfig("dsp", 1, timeout_s=60)),
        ("ulysses/dit3d-2-heads", "dit3d-tiny", SHAPE, ParallelConfig("ulysses", 1, timeout_s=60)),
        ("sliced/stdit", "stdit-5h", SHAPE, ParallelConfig("ulysses", 2, timeout_s=60)),
    ]
    for slices in (1, 2, 3, "auto"):
        out.append((f"ulysses/dit3d/{slices}", "dit3d-5h", SHAPE, ParallelConfig("ulysses", slices, timeout_s=60)))
    out.append(("ulysses/dit3d-tiny-grid/4", "dit3d-5h", TINY, ParallelConfig("ulysses", 4, timeout_s=60)))
    out.append(("cfg/ulysses/2", "dit3d-5h", SHAPE, ParallelConfig("ulysses", 2, cfg_parallel=True, timeout_s=60)))
    out.append(("stock/dit3d", "dit3d-5h", SHAPE, None))  # hooked by the cases above, called directly
    return out


def expected_error(name: str, world: int) -> str | None:
    if name == "dsp/dit3d":
        return "valid for dit3d: ulysses"
    if name == "sliced/stdit":
        return "ulysses --slices 2 slices full-3D attention"
    if name == "ulysses/dit3d-2-heads" and world > 2:
        return f"{world} ranks > 2 heads of dit3d"
    if name.startswith("cfg/") and world % 2:
        return "cfg_parallel needs an even number of ranks"
    return None


@pytest.fixture(scope="module")
def references():
    models = ("stdit-tiny", "stdit-5h", "dit3d-tiny", "dit3d-5h")
    return {(m, s): run_sample(random_model(m), s) for m in models for s in (SHAPE, FEW_FRAMES, TINY)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_schedule_equals_one_process(world, references):
    results = spawn(run_cases, world, cases(world), timeout_s=60, job_timeout_s=200)
    for name, model_name, shape, config in cases(world):
        got, error = results[0][name], expected_error(name, world)
        if error is not None:
            assert isinstance(got, str) and "UserError" in got and error in got, f"{name}: {got}"
            continue
        assert isinstance(got, torch.Tensor), f"{name}: {got}"
        ref = references[model_name, shape]
        assert ref.abs().max() > 0.5  # the model moved the latents: the comparison means something
        err = (got - ref).abs().max().item()
        assert err <= 1e-5, f"{name} on {world} ranks differs from one process by {err}"
        for other in results[1:]:  # every rank holds the same answer
            assert torch.equal(other[name], got), name


def test_plan_rejects_what_cannot_run():
    with pytest.raises(UserError, match="valid for dit3d: ulysses"):
        plan_for(random_model("dit3d-tiny"), SCHEDULES["scalefusion"])
    with pytest.raises(UserError, match="3 ranks > 2 heads"):
        plan_for(random_model("dit3d-tiny"), SCHEDULES["ulysses"], ranks=3)
    with pytest.raises(UserError, match="slices=0 must be an int in 1..64 or 'auto'"):
        ParallelConfig("scalefusion", 0)
    with pytest.raises(UserError, match="does not apply to the dsp schedule"):
        ParallelConfig("dsp", 4)
    with pytest.raises(UserError, match="valid: dsp, ulysses, scalefusion, scalefusion-inter"):
        ParallelConfig("ring")
    with pytest.raises(UserError, match="model class Linear has no parallel plan; supported: DiT3D, STDiT"):
        plan_for(torch.nn.Linear(2, 2), SCHEDULES["ulysses"])
    slide = build_model(preset("dit3d-tiny", attention="slide", attention_options={"kernel_size": [1, 3, 3]}))
    with pytest.raises(UserError, match="cannot split SlideAttention3d by heads"):
        plan_for(slide, SCHEDULES["ulysses"], ranks=2)
