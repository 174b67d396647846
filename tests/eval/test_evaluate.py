"""`slidefusion evaluate`, the batched sampler it uses, and the attention-ablation smoke run."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from slidefusion.cli import main
from slidefusion.data.shapes import MovingShapes
from slidefusion.core.errors import UserError
from slidefusion.eval.ablation import BUDGETS, VARIANTS, paired_differences, run_ablation
from slidefusion.eval.evaluate import PROMPT_SEED, evaluate_ground_truth, evaluate_videos, held_out_prompts, read_prompts
from slidefusion.pipeline import VideoPipeline


def test_batched_sampling_equals_one_video_at_a_time():
    pipe = VideoPipeline.from_preset("dit3d-tiny", seed=3)
    prompts = ["a red circle moving left slowly", "a blue square moving up quickly on a gray background"]
    batch = pipe.latents_batch(prompts, [5, 9], frames=4, height=8, width=8, steps=3)
    for i, (prompt, seed) in enumerate(zip(prompts, [5, 9])):
        alone = pipe.latents(prompt, frames=4, height=8, width=8, steps=3, seed=seed, progress=False)
        torch.testing.assert_close(batch[i:i + 1], alone, rtol=1e-5, atol=1e-5)


def test_ground_truth_scores_high_and_mismatched_prompts_score_low():
    _, summary = evaluate_ground_truth(12, frames=8, height=32, width=32, progress=False)
    assert summary["aligned"] >= 0.9 and summary["videos"] == 12
    assert summary["temporal_flickering"] > 0.95 and summary["warping_error"] < 0.05
    # The same clips scored against the next clip's caption: colours mostly differ, alignment falls.
    data = MovingShapes(12, frames=8, height=32, width=32, seed=PROMPT_SEED, max_objects=1)
    clips, prompts = [data[i]["video"] for i in range(12)], [data[i]["caption"] for i in range(12)]
    _, rotated = evaluate_videos(clips, prompts[1:] + prompts[:1])
    assert rotated["aligned"] <= 0.3


def test_held_out_prompts_are_deterministic_and_parse():
    assert held_out_prompts(5) == held_out_prompts(5)
    assert len(set(held_out_prompts(20))) > 10


def test_read_prompts_cycles_and_rejects_bad_files(tmp_path):
    good = tmp_path / "prompts.txt"
    good.write_text("# comment\na red circle moving left slowly\n\nan orange square moving up quickly\n")
    assert read_prompts(good, 3) == ["a red circle moving left slowly", "an orange square moving up quickly",
                                     "a red circle moving left slowly"]
    bad = tmp_path / "bad.txt"
    bad.write_text("a purple elephant dancing\n")
    with pytest.raises(UserError, match="cannot parse|unknown"):
        read_prompts(bad, 1)
    with pytest.raises(UserError, match="no such file"):
        read_prompts(tmp_path / "missing.txt", 1)


def test_evaluate_cli_ground_truth_and_checkpoint(tmp_path, capsys):
    out = tmp_path / "gt.json"
    assert main(["evaluate", "--ground-truth", "--num", "4", "--json", str(out), "--quiet"]) == 0
    payload = json.loads(out.read_text())
    assert payload["summary"]["videos"] == 4 and len(payload["videos"]) == 4
    assert "text alignment" in capsys.readouterr().out

    out = tmp_path / "model.json"
    assert main(["evaluate", "--checkpoint", str(_bundled()), "--num", "2", "--steps", "2", "--json", str(out),
                 "--quiet"]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["videos"] == 2 and 0 <= summary["aligned"] <= 1 and summary["sampling_s_per_video"] > 0


def test_evaluate_cli_user_errors_exit_2(tmp_path, capsys):
    assert main(["evaluate", "--num", "2"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main(["evaluate", "--ground-truth", "--checkpoint", "x"]) == 2
    assert "--ground-truth" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", str(_bundled()), "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "argument --prompts" in (err := capsys.readouterr().err) and "does not exist" in err


def test_quick_ablation_runs_every_stage_and_resumes(tmp_path):
    logs = []
    results = run_ablation(BUDGETS["quick"], tmp_path, log=logs.append)
    for name in ("results.md", "results.json", "losses.png"):
        assert (tmp_path / name).stat().st_size > 0
    for length in ("short", "long"):
        rows = results["table"][length]
        assert set(VARIANTS) | {"ground truth", "pretrained (dense, short clips)"} == set(rows)
        assert rows["ground truth"]["aligned"] == 1.0
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {variant} |" in table for variant in VARIANTS)
    assert "slide minus each row at 8 frames" in table
    assert set(results["paired"]["long"]) == set(VARIANTS) - {"slide"} | {"pretrained (dense, short clips)"}
    # Every variant started from the pretrained dense weights; only slide adds (zero-initialised) offsets.
    assert any("slide: initialised" in line and "offset" in line for line in logs)
    assert any("neighborhood: initialised" in line and "new: none" in line for line in logs)

    again = []
    rerun = run_ablation(BUDGETS["quick"], tmp_path, log=again.append)
    assert sum("already trained" in line for line in again) == len(VARIANTS) + 1  # + the pretraining
    assert rerun["table"]["long"]["slide"] == results["table"]["long"]["slide"]  # videos re-scored, not resampled


def test_paired_differences_are_taken_video_by_video():
    nan = float("nan")
    ours = [{"aligned": a, "consistency": c} for a, c in ((True, 0.9), (True, 0.8), (False, nan), (False, 0.7))]
    theirs = [{"aligned": a, "consistency": c} for a, c in ((True, 0.8), (False, 0.8), (False, 0.5), (True, 0.9))]
    d = paired_differences(ours, theirs)
    assert d["aligned"] == 0.0 and d["aligned_se"] == pytest.approx((2 / 3) ** 0.5 / 2) and d["aligned_pairs"] == 4
    assert d["consistency"] == pytest.approx(-0.1 / 3) and d["consistency_pairs"] == 3  # the NaN pair left out
    assert d["consistency_se"] == pytest.approx(float(np.std([0.1, 0.0, -0.2], ddof=1)) / 3 ** 0.5)


def test_ablation_with_more_prompts_samples_only_the_new_ones(tmp_path):
    one = replace(BUDGETS["quick"], eval_videos=1)
    run_ablation(one, tmp_path, variants=["neighborhood"], log=lambda line: None)
    cache = tmp_path / "eval" / "neighborhood-8f.npz"
    first = np.load(cache)["videos"]
    run_ablation(BUDGETS["quick"], tmp_path, variants=["neighborhood"], log=lambda line: None)
    both = np.load(cache)
    assert both["prompts"].tolist() == held_out_prompts(2) and len(both["videos"]) == 2
    np.testing.assert_array_equal(both["videos"][:1], first)  # kept, not resampled
    # The new video is the one a fresh two-prompt run samples (seed 1), not a copy; a fresh run samples
    # both in one batch, which may change rounding only.
    fresh = tmp_path / "fresh"
    run_ablation(BUDGETS["quick"], fresh, variants=["neighborhood"], log=lambda line: None)
    batched = np.load(fresh / "eval" / "neighborhood-8f.npz")["videos"].astype(int)
    assert np.abs(batched - both["videos"]).max() <= 2
    assert np.abs(both["videos"][1].astype(int) - both["videos"][0]).max() > 20


def test_ablation_rejects_an_unknown_variant(tmp_path):
    with pytest.raises(UserError, match="valid: dense"):
        run_ablation(BUDGETS["quick"], tmp_path, variants=["sparse"])


def _bundled():
    from slidefusion.pipeline import bundled_checkpoint

    return bundled_checkpoint()



@pytest.mark.parametrize("name", [n for n, b in BUDGETS.items() if b.pretrain_steps is None])
def test_budgets_on_the_bundled_model_fit_it(name, tmp_path):
    """The budgets that reuse the demo model start from it, and every variant builds at their length."""
    from slidefusion.eval import ablation

    budget = BUDGETS[name]
    _, base = ablation._pretrained(budget, tmp_path, log=lambda line: None)
    for variant in VARIANTS:
        config = ablation._variant_config(base, budget, variant)
        assert config.data.frames == budget.long_frames and config.model.attention == VARIANTS[variant][0]
