"""Fine-tuning diffusers folders through the CLI (`train configs/wan-finetune.yaml model.pretrained=DIR`):
offloaded equals resident (fp32 bitwise; bf16 against autocast), caches are written once and reused,
LoRA trains the adapters alone, resume and --init-from work as for our own models."""

import json

import pytest
import torch
from safetensors.torch import load_file

from slidefusion.cli import main
from slidefusion.testing.pipelines import PIXELS

CONFIG = "configs/wan-finetune.yaml"


def _args(folder, family, out, name, *extra):
    frames, height, width = PIXELS[family]
    return ["train", CONFIG, f"model.pretrained={folder}", "data.kind=shapes", "data.num_samples=3", f"data.frames={frames}",
            f"data.height={height}", f"data.width={width}", "run.device=cpu", "run.steps=3", "run.batch_size=2",
            "run.save_every=2", "run.log_every=1", f"run.output_dir={out}", f"run.name={name}", "optim.lr=1e-3",
            "optim.warmup_steps=0", "offload.compute_dtype=float32", "--quiet", *extra]


def _config(folder, family, out, name, *overrides):
    """The same run as a TrainConfig, for tests that drive the Trainer itself."""
    from slidefusion.training import load_config

    return load_config(CONFIG, [a for a in _args(folder, family, out, name, *overrides)[2:] if not a.startswith("--")])


