"""Every schedule on 2, 3 and 4 gloo ranks equals the single-process run within 1e-5 (fp32), on our
models and on diffusers' Latte and Wan (tiny, random), and the split VAE decode equals one decode.

One spawned job per rank count runs all cases in one process group. Shapes are uneven on purpose:
T=5 and S=15 tokens per frame split unevenly over 2-4 ranks, T=3 leaves a rank without frames on 4
ranks. Ulysses runs models with 5 heads, which 2, 3 and 4 ranks split unevenly; sliced Ulysses cuts
75 full-3D tokens into 2-3 chunks per rank, and a 6-token grid leaves some chunks empty. Diffusers
models are sampled by their scheduler's loop (`denoise`, CFG batch 2) or by WanPipeline itself."""

import pytest
import torch
from parallel_helpers import random_model, reference, run_cases

from slidefusion.core.errors import UserError
from slidefusion.models import build_model, preset
from slidefusion.parallel import ParallelConfig, spawn
from slidefusion.parallel.plan import SCHEDULES, plan_for
from slidefusion.testing.tiny import tiny_model

SHAPE = (1, 3, 5, 6, 10)  # latents: 5 frames of 3 x 5 tokens
FEW_FRAMES = (1, 3, 3, 6, 10)
TINY = (1, 3, 1, 4, 6)  # 6 tokens: on 4 ranks 2, 2, 1, 1, so 4 slices leave chunks empty
LATTE = (1, 4, 3, 6, 10)  # Latte's video_length 3: on 4 ranks one holds no frame; 15 positions
WAN, WAN22, TINY_WAN = (1, 4, 3, 6, 10), (1, 48, 2, 6, 10), (1, 4, 1, 4, 6)  # 45, 30 and 6 tokens
VAE = (1, 4, 3, 4, 14)  # split by its 14 latent columns, each tile with a 9-column halo
VAE2D = (1, 4, 3, 4, 6)  # a 2-D VAE: 3 frames split over the ranks (on 4, one decodes none)

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
    out.append(("stock/dit3d", "dit3d-5h", SHAPE, None))  # hooked by the cases above, then detached
    for name, slices in (("dsp", 1), ("scalefusion", 2), ("scalefusion-inter", 2), ("ulysses", 1)):
        out.append((f"latte/{name}/{slices}", "latte-5h", LATTE, ParallelConfig(name, slices, timeout_s=60)))
    for name, slices in (("scalefusion-inter", 2), ("ulysses", 1)):
        out.append((f"latte/call/{name}", "latte-5h:call", LATTE, ParallelConfig(name, slices, timeout_s=60)))
    out.append(("latte/cfg/scalefusion", "latte-5h", LATTE, ParallelConfig("scalefusion", 2, cfg_parallel=True,
                                                                           timeout_s=60)))
    for slices in (1, 2, 3, "auto"):
        out.append((f"wan/ulysses/{slices}", "wan-5h", WAN, ParallelConfig("ulysses", slices, timeout_s=60)))
    out += [("wan/tiny-grid/4", "wan-5h", TINY_WAN, ParallelConfig("ulysses", 4, timeout_s=60)),
            ("wan/cfg/ulysses/2", "wan-5h", WAN, ParallelConfig("ulysses", 2, cfg_parallel=True, timeout_s=60)),
            ("wan2.2/ulysses/2", "wan2.2-5h", WAN22, ParallelConfig("ulysses", 2, timeout_s=60)),
            ("wan/pipeline/ulysses/2", "wan-5h:pipeline", None, ParallelConfig("ulysses", 2, timeout_s=60)),
            ("wan/dsp", "wan-5h", WAN, ParallelConfig("dsp", 1, timeout_s=60)),
            ("stock/wan", "wan-5h", WAN, None),
            ("vae/split", "vae", VAE, None), ("vae2d/frames", "vae2d", VAE2D, None)]
    return out + ring_cases(world)


