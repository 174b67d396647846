"""`FinetuneSource`: what a fine-tune of one transformer of a pipeline folder needs to know before any
weight is read, decided in one pass over the folder.

    source = open_source("Wan2.1-T2V-1.3B-Diffusers", "transformer", (33, 480, 832))
    source.meta            # the transformer on the meta device (parameters take no memory)
    source.latent          # (C, T, H, W) latents of one clip; source.grid: its token grid (T', H', W')

The checks run cheapest first and each once: the folder is a pipeline folder of a supported class,
the expert is one of its transformers, every weight shard is there, and the clip's size suits the VAE
and the patch; a mistake is one UserError naming the config key. A run with several clip sizes
(buckets) passes a function instead of one size: it checks every size against the folder's facts
and returns the largest, which `latent` and `grid` (and so the memory plan) then describe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from slidefusion.core.errors import UserError, check
from slidefusion.families import ModelAdapter
from slidefusion.pretrained.build import build_on_meta
from slidefusion.pretrained.components import load_scheduler
from slidefusion.pretrained.folder import PretrainedFolder, open_folder


@dataclass
class FinetuneSource:
    """One transformer of a pipeline folder, ready to be adapted and trained; sizes in latent units."""

    folder: PretrainedFolder
    expert: str  # "transformer", or Wan 2.2 A14B's "transformer_2"
    adapter: ModelAdapter  # with the options the folder's pipeline sets
    meta: nn.Module  # built from config.json on the meta device
    vae_config: dict  # the VAE's config.json
    latent: tuple[int, int, int, int]  # (C, T, H, W) of one clip
    grid: tuple[int, int, int]  # (T', H', W') tokens of one clip
    timesteps: tuple[float, float] | None  # [low, high) this expert denoises (None: all)
    scheduler: object  # the folder's diffusers scheduler


ClipSizes = Callable[[ModelAdapter, nn.Module, dict], tuple[int, int, int]]  # (adapter, meta, VAE config) -> clip


def open_source(path: str, expert: str, clip: tuple[int, int, int] | ClipSizes,
                transformer: str | None = None) -> FinetuneSource:
    """See the module docstring; `clip` is the training clip (frames, height, width) in pixels, or a
    function of (adapter, meta model, VAE config) that checks the run's sizes and returns the largest
    (its UserError names its own config keys); `transformer` (model.transformer): a single-file
    transformer whose weights replace the expert's own, checked against the expert's config here
    (`PretrainedFolder.transformer_files`)."""
    from slidefusion.pretrained.parts import folder_adapter
    from slidefusion.pretrained.sampling import latent_shape

    folder = open_folder(path)  # what the folder holds, asked first and once
    check(folder.is_pipeline, f"model.pretrained={path} is a bare transformer folder; training needs a "
                              "pipeline folder (model_index.json with text_encoder/, tokenizer/, vae/, scheduler/)")
    check(expert in folder.transformer_names, f"model.expert={expert} is not in {folder.root}; valid: "
                                              f"{', '.join(folder.transformer_names)}")
    if transformer is not None:
        folder = _with_file(folder, transformer, expert, "model.transformer")
    folder.weight_entries(expert)  # every shard (or the single file) there, before anything is cached
    vae_config, experts = folder.component_config("vae"), folder.experts()
    mine = next(e for e in experts if e.name == expert)
    timesteps = None if len(experts) == 1 else (mine.low, mine.high)
    adapter = folder_adapter(folder, vae_config, expert)  # then the model, its sizes and its scheduler
    meta = build_on_meta(folder, expert)
    frames, height, width = clip(adapter, meta, vae_config) if callable(clip) else clip
    try:
        latent = latent_shape(adapter, meta, vae_config, frames, height, width)[1:]
    except UserError as error:
        raise UserError(f"data.frames/height/width: {error}") from None
    return FinetuneSource(folder, expert, adapter, meta, vae_config, latent, adapter.token_grid(meta, (1, *latent)),
                          timesteps, load_scheduler(folder))


def open_folder_with(path, transformer: str | Path | None = None, expert: str = "transformer",
                     what: str = "model.transformer") -> PretrainedFolder:
    """`open_folder(path)`, and with `transformer` (a single-file transformer: Wan's original layout,
    as ComfyUI ships it, or diffusers') that file's weights in place of `expert`'s own, after checking
    its names and shapes against the expert's config (`what` names it in errors)."""
    folder = open_folder(path)
    return folder if transformer is None else _with_file(folder, transformer, expert, what)


def _with_file(folder: PretrainedFolder, path: str | Path, expert: str, what: str) -> PretrainedFolder:
    from slidefusion.families import original_layout
    from slidefusion.io.single_file import check_entries, single_file_entries

    name = expert if folder.is_pipeline else ""  # a bare folder's one transformer is ""
    check(name in folder.transformer_names, f"{what}: {folder.root} has no {expert}; valid: "
                                            f"{', '.join(folder.transformer_names)}")
    path = Path(path).expanduser()
    adapter = folder.adapter(name)
    layout = original_layout(adapter, f"{what}: a single-file transformer")
    entries = single_file_entries(path, layout, adapter.class_name, what)
    check_entries(entries, build_on_meta(folder, name, check_weights=False), path, folder.root, what)
    return dataclasses.replace(folder, transformer_files={**folder.transformer_files, name: path})
