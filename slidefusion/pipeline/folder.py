"""Text-to-video with a diffusers pipeline folder, or with a fine-tune of one, in one process.

    pipe = FolderPipeline.from_pretrained("Wan2.1-T2V-1.3B-Diffusers")   # or VideoPipeline.from_pretrained
    latents = pipe.latents("a cat", frames=33, height=480, width=832, steps=30, guidance=5.0, seed=0)
    out = pipe("a cat", num_frames=33, height=480, width=832, generator=torch.Generator().manual_seed(0))

Sampling is `slidefusion.pretrained.sampling` (the folder's scheduler, its prompt encoding and
noise layout), the same loop `generate --pretrained --parallel` runs on every rank; a seed gives
the latents of the family's own diffusers pipeline called with `torch.Generator().manual_seed(seed)`.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from slidefusion.core import validate
from slidefusion.core.errors import UserError, check
from slidefusion.io.checkpoint import first_nonfinite
from slidefusion.io.diffusers import is_pipeline_folder as is_diffusers_folder  # noqa: F401  (re-exported)
from slidefusion.io.files import atomic_folder
from slidefusion.pipeline.call import OPENERS, DiffusersCall, NoiseFn, check_finite, refuse_existing
from slidefusion.pipeline.parallel import maybe_parallel
from slidefusion.swap import use_slide_attention


@dataclass
class FolderPipeline(DiffusersCall):
    """`parts`: the folder's components (`slidefusion.pretrained.PretrainedParts`)."""

    parts: object
    device: torch.device

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        transformer: str | Path | None = None) -> FolderPipeline:
        """The folder's components; `transformer`: a single-file transformer replacing its own weights."""
        from slidefusion.pretrained import PretrainedParts
        from slidefusion.pretrained.source import open_folder_with

        return cls(PretrainedParts.load(open_folder_with(path, transformer), dtype), torch.device("cpu")).to(device)

    @classmethod
    def from_checkpoint(cls, ckpt, config, device: str = "cpu") -> FolderPipeline:
        """The source folder of a fine-tune with the checkpoint's (EMA) weights in its transformer:
        every weight of a full fine-tune, or LoRA's adapters added to the base; a run with
        model.attention=slide samples with the slide attention (and offsets) it trained."""
        from slidefusion.pretrained import PretrainedParts, lora
        from slidefusion.pretrained.source import open_folder_with

        parts = PretrainedParts.load(open_folder_with(config.model.pretrained, config.model.transformer,
                                                      config.model.expert))
        names = [e.name for e in parts.folder.experts()]
        model = parts.experts[names.index(config.model.expert)][0]
        weights = ckpt.sampling_weights
        bad = first_nonfinite(weights)
        check(bad is None, f"checkpoint {ckpt.path}: weight {bad} holds NaN or infinity; sample from an earlier checkpoint")
        if config.model.slide is not None:  # as the run swapped it, before LoRA: the offsets are in the weights
            use_slide_attention(model, **dataclasses.asdict(config.model.slide))
        if config.lora.enabled:
            lora.add_lora(model, config.lora, parts.adapter.lora_targets)
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        expected_missing = [k for k in missing if not (config.lora.enabled and not lora.is_lora_weight(k))]
        if expected_missing or unexpected:
            raise UserError(f"checkpoint {ckpt.path}: its weights do not fit {config.model.pretrained} "
                            f"(e.g. {(expected_missing or unexpected)[0]}); was the folder changed since the run?")
        model.eval()
        return cls(parts, torch.device("cpu")).to(device)

    def load_lora(self, path: str | Path, scale: float = 1.0) -> FolderPipeline:
        """Merge a LoRA (a file, or a folder holding one) into the transformer it was trained for:
        `export --format diffusers` or `--format comfyui` output (see `slidefusion.io.lora_files`),
        weighted by `scale` on top of its own alpha / rank. Returns self."""
        from slidefusion.pretrained.lora_merge import apply_lora

        apply_lora(self.parts, path, validate.finite(scale, "lora_scale"), "lora")
        return self

    def save_pretrained(self, path: str | Path, force: bool = False) -> Path:
        """A diffusers pipeline folder of these components, written by the family's pipeline class."""
        import diffusers

        path = refuse_existing(path, force)
        parts = self.parts
        root, target = parts.folder.root.resolve(), path.resolve()
        check(not (target == root or root in target.parents or target in root.parents),
              f"save_pretrained: {path} is, is inside or holds the folder {root} these components were loaded "
              "from; give a path apart from it")
        cls = getattr(diffusers, parts.folder.pipeline_class)
        accepted = inspect.signature(cls.__init__).parameters
        components = {name: getattr(parts, name, None) for name in accepted if hasattr(parts, name)}
        for (model, _), expert in zip(parts.experts, parts.folder.experts()):
            components[expert.name] = model
        extras = {k: v for k, v in (parts.folder.index or {}).items() if k in accepted and k not in components
                  and not isinstance(v, list)}
        with atomic_folder(path) as tmp:
            cls(**{k: v for k, v in components.items() if k in accepted}, **extras).save_pretrained(str(tmp))
        return path

    def to(self, device) -> FolderPipeline:
        """Move every component (transformers, text encoders, VAE); returns self."""
        self.device = validate.device(str(device), "device")
        for module in [m for m, _ in self.parts.experts] + [self.parts.text_encoder, self.parts.text_encoder_2,
                                                             self.parts.vae, self.parts.image_encoder]:
            if module is not None:
                module.to(self.device)
        return self

    @property
    def adapter(self):
        return self.parts.adapter

    @property
    def fps(self) -> int:
        return self.parts.adapter.fps

    def default_sizes(self) -> dict:
        """The family's diffusers defaults (`num_frames`, `height`, `width`, steps, guidance) where it has them."""
        import diffusers

        params = inspect.signature(getattr(diffusers, self.parts.folder.pipeline_class).__call__).parameters
        found = {ours: params[theirs].default for ours, theirs in (
            ("frames", "num_frames"), ("frames", "video_length"), ("height", "height"), ("width", "width"),
            ("steps", "num_inference_steps"), ("guidance", "guidance_scale"))
            if theirs in params and params[theirs].default not in (None, inspect.Parameter.empty)}
        return found

    def draw_noise(self, shape, generator) -> Tensor:
        from slidefusion.pretrained import initial_noise

        return initial_noise(self.parts.adapter, shape, generator)

    @torch.no_grad()
    def decode_batch(self, latents: Tensor, parallel=None, tracer=None) -> Tensor:
        """Latents (B, C, T', H', W') -> videos (B, 3, F, H, W) in [-1, 1], on the CPU; under `parallel`
        the decode is split over the process group's ranks where the VAE allows it (`parallel.decode`)."""
        from slidefusion.vae import check_decoded

        if parallel is not None:
            from slidefusion.parallel import Comm, decode_video

            return check_decoded(decode_video(self.parts.vae, latents.to(self.device), Comm(tracer=tracer)).cpu())
        from slidefusion.pretrained import decode

        return check_decoded(decode(self.parts, latents.to(self.device)))

    @torch.no_grad()
    def latents(self, prompt: str, *, frames: int | None = None, height: int | None = None, width: int | None = None,
                steps: int = 30, guidance: float = 5.0, seed: int = 0, negative_prompt: str = "",
                progress: bool = True, parallel=None, tracer=None, image=None) -> Tensor:
        """Final latents (1, C, T', H', W') of one prompt, noise from `seed`; across the ranks under
        `parallel` (a `ParallelConfig`; every rank calls alike and gets the same latents); `image`: the
        first frame (a PIL image) of an image-to-video model."""
        return self.latents_batch([prompt], [seed], frames=frames, height=height, width=width, steps=steps,
                                  guidance=guidance, negative_prompt=negative_prompt, progress=progress,
                                  parallel=parallel, tracer=tracer, image=image)

    @torch.no_grad()
    def latents_batch(self, prompts: list[str], seeds: list[int], *, frames: int | None = None,
                      height: int | None = None, width: int | None = None, steps: int = 30, guidance: float = 5.0,
                      negative_prompt: str = "", progress: bool = False, parallel=None, tracer=None,
                      image=None) -> Tensor:
        """Latents (B, C, T', H', W'); video i starts from the noise of seed `seeds[i]` alone."""
        noise = self.seeded_noise(prompts, seeds)
        sizes = {**self.default_sizes(), **{k: v for k, v in dict(frames=frames, height=height, width=width).items()
                                           if v is not None}}
        return self.sample_latents(list(prompts), [negative_prompt] * len(prompts), noise, frames=sizes.get("frames"),
                                   height=sizes.get("height"), width=sizes.get("width"), steps=steps,
                                   guidance=guidance, progress=progress, parallel=parallel, tracer=tracer,
                                   image=image)

    @torch.no_grad()
    def sample_latents(self, prompts: list[str], negatives: list[str], noise: NoiseFn, *, frames: int | None,
                       height: int | None, width: int | None, steps: int, guidance: float,
                       progress: bool = False, parallel=None, tracer=None, image=None) -> Tensor:
        """Latents (B, C, T', H', W') from `noise(shape)`, by the folder's scheduler loop; under
        `parallel` with the folder's transformers parallel for the call; `image` (a PIL image)
        conditions an image-to-video model (`slidefusion.pretrained.image`)."""
        from slidefusion.pretrained import denoise, encode_prompts, latent_shape
        from slidefusion.pretrained.image import check_image_use, image_condition

        parts = self.parts
        for key, value in (("frames", frames), ("height", height), ("width", width)):
            check(isinstance(value, int) and value >= 1, f"{key} must be given for {parts.folder.pipeline_class} "
                                                         f"(a positive int), got {value!r}")
        check(all(p.strip() for p in prompts), "prompt must be a non-empty text")
        validate.finite(guidance, "guidance", 0)
        shape = latent_shape(parts.adapter, parts.transformer, parts.vae.config, frames, height, width,
                             type(parts.vae).__name__)
        initial = noise((len(prompts), *shape[1:])).to(self.device)
        cond = encode_prompts(parts, prompts)
        guided = guidance != 1.0 and parts.adapter.guidance == "cfg"
        uncond = encode_prompts(parts, negatives) if guided else None
        if check_image_use(parts.folder, image is not None, "image") is not None and image is not None:
            check(parallel is None, "image= does not run under parallel= yet; sample it in one process")
            states, video = image_condition(parts, image, initial, frames, height, width)
            cond = dataclasses.replace(cond, image=states, video=video)  # the same image for both halves of CFG
            uncond = None if uncond is None else dataclasses.replace(uncond, image=states, video=video)
        with maybe_parallel([model for model, _ in parts.experts], parallel, tuple(initial.shape), guidance, tracer):
            latents = denoise(parts, initial, cond, uncond, steps, guidance, progress)
        check_finite(latents, guidance, steps)
        return latents


OPENERS.update({"folder": FolderPipeline.from_pretrained, "fine-tune": FolderPipeline.from_checkpoint})
