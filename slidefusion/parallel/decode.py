"""The VAE decode split over the ranks, exactly: spatial tiles after the last global operation
(Wan's causal 3D VAE; where a decoder splits is its family's `VaeFacts.splits`), or frames (2-D image VAEs such as Latte's AutoencoderKL, which decode each frame alone).

Wan's VAE decodes one latent frame at a time, causally: each causal 3D convolution keeps the
last frames of its input in a cache that the next frame reads. A split in *time* would need that
cache, and its state after frame f depends on every frame before (through ~30 layers, more latent
frames of history than a video has), so it cannot start a rank mid-video. A split in *space* can:
after the decoder's mid-block (the only global operation: a per-frame attention over all positions
at latent resolution), everything is local - causal 3x3x3 convolutions, RMS norms over channels,
nearest upsampling - and a spatial tile whose crop of the mid-block output carries a halo at least
the up path's receptive field (in latent pixels) decodes its interior exactly as the whole frame
does, caches included (each tile's caches are the crop of the whole one's).

So each rank runs the cheap prefix (post-quant conv, conv_in, mid-block: latent resolution) on the
whole frame, crops the mid-block output to its columns (or rows: the longer side) plus the halo,
runs the up path - the expensive part, 8-16x the resolution - on that, and keeps its own columns;
the columns are then gathered. Results equal one decode up to float rounding (convolutions of
other sizes sum in another order). The halo is computed from the up path's modules (`halo`).
"""

import math

import torch
from torch import Tensor, nn

from slidefusion.families import TileSplit, vae_facts
from slidefusion.parallel import hooks
from slidefusion.parallel.comm import Comm
from slidefusion.parallel.exchange import gather_shards
from slidefusion.parallel.layout import Split


def halo(vae: nn.Module, split: TileSplit, axis: int) -> int:
    """Latent pixels along `axis` (-2 rows, -1 columns) that the tail's output depends on beyond a
    tile: each convolution of kernel k at scale s (after upsampling by s) reaches (k // 2) / s
    latent pixels further."""
    reach, scale = 0.0, 1.0
    for path in split.tail:
        for module in vae.get_submodule(path).modules():
            if isinstance(module, nn.Upsample):
                factor = module.scale_factor
                scale *= float(factor[axis] if isinstance(factor, tuple) else factor)
            elif isinstance(module, (nn.Conv2d, nn.Conv3d)):
                k, d = module.kernel_size[axis], module.dilation[axis]
                reach += (k // 2) * d / scale
    return math.ceil(reach - 1e-9)


def can_split(vae: nn.Module) -> bool:
    """The VAE's family says where its decoder splits (`VaeFacts.splits`)."""
    return vae_facts(type(vae).__name__)[1] is not None


def frames_decode(vae: nn.Module, latents: Tensor, comm: Comm | None) -> Tensor:
    """A 2-D VAE on latents (B, C, T, H, W), frame by frame -> (B, 3, T, H', W'); with `comm`, each
    rank decodes its share of the B*T frames and the frames are gathered."""
    b, c, t, h, w = latents.shape
    frames = latents.transpose(1, 2).reshape(b * t, c, h, w)
    if comm is None or comm.size == 1:
        out = vae.decode(frames, return_dict=False)[0]
    else:
        split = Split(b * t, comm.size)
        mine = frames.narrow(0, *split.range(comm.rank))
        local = vae.decode(mine, return_dict=False)[0] if mine.shape[0] else None
        if local is None:  # this rank holds no frame: decode one to learn the shape, send nothing
            local = vae.decode(frames[:1], return_dict=False)[0][:0]
        out = gather_shards(comm, local.contiguous(), 0, split.sizes, "gather video")
    return out.reshape(b, t, *out.shape[1:]).transpose(1, 2)


def split_decode(vae: nn.Module, latents: Tensor, comm: Comm) -> Tensor:
    """`vae.decode(latents).sample` (latents (B, C, T, H, W), already in the VAE's own scale) with
    the up path split over the group's ranks by columns (or rows); the whole video on every rank."""
    if comm.size == 1 or not can_split(vae):
        return vae.decode(latents, return_dict=False)[0]
    split = vae_facts(type(vae).__name__)[1]
    axis = -1 if latents.shape[-1] >= latents.shape[-2] else -2
    size = latents.shape[axis]
    if size < comm.size:  # fewer latent columns than ranks: nothing to split
        return vae.decode(latents, return_dict=False)[0]
    start, count = Split(size, comm.size).range(comm.rank)
    reach = halo(vae, split, axis)
    lo, hi = max(0, start - reach), min(size, start + count + reach)
    prefix_end = vae.get_submodule(split.prefix_end)

    def crop(module, call_next, *args, **kwargs):  # the mid-block's output, whole frame -> this tile and its halo
        return call_next(*args, **kwargs).narrow(axis, lo, hi - lo)

    hooks.attach(prefix_end, "crop", crop)
    try:
        tile = vae.decode(latents, return_dict=False)[0]
    finally:
        hooks.detach(prefix_end, "crop")
    ratio = tile.shape[axis] // (hi - lo)  # output pixels per latent pixel
    mine = tile.narrow(axis, (start - lo) * ratio, count * ratio)
    sizes = [n * ratio for n in Split(size, comm.size).sizes]
    return gather_shards(comm, mine.contiguous(), mine.dim() + axis, sizes, "gather video")


@torch.no_grad()
def decode_video(vae: nn.Module, latents: Tensor, comm: Comm | None = None) -> Tensor:
    """Sampled latents (B, C, T, H, W) in the transformer's units -> videos (B, 3, F, H', W') in
    [-1, 1], as the family's pipeline decodes them (the normalisation of `DiffusersVideoAutoencoder`
    undone first: one definition for training caches and sampling); split over `comm`'s ranks where
    the VAE allows it."""
    from slidefusion.vae import DiffusersVideoAutoencoder

    autoencoder = DiffusersVideoAutoencoder(vae)
    z = autoencoder.denormalise(latents)
    if autoencoder.image:
        video = frames_decode(vae, z, comm)
    elif comm is None or comm.size == 1 or not can_split(vae):
        video = autoencoder.decode_raw(z)
    else:
        video = split_decode(vae, z, comm)
    return video.float().clamp(-1, 1)
