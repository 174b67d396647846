"""Validation during a fine-tune: sample videos of fixed prompts, and a held-out loss.

Samples are what `slidefusion generate --checkpoint RUN/checkpoint-N` would make of the same prompt,
size, steps, guidance and seed: the folder's scheduler loop (`pretrained.denoise`) on the model being
trained, the prompt's text states from the run's cache (encoded once, as the captions are), noise
from `seed + i` for prompt i, decoded by the folder's VAE. Under --offload the model is the engine's:
each forward streams the blocks from its host weights (`offload.engine.inference`), so no second copy of
the model exists. They go to RUN/samples/step-N/NN-<prompt>.mp4 and to TensorBoard / W&B.

The held-out loss (`validate.data`) is the training loss of every held-out clip at FIXED_T fixed
timesteps (evenly spaced quantiles of the training distribution) with noise from fixed seeds, so
it moves only when the weights do.

Samples are drawn from the weights being trained; with `optim.ema_decay` set, `generate --checkpoint`
samples the EMA copy instead. A folder with two transformers (Wan 2.2 A14B) is not sampled here.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from slidefusion.core.errors import UserError, check

FIXED_T = 4  # timesteps per held-out clip


def _slug(prompt: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40] or "prompt"


class Validator:
    """Set up by `FolderTask` (checks first, before any file is scanned); run by the trainer."""

    def __init__(self, config, task, quiet: bool):
        from slidefusion.pretrained import latent_shape

        self.config, self.task, self.quiet = config, task, quiet
        val, data = config.validate, config.data
        self.prompts = val.prompt_list()
        self.size = (val.frames or data.frames, val.height or data.height, val.width or data.width)
        if self.prompts:
            check(len(task.folder.experts()) == 1, "validate.prompts: sampling during training needs a folder with "
                  "one transformer; sample a two-expert run's checkpoints with generate --checkpoint")
            try:
                latent_shape(task.adapter, task.model, self._vae_config(), *self.size)
            except UserError as error:
                raise UserError(f"validate.frames/height/width {list(self.size)}: {error}") from None
        self.heldout, self.cache, self.heldout_cache, self.vae = None, None, None, None

    def _vae_config(self) -> dict:
        return self.task.vae_config  # read once, by `open_source`

    def scan(self, rules) -> None:
        """The held-out clips (`validate.data`), scanned and tabled as the training data."""
        from slidefusion.data.sources import format_table, scan

        sources = self.config.validate.data
        if sources is None:
            return
        self.heldout, reports = scan([(s, f"validate.data[{i}]") for i, s in enumerate(sources)], rules,
                                     self.config.data.strict)
        if not self.quiet:
            print(format_table(reports))

    def caches(self, root: Path, identities: tuple, spec) -> list:
        """(cache, texts to encode) of the prompts, "" and the held-out clips, for `FolderTask._cache`."""
        from slidefusion.data.sources import ClipSet
        from slidefusion.training.finetune.caches import FinetuneCache

        clips = self.heldout if self.heldout is not None else ClipSet([])
        self.heldout_cache = FinetuneCache(root, self.config.data, clips, *identities, spec)
        return [(self.heldout_cache, [*clips.captions, *self.prompts, ""])]

    def due(self, step: int, last: int) -> bool:
        return step % self.config.validate.every == 0 or step == last

    # ------------------------------------------------------------------ running
    def run(self, trainer, log) -> dict:
        """Samples and the held-out loss at the trainer's step; returns the metrics record."""
        start = time.perf_counter()
        record = {}
        model = trainer.model
        was_training = model.training
        model.eval()
        try:
            with self._forward_context(trainer):
                if self.prompts:
                    record["samples"] = len(self._samples(trainer, model, log))
                if self.heldout is not None:
                    record["heldout_loss"] = self._heldout_loss(trainer, model)
        finally:
            model.train(was_training)
        record["validation_s"] = round(time.perf_counter() - start, 3)
        return record

    def _forward_context(self, trainer):
        from slidefusion.offload import OffloadEngine

        if isinstance(trainer.optimizer, OffloadEngine):
            from slidefusion.offload.engine.inference import streamed_inference

            return streamed_inference(trainer.optimizer)
        return _no_grad()

    def sample_latents(self, model, device, prompt: str, seed: int):
        """The latents (1, C, T, H, W) `generate --checkpoint` would draw for `prompt` and `seed`."""
        from slidefusion.pipeline.ours import check_finite
        from slidefusion.pretrained import PretrainedParts, denoise, initial_noise, latent_shape, load_scheduler

        val, task = self.config.validate, self.task
        parts = PretrainedParts(task.folder, task.adapter, [(model, 0.0)], None, None, None, load_scheduler(task.folder))
        shape = latent_shape(task.adapter, model, self._vae_config(), *self.size)
        noise = initial_noise(task.adapter, shape, torch.Generator().manual_seed(seed)).to(device)
        cond = self.heldout_cache.text([prompt])
        guided = val.guidance != 1.0 and task.adapter.guidance == "cfg"
        uncond = self.heldout_cache.text([""]) if guided else None
        latents = denoise(parts, noise, cond, uncond, val.steps, val.guidance)
        check_finite(latents, val.guidance, val.steps)
        return latents

    def _samples(self, trainer, model, log) -> list[Path]:
        from slidefusion.data.video_io import to_uint8, write_video

        folder = trainer.run_dir / "samples" / f"step-{trainer.step}"
        written = []
        for i, prompt in enumerate(self.prompts):
            latents = self.sample_latents(model, trainer.device, prompt, self.config.validate.seed + i)
            video = self._decode(latents, trainer.device)  # (3, F, H, W) in [-1, 1]
            path = write_video(folder / f"{i:02d}-{_slug(prompt)}.mp4", video, fps=self.task.adapter.fps)
            log.video(f"validate/{i:02d}", to_uint8(video), trainer.step, self.task.adapter.fps, path)
            written.append(path)
        return written

    def _decode(self, latents: torch.Tensor, device) -> torch.Tensor:
        """The folder's VAE, kept on the CPU between validations and moved to `device` for a decode."""
        from slidefusion.pretrained import load_vae
        from slidefusion.vae import DiffusersVideoAutoencoder

        if self.vae is None:
            self.vae = load_vae(self.task.folder)
        try:
            with torch.no_grad():
                return DiffusersVideoAutoencoder(self.vae.to(device)).decode(latents.to(device))[0].cpu()
        finally:
            self.vae.to("cpu")

    def _heldout_loss(self, trainer, model) -> float:
        """Mean loss of every held-out clip at FIXED_T fixed timesteps and fixed noise."""
        task, cache, device = self.task, self.heldout_cache, trainer.device
        total, count = 0.0, 0
        for index in range(len(self.heldout)):
            x0 = cache.latents([index]).to(device)
            text = _to_device(cache.text([self.heldout.captions[index]]), device)
            tokens = task.adapter.tokens(model, x0.shape)
            for k, t in enumerate(task.objective.fixed_t(FIXED_T, tokens)):
                generator = torch.Generator().manual_seed(self.config.validate.seed * 1_000_003 + index * FIXED_T + k)
                noise = torch.randn(x0.shape, generator=generator)
                total += task.objective.loss_at(model, x0, text, t.view(1), noise).item()
                count += 1
        return total / max(1, count)


@contextmanager
def _no_grad():
    with torch.no_grad():
        yield


def _to_device(text, device):
    return type(text)(text.states.to(device), None if text.mask is None else text.mask.to(device),
                      None if text.pooled is None else text.pooled.to(device), text.guidance)