def ring_cases(world):
    """Ring and Ulysses x Ring: not limited by heads (dit3d-tiny has 2), sliced into uneven and empty
    chunks, with CFG-parallel, on Wan 2.1 / 2.2 TI2V and through WanPipeline's own loop; auto calibrates
    itself on the run and must agree on every rank. usp --ulysses 2 is 2 x 1 (plain Ulysses) on 2
    ranks, 2 x 2 on 4, and bad input on 3."""
    def config(name, slices, **kw):
        return ParallelConfig(name, slices, timeout_s=60, **kw)

    return [("ring/dit3d/1", "dit3d-5h", SHAPE, config("ring", 1)), ("ring/dit3d/3", "dit3d-5h", SHAPE, config("ring", 3)),
            ("ring/dit3d-2-heads", "dit3d-tiny", SHAPE, config("ring", 2)),
            ("ring/tiny-grid/4", "dit3d-5h", TINY, config("ring", 4)),
            ("usp/dit3d/2", "dit3d-5h", SHAPE, config("usp", 2, ulysses=2)),
            ("usp/dit3d-2-heads", "dit3d-tiny", SHAPE, config("usp", 1, ulysses=2)),
            ("cfg/ring/2", "dit3d-5h", SHAPE, config("ring", 2, cfg_parallel=True)),
            ("auto/dit3d-2-heads", "dit3d-tiny", SHAPE, config("auto", None)),
            ("wan/ring/2", "wan-5h", WAN, config("ring", 2)), ("wan/usp/3", "wan-5h", WAN, config("usp", 3, ulysses=2)),
            ("wan2.2/ring/1", "wan2.2-5h", WAN22, config("ring", 1)),
            ("wan/pipeline/ring/2", "wan-5h:pipeline", None, config("ring", 2)),
            ("wan/cfg/auto", "wan-5h", WAN, config("auto", None, cfg_parallel=True))]


def expected_error(name: str, world: int) -> str | None:
    if name == "dsp/dit3d":
        return "valid for DiT3D: ulysses"
    if name == "wan/dsp":
        return "WanTransformer3DModel attends over all tokens at once; valid for WanTransformer3DModel: ulysses"
    if name == "sliced/stdit":
        return "ulysses --slices 2 slices full-3D attention"
    if name == "ulysses/dit3d-2-heads" and world > 2:
        return f"{world} ranks > 2 heads of DiT3D"
    if "cfg/" in name and world % 2:
        return "cfg_parallel needs an even number of ranks"
    if name.startswith(("usp/", "wan/usp")) and world == 3:
        return "--ulysses 2 does not divide the 3 ranks per sequence group"
    return None


@pytest.fixture(scope="module")
def references():
    pairs = {(model, shape) for _, model, shape, config in cases(2)}
    return {pair: reference(*pair) for pair in pairs}


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
        assert got.shape == ref.shape, name
        err = (got - ref).abs().max().item()
        # 1e-5 of the answer's scale: DDIM's x0 estimate divides by sqrt(alpha_t) and guidance multiplies
        # by 4, so Latte's unclipped latents reach |x| ~ 24 (the single model calls are within 1e-5 absolute)
        assert err <= 1e-5 * max(1.0, ref.abs().max().item()), f"{name} on {world} ranks differs by {err}"
        for other in results[1:]:  # every rank holds the same answer
            assert torch.equal(other[name], got), name


def test_plan_rejects_what_cannot_run():
    with pytest.raises(UserError, match="valid for DiT3D: ulysses"):
        plan_for(random_model("dit3d-tiny"), SCHEDULES["scalefusion"])
    with pytest.raises(UserError, match="3 ranks > 2 heads"):
        plan_for(random_model("dit3d-tiny"), SCHEDULES["ulysses"], ranks=3)
    with pytest.raises(UserError, match="slices=0 must be an int in 1..64 or 'auto'"):
        ParallelConfig("scalefusion", 0)
    with pytest.raises(UserError, match="does not apply to the dsp schedule"):
        ParallelConfig("dsp", 4)
    with pytest.raises(UserError, match="valid: dsp, ulysses, scalefusion, scalefusion-inter, ring, usp, auto"):
        ParallelConfig("ringg")
    supported = "supported: DiT3D, STDiT, LatteTransformer3DModel, WanTransformer3DModel"
    with pytest.raises(UserError, match=f"model class Linear has no parallel plan; {supported}"):
        plan_for(torch.nn.Linear(2, 2), SCHEDULES["ulysses"])
    with pytest.raises(UserError, match=f"model class CogVideoXTransformer3DModel has no parallel plan; {supported}"):
        plan_for(tiny_model("cogvideox"), SCHEDULES["ulysses"])
    with pytest.raises(UserError, match="valid for WanTransformer3DModel: ulysses"):
        plan_for(tiny_model("wan"), SCHEDULES["scalefusion"])
    with pytest.raises(UserError, match="3 ranks > 2 heads of WanTransformer3DModel"):
        plan_for(tiny_model("wan"), SCHEDULES["ulysses"], ranks=3)
    slide = build_model(preset("dit3d-tiny", attention="slide", attention_options={"kernel_size": [1, 3, 3]}))
    with pytest.raises(UserError, match="cannot split SlideAttention3d by heads"):
        plan_for(slide, SCHEDULES["ulysses"], ranks=2)