def _run(folder, family, out, name, *extra):
    assert main(_args(folder, family, out, name, *extra)) == 0
    losses = [json.loads(line)["loss"] for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return losses, load_file(out / name / "checkpoint-3" / "model.safetensors")


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _close(a: dict, b: dict, base: dict, steps: int = 3, lr: float = 1e-3) -> None:
    """Offloaded against resident fp32 training. The engine's per-block backward (recomputed under
    activation checkpointing) sums some gradients in another order, so weights part by an ulp; and a
    weight whose true gradient is zero (a key bias before a softmax without a key norm, e.g.
    HunyuanVideo's token refiner) gets pure rounding noise, which Adam scales to steps of up to lr.
    So: every element within 2 * steps * lr, and in aggregate far closer than training moved them."""
    assert a.keys() == b.keys()
    moved = sum((b[k] - base[k]).abs().sum().item() for k in base if k in b)
    apart = sum((a[k] - b[k]).abs().sum().item() for k in b)
    assert apart <= 1e-4 * moved, (apart, moved)
    for name, value in b.items():
        assert (a[name] - value).abs().max().item() <= 2 * steps * lr + 1e-5 * value.abs().max().item(), name


def test_wan_fine_tunes_offloaded_as_resident_and_caches_once(tiny_pipeline_dir, tmp_path):
    from slidefusion.pretrained import load_transformer

    folder = tiny_pipeline_dir("wan")
    resident = _run(folder, "wan", tmp_path, "resident")
    offloaded = _run(folder, "wan", tmp_path, "offloaded", "--offload")
    torch.testing.assert_close(offloaded[0], resident[0], rtol=1e-5, atol=0)
    assert len(resident[0]) == 3
    base = load_transformer(folder).state_dict()
    _close(offloaded[1], resident[1], base)
    assert resident[1].keys() == base.keys() and any(not torch.equal(resident[1][k], base[k]) for k in base)
    cache = tmp_path / "resident" / "cache"
    latents, texts = sorted((cache / "latents").rglob("*.safetensors")), sorted((cache / "text").iterdir())
    assert len(latents) == 3 and len(texts) == 4  # 3 clips, their 3 captions and ""
    stamps = {p: p.stat().st_mtime_ns for p in [*latents, *texts]}
    _run(folder, "wan", tmp_path, "again", f"data.cache_dir={cache}")  # another run reads the same cache
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps and not (tmp_path / "again" / "cache").exists()
    text = load_file(texts[0])
    assert text["states"].shape[0] < 512 and "mask" not in text  # Wan's zero padding is not stored


def test_wan_fine_tunes_tiled_as_whole_blocks(tiny_pipeline_dir, tmp_path, monkeypatch):
    """`train --offload offload.tile=2` on a Wan folder of 3 latent frames (the tile does not divide
    them): the self-attention sees 2-frame query tiles, and training equals whole blocks up to the
    order of summation."""
    from slidefusion.attention.redirect import StockQueryTiles
    from slidefusion.pretrained import load_transformer

    folder, frames = tiny_pipeline_dir("wan"), "data.frames=9"
    whole = _run(folder, "wan", tmp_path, "whole", "--offload", frames)
    queries, attend = [], StockQueryTiles.tile_attend
    monkeypatch.setattr(StockQueryTiles, "tile_attend", lambda self, y, *a, **k: queries.append(y.shape[1]) or attend(self, y, *a, **k))
    tiled = _run(folder, "wan", tmp_path, "tiled", "--offload", "offload.tile=2", frames)
    assert set(queries) == {2 * 3 * 5, 1 * 3 * 5}  # 3x5 tokens per frame: tiles [0, 2) and [2, 3)
    torch.testing.assert_close(tiled[0], whole[0], rtol=1e-5, atol=0)
    _close(tiled[1], whole[1], load_transformer(folder).state_dict())


@pytest.mark.parametrize("family", ["cogvideox", "hunyuanvideo", "ltx", "mochi", "latte"])
def test_every_family_fine_tunes_offloaded_as_resident(tiny_pipeline_dir, tmp_path, family):
    from slidefusion.pretrained import load_transformer

    folder = tiny_pipeline_dir(family)
    resident = _run(folder, family, tmp_path, "resident")
    offloaded = _run(folder, family, tmp_path, "offloaded", "--offload")
    assert all(torch.isfinite(torch.tensor(resident[0])))
    torch.testing.assert_close(offloaded[0], resident[0], rtol=1e-5, atol=0)
    _close(offloaded[1], resident[1], load_transformer(folder).state_dict())


def test_lora_trains_adapters_only_and_leaves_the_base_bitwise_unchanged(tiny_pipeline_dir, tmp_path):
    from slidefusion.pretrained import load_transformer
    from slidefusion.training import Trainer

    folder = tiny_pipeline_dir("wan")
    lora = ["lora.rank=4", "lora.alpha=8"]
    resident = _run(folder, "wan", tmp_path, "resident", *lora)
    offloaded = _run(folder, "wan", tmp_path, "offloaded", "--offload", *lora)
    torch.testing.assert_close(offloaded[0], resident[0], rtol=1e-5, atol=0)
    _close(offloaded[1], resident[1], {k: torch.zeros_like(v) for k, v in resident[1].items()})
    assert resident[1] and all(".lora_A." in k or ".lora_B." in k for k in resident[1])
    assert any(v.abs().max() > 0 for k, v in resident[1].items() if ".lora_B." in k)  # B starts at 0 and moved
    # the engine itself: the frozen weights stream host -> device only and hold their compute copy alone
    trainer = Trainer(_config(folder, "wan", tmp_path, "engine", *lora, "offload.enabled=true"), quiet=True)
    trainer.train()
    engine, base = trainer.optimizer, load_transformer(folder).state_dict()
    weights = engine.model_state_dict()
    for name, value in base.items():
        key = next(k for k in (name, name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias"))
                   if k in weights)
        assert torch.equal(weights[key], value), name
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert engine.stats.frozen_bytes_per_param == 4 and engine.stats.d2h_bytes == 3 * trainable * 4


def test_resume_continues_exactly_and_init_from_starts_from_a_checkpoint(tiny_pipeline_dir, tmp_path):
    folder = tiny_pipeline_dir("wan")
    straight = _run(folder, "wan", tmp_path, "straight", "--offload", "lora.rank=4")
    assert main(_args(folder, "wan", tmp_path, "split", "--offload", "lora.rank=4", "run.steps=2")) == 0
    resumed = _run(folder, "wan", tmp_path, "split", "--offload", "lora.rank=4", "--resume", "latest")
    assert resumed[0] == straight[0]
    _same(resumed[1], straight[1])
    full = _run(folder, "wan", tmp_path, "full")
    from slidefusion.training import Trainer

    trainer = Trainer(_config(folder, "wan", tmp_path, "init"), quiet=True)
    loaded, skipped = trainer.init_from(tmp_path / "full")
    assert not skipped and len(loaded) == len(full[1])
    _same({k: v for k, v in trainer.model.state_dict().items()}, full[1])


def test_bf16_offloaded_tracks_resident_under_autocast(tiny_pipeline_dir, tmp_path):
    """Wan at matched precision: the engine computes from a bf16 copy of its fp32 master weights, the
    resident model runs under bf16 autocast; both keep fp32 weights and AdamW state."""
    from slidefusion.pretrained import load_transformer
    from slidefusion.training import Trainer

    folder = tiny_pipeline_dir("wan")
    common = ("run.steps=6", "optim.lr=3e-3")
    offloaded = Trainer(_config(folder, "wan", tmp_path, "bf16", *common, "offload.enabled=true",
                                "offload.compute_dtype=bfloat16"), quiet=True)
    resident = Trainer(_config(folder, "wan", tmp_path, "autocast", *common), quiet=True)
    loss_fn = resident.loss_fn

    def autocast_loss(generator):
        inner = loss_fn(generator)

        def loss(model):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return inner(model)

        return loss

    resident.loss_fn = autocast_loss
    expected, losses = resident.train().losses, offloaded.train().losses
    torch.testing.assert_close(losses, expected, rtol=3e-2, atol=0)
    initial = load_transformer(folder).state_dict()
    ours, theirs = offloaded.optimizer.model_state_dict(), resident.model.state_dict()
    moved = sum((theirs[k] - v).abs().sum().item() for k, v in initial.items())
    apart = sum((ours[k] - theirs[k]).abs().sum().item() for k in initial)
    assert apart <= 0.05 * moved, (apart, moved)


def test_an_offload_plan_that_does_not_fit_is_refused_before_any_cache(tiny_pipeline_dir, tmp_path, monkeypatch, capsys):
    import slidefusion.offload.plan.resolve as seam
    from slidefusion.core.errors import UserError

    def refuse(plan):
        raise UserError("does not fit: host needs 215 GB but has 128 GB")

    monkeypatch.setattr(seam, "require_fit", refuse)
    assert main(_args(tiny_pipeline_dir("wan"), "wan", tmp_path, "big", "--offload")) == 2
    assert "does not fit" in capsys.readouterr().err and not (tmp_path / "big" / "cache").exists()
