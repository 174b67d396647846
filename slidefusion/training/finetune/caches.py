"""Latents and text states of a fine-tune, computed once before the first step and read from disk after.

As in musubi-tuner, every clip's latents and every caption's text states are one safetensors file,
named by a hash of what determines them, so a cache is reused by any run that would compute the
same tensors and never by one that would not:

    CACHE/latents/FxHxW/<sha>.safetensors
                                      "latents" (C, T, H, W) float32, one folder per bucket (F x H x W
                                      pixels); key: the clip (file, its size and mtime, its frames,
                                      bucket and resize, or the procedural seed and index) and the VAE
    CACHE/text/<sha>.safetensors      "states" (L, D) float32, "mask" (L,) uint8 (families that take
                                      one), "pooled" (P,) (HunyuanVideo); key: the caption and the
                                      text encoders and tokenizers (their files)
    CACHE/image/<sha>.safetensors     image-to-video folders: the clip's first frame as the condition,
                                      "video" (C_v, T, H, W) and, for Wan 2.1 I2V, "states" (L, D)
                                      (`slidefusion.pretrained.image`); key: the clip, the VAE and the
                                      image encoder (their files), the mode

Each file is written to a temporary name and renamed into place. Wan's states end in zeros (its
pipeline zero-pads to 512 tokens), so only the rows up to the last non-zero one are stored and the
batch pads them back; other families' padding states are the encoder's own and are kept whole.
Latents are the VAE posterior's mean (deterministic: the cache does not depend on a seed).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm

from slidefusion.core.errors import UserError
from slidefusion.families import TextConditioning
from slidefusion.io.diskfull import writing
from slidefusion.io.partial import remove_abandoned_files

FORMAT = "slidefusion.finetune_cache/1"


def _digest(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32]


def component_identity(folder, names: list[str]) -> dict:
    """What identifies some components of a folder: each file's relative path, size and mtime."""
    files = {}
    for name in names:
        root = folder.component_dir(name)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            stat = path.stat()
            files[f"{name}/{path.relative_to(root).as_posix()}"] = [stat.st_size, stat.st_mtime_ns]
    return files


def clip_identity(data, dataset, index: int) -> dict:
    """What determines clip `index` of a `DataConfig`'s dataset, before the VAE (a scanned `ClipSet`
    says it itself: file, frames, bucket, resize)."""
    if hasattr(dataset, "identity"):
        return dataset.identity(index)
    record = {"kind": data.kind, "index": index, "frames": data.frames, "height": data.height, "width": data.width}
    if data.kind == "shapes":
        record.update(seed=data.seed, max_objects=data.max_objects)
    else:
        path = Path(dataset.files[index])
        stat = path.stat()
        record.update(file=str(path.resolve()), size=stat.st_size, mtime=stat.st_mtime_ns, stride=data.stride)
    return record


TEMPORARY = re.compile(r"^\.[0-9a-f]{32}\.safetensors\.[a-z0-9_]+\.tmp$")  # what `_write` names its temporaries


def _bucket_folder(data, dataset, index: int) -> str:
    """The latents' subfolder: one per bucket (frames x height x width in pixels)."""
    bucket = dataset.buckets[index] if hasattr(dataset, "buckets") else None
    return str(bucket) if bucket is not None else f"{data.frames}x{data.height}x{data.width}"


