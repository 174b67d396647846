import pytest
import torch

from slidefusion.training import Trainer, load_config


def _config(tmp_path, *overrides):
    return load_config(None, [
        "model.preset=dit3d-tiny", "data.frames=2", "data.height=8", "data.width=8",
        "run.batch_size=2", "run.log_every=1", "run.save_every=3", f"run.output_dir={tmp_path}",
        "run.name=t", "optim.warmup_steps=1", *overrides,
    ])


def test_resumed_run_repeats_the_uninterrupted_loss_sequence(tmp_path):
    straight = Trainer(_config(tmp_path / "a", "run.steps=6"), quiet=True).train().losses
    first = Trainer(_config(tmp_path / "b", "run.steps=6"), quiet=True)
    head = first.train(until=3).losses
    resumed = Trainer(_config(tmp_path / "b", "run.steps=6"), quiet=True)
    resumed.resume("latest")
    assert resumed.step == 3
    tail = resumed.train().losses
    assert len(straight) == 6 and head + tail == straight
    assert len(set(straight)) > 1  # the sequence is not trivially constant


def test_short_overfit_run_lowers_the_loss(tmp_path):
    # One fixed clip, no caption dropout: a tiny model must fit it.
    config = _config(tmp_path, "run.steps=60", "data.num_samples=1", "diffusion.caption_dropout=0",
                     "optim.lr=3e-3", "run.save_every=1000", "optim.ema_decay=null")
    losses = Trainer(config, quiet=True).train().losses
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10


def test_init_from_loads_matching_weights_into_another_attention(tmp_path):
    source = Trainer(_config(tmp_path, "run.steps=1", "run.name=dense"), quiet=True)
    path = source.train().last_checkpoint
    target = Trainer(_config(tmp_path, "run.name=window", "model.attention=window", "model.mlp_ratio=2.0"), quiet=True)
    loaded, skipped = target.init_from(path)
    assert "blocks.0.attn.qkv.weight" in loaded
    assert any(s.startswith("blocks.0.mlp.fc1.weight (shape") for s in skipped)
    weights = source.ema.shadow if source.ema is not None else source.model.state_dict()
    assert torch.equal(target.model.state_dict()["blocks.1.attn.proj.weight"], weights["blocks.1.attn.proj.weight"])


def test_mismatched_text_width_is_a_user_error(tmp_path):
    from slidefusion.core.errors import UserError

    with pytest.raises(UserError, match="model.text_dim=16 must equal the text encoder's width 384"):
        Trainer(_config(tmp_path, "model.text_dim=16"), quiet=True)


def test_latent_channels_must_match_the_model(tmp_path):
    from slidefusion.core.errors import UserError

    with pytest.raises(UserError, match="model.in_channels=4 must equal the autoencoder's latent channels 3"):
        Trainer(_config(tmp_path, "model.in_channels=4"), quiet=True)


def test_direction_contrast_runs_the_model_on_each_caption_and_its_negative(tmp_path):
    from slidefusion.training.task import with_negatives

    captions, has = with_negatives(["a red circle moving up quickly on a black background", ""],
                                   torch.Generator().manual_seed(0))
    assert has.tolist() == [True, False] and captions[1] == captions[3] == ""
    assert "moving up " not in captions[2] and captions[2].replace(captions[2].split()[4], "up") == captions[0]
    seen = []
    trainer = Trainer(_config(tmp_path, "run.steps=2", "diffusion.direction_contrast=1.0",
                              "diffusion.caption_dropout=0"), quiet=True)
    trainer.model.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    losses = trainer.train().losses
    assert seen == [4, 4] and all(loss == loss for loss in losses)  # 2 clips + 2 negatives per step, finite