def _write(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Write to a locked temporary, then rename: a kill leaves only a temporary no reader opens,
    and the next `fill` removes it once its lock is free (`slidefusion.io.partial`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd)


def _read(path: Path) -> dict[str, Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as error:  # noqa: BLE001 - a damaged file can make the parser raise anything
        raise UserError(f"cache file {path} cannot be read ({type(error).__name__}); delete it to recompute it") from None


class FinetuneCache:
    """The caches of one run: `latents(indices)` and `text(captions)` read them for a batch.

    `vae_id` / `text_id` identify the VAE and the text encoders (`component_identity`); `spec` is
    the adapter's `TextSpec` (its max_length and padding say how a batch pads states)."""

    def __init__(self, root: Path, data, dataset, vae_id: dict, text_id: dict, spec, image: tuple | None = None):
        """`image`: (mode, image encoder identity, latent shape (C, T, H, W)) of an image-to-video folder."""
        self.root, self.data, self.dataset, self.spec = Path(root), data, dataset, spec
        self.vae_id, self.text_id = _digest(vae_id), _digest(text_id)
        self.image_mode, self.image_id, self.latent_shape = (None, None, None) if image is None else \
            (image[0], _digest({"mode": image[0], "encoder": image[1], "vae": vae_id}), tuple(image[2]))
        self.written: list[Path] = []  # by this process, so that a run stopped by bad input can take them back
        self._folders = [p for p in (self.root / "latents", self.root / "text", self.root / "image", self.root)
                         if not p.exists()]

    def image_path(self, index: int) -> Path:
        key = _digest({"format": FORMAT, "clip": clip_identity(self.data, self.dataset, index), "image": self.image_id})
        return self.root / "image" / f"{key}.safetensors"

    def latent_path(self, index: int) -> Path:
        key = _digest({"format": FORMAT, "clip": clip_identity(self.data, self.dataset, index), "vae": self.vae_id})
        return self.root / "latents" / _bucket_folder(self.data, self.dataset, index) / f"{key}.safetensors"

    def text_path(self, caption: str) -> Path:
        key = _digest({"format": FORMAT, "caption": caption, "text": self.text_id})
        return self.root / "text" / f"{key}.safetensors"

    def missing(self, captions: list[str]) -> tuple[list[int], list[str]]:
        """Clip indices and captions that have no cache file yet."""
        clips = [i for i in range(len(self.dataset)) if not self.latent_path(i).is_file()
                 or (self.image_mode is not None and not self.image_path(i).is_file())]
        return clips, [c for c in dict.fromkeys(captions) if not self.text_path(c).is_file()]

    def fill(self, parts, device, quiet: bool, captions: list[str]) -> int:
        """Encode what is missing with the folder's VAE and text encoders (`parts`); returns the number
        of files written."""
        from slidefusion.pretrained import encode_prompts
        from slidefusion.vae import DiffusersVideoAutoencoder

        latents = self.root / "latents"
        buckets = sorted(p for p in latents.iterdir() if p.is_dir()) if latents.is_dir() else []
        for folder in (latents, *buckets, self.root / "text", self.root / "image"):  # each bucket's latents have their own folder
            remove_abandoned_files(folder, TEMPORARY)  # what a killed fill left; never a live writer's
        clips, texts = self.missing(captions)
        if clips:
            vae = DiffusersVideoAutoencoder(parts.vae).to(device)
            if parts.image_encoder is not None:
                parts.image_encoder.to(device)
            for n, (i, video) in enumerate(tqdm(self._videos(clips), total=len(clips), desc="caching latents",
                                                disable=quiet, leave=False)):
                video = video.to(device)  # (3, T, H, W)
                latents = vae.encode(video[None])[0].float()  # (1, 3, T, H, W) -> (C, T', H', W')
                self._put(self.latent_path(i), {"latents": latents}, {"format": FORMAT}, len(clips) - n, "latents")
                if self.image_mode is not None:
                    self._put(self.image_path(i), self._image_tensors(parts, video), {"format": FORMAT},
                              len(clips) - n, "image condition")
        for n, caption in enumerate(tqdm(texts, desc="caching text", disable=quiet, leave=False)):
            text = encode_prompts(parts, [caption])
            self._put(self.text_path(caption), self._text_tensors(text), {"format": FORMAT, "caption": caption},
                      len(texts) - n, "text states")
        return len(clips) + len(texts)

    def _put(self, path: Path, tensors: dict[str, Tensor], metadata: dict, left: int, what: str) -> None:
        """Write one cache file; a full disk says how much the `left` files of its kind need."""
        needed = left * sum(t.numel() * t.element_size() for t in tensors.values())
        if not path.parent.exists():  # a bucket's folder: made here, so taken back with the files
            self._folders.insert(0, path.parent)
        with writing(f"the {what} cache ({left} files to go)", self.root, needed,
                     "the cache files written so far are complete, and the next run reuses them"):
            _write(path, tensors, metadata)
        self.written.append(path)

    def discard_written(self) -> None:
        """Delete the files this process wrote, and the cache folders they leave empty."""
        for path in self.written:
            path.unlink(missing_ok=True)
        for folder in self._folders:  # the ones this process made
            try:
                folder.rmdir()  # only if empty
            except OSError:
                pass
        self.written = []

    def _videos(self, indices: list[int]):
        """(index, video (3, T, H, W)) of each clip; a scanned dataset decodes each file once."""
        if hasattr(self.dataset, "load"):
            yield from self.dataset.load(indices)
        else:
            for i in indices:
                yield i, self.dataset[i]["video"]

    def _image_tensors(self, parts, video: Tensor) -> dict[str, Tensor]:
        """The condition of a clip (3, T, H, W) in [-1, 1]: its first frame, as an 8-bit image (what a
        user gives `generate --image`), through the folder's image-to-video pipeline."""
        from PIL import Image

        from slidefusion.pretrained.image import image_condition

        pixels = ((video[:, 0].float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0)
        zeros = torch.zeros(1, *self.latent_shape)
        states, condition = image_condition(parts, Image.fromarray(pixels.numpy()), zeros, self.data.frames,
                                            self.data.height, self.data.width)
        tensors = {"video": condition[0].float()}
        if states is not None:
            tensors["states"] = states[0].float()
        return tensors

    def with_image(self, text: TextConditioning, indices: list[int], dropout: float, generator: torch.Generator,
                   device) -> TextConditioning:
        """`text` with the batch's image condition from the cache (CLIP states (B, L, D) or None, latents
        (B, C_v, T, H, W)) on `device`; with probability `dropout` (diffusion.image_dropout) the step
        trains without it: zeros for Wan 2.1 I2V ("channels"), a text-to-video step for 2.2 TI2V."""
        rows = [_read(self.image_path(i)) for i in indices]
        states = torch.stack([r["states"] for r in rows]) if "states" in rows[0] else None
        video = torch.stack([r["video"] for r in rows])
        if bool(torch.rand((), generator=generator) < dropout):
            if self.image_mode == "first-frame":
                return text
            states, video = None if states is None else torch.zeros_like(states), torch.zeros_like(video)
        return dataclasses.replace(text, image=None if states is None else states.to(device), video=video.to(device))

    def _text_tensors(self, text: TextConditioning) -> dict[str, Tensor]:
        states = text.states[0]
        if self.spec.padding == "zeros":  # keep the rows up to the last non-zero one
            nonzero = states.abs().amax(dim=1).nonzero()
            states = states[: int(nonzero.max()) + 1 if len(nonzero) else 1]
        tensors = {"states": states.float()}
        if text.mask is not None:
            tensors["mask"] = text.mask[0].to(torch.uint8)
        if text.pooled is not None:
            tensors["pooled"] = text.pooled[0].float()
        return tensors

    def latents(self, indices: list[int]) -> Tensor:
        """(B, C, T, H, W) float32."""
        return torch.stack([_read(self.latent_path(i))["latents"] for i in indices])

    def text(self, captions: list[str]) -> TextConditioning:
        """The batch's conditioning, padded as the family's pipeline pads (zeros to max_length for Wan)."""
        rows = [_read(self.text_path(c)) for c in captions]
        length = max(r["states"].shape[0] for r in rows)
        if self.spec.padding == "zeros":
            length = max(length, self.spec.max_length)
        states = torch.stack([torch.nn.functional.pad(r["states"], (0, 0, 0, length - r["states"].shape[0]))
                              for r in rows])
        mask = None
        if "mask" in rows[0]:
            mask = torch.stack([torch.nn.functional.pad(r["mask"], (0, length - r["mask"].shape[0])) for r in rows]).bool()
        pooled = torch.stack([r["pooled"] for r in rows]) if "pooled" in rows[0] else None
        return TextConditioning(states, mask, pooled)
