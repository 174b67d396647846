"""The Wan-shaped rows of `benchmarks/offload.py` (issue 10): a random diffusers
`WanTransformer3DModel` (default ~25 M parameters, 8 blocks) trained with Wan's flow-matching loss
through `slidefusion.adapters`, offloaded against the fastest resident run, full and with LoRA.

Runners, all in one alternating loop (after one warm-up round; medians quoted), every one with
activation checkpointing at every block boundary (the resident ones through torch.utils.checkpoint
on the unchanged blocks):
  full   torch AdamW single-tensor, foreach=True, fused=True on the resident model; the engine
         (fp32 host state). The ratio is to the fastest of the three, measured in the same run.
  lora   peft LoRA (rank --lora-rank on to_q, to_k, to_v, to_out.0) with the base frozen: resident
         torch AdamW over the adapters (single-tensor, foreach, fused), and the engine, which streams
         the frozen weights host to device only.
Imported by offload.py (section "wan"); not run by itself.
"""

from __future__ import annotations

import copy
import statistics
from functools import cache

import torch
from torch import nn

from slidefusion.families import TextConditioning, adapter_for
from slidefusion.offload import OffloadEngine, OffloadPolicy
from slidefusion.optim import OptimConfig

ADAMW = {"single-tensor": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def add_arguments(p) -> None:
    p.add_argument("--wan-dim", type=int, default=384, help="Wan width (a multiple of --wan-head-dim)")
    p.add_argument("--wan-head-dim", type=int, default=64, help="Wan attention head width (128 in Wan 2.1)")
    p.add_argument("--wan-depth", type=int, default=8, help="Wan blocks")
    p.add_argument("--wan-ffn", type=int, default=2304, help="Wan feed-forward width")
    p.add_argument("--wan-text-dim", type=int, default=512, help="text state width (umT5-XXL's is 4096)")
    p.add_argument("--wan-text-len", type=int, default=32, help="text tokens per prompt")
    p.add_argument("--wan-latent", default="4x16x16", help="latent T x H x W (16 channels, patch 1x2x2)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--wan-adamw", nargs="+", default=list(ADAMW), choices=list(ADAMW),
                   help="resident anchors (torch AdamW variants); the fastest measured is the reference")
    p.add_argument("--wan-rows", nargs="+", default=["full", "lora"], choices=["full", "lora"])


def quick(args) -> None:
    args.wan_dim, args.wan_depth, args.wan_ffn, args.wan_text_dim, args.wan_text_len = 64, 2, 128, 32, 8
    args.wan_latent = "2x8x8"


@cache
def _base(dim: int, head_dim: int, depth: int, ffn: int, text_dim: int) -> nn.Module:
    """Built once (random init of a 1.3 B model takes a while); every runner gets a deep copy."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=dim // head_dim, attention_head_dim=head_dim,
                                 in_channels=16, out_channels=16, text_dim=text_dim, freq_dim=256, ffn_dim=ffn,
                                 num_layers=depth, rope_max_seq_len=1024)


def wan_model(args, lora: bool = False) -> nn.Module:
    """A copy of the same random Wan transformer (seed 0), LoRA adapters injected (seed 1) if asked."""
    model = copy.deepcopy(_base(args.wan_dim, args.wan_head_dim, args.wan_depth, args.wan_ffn, args.wan_text_dim))
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, target_modules=LORA_TARGETS,
                                           init_lora_weights=True), model)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.requires_grad_("lora_" in name)
                if "lora_B" in name:  # peft starts B at zero; make the adapters do real work from step one
                    param.copy_(0.01 * torch.randn(param.shape, generator=generator))
    return model


def wan_batch(args, batch: int, device) -> tuple:
    """(x0 latents (B, 16, T, H, W), noise, sigmas (B,), text states (B, L, D)), seeded."""
    t, h, w = (int(s) for s in args.wan_latent.split("x"))
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(batch, 16, t, h, w, generator=g), torch.randn(batch, 16, t, h, w, generator=g)
    sigmas, states = torch.rand(batch, generator=g), torch.randn(batch, args.wan_text_len, args.wan_text_dim, generator=g)
    return tuple(v.to(device) for v in (x0, noise, sigmas, states))


def wan_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """Wan's flow matching: x_s = (1 - s) x0 + s noise at timestep 1000 s, velocity target noise - x0."""
    x0, noise, sigmas, states = batch
    s = sigmas[:, None, None, None, None]
    predicted = adapter_for(model).predict(model, (1 - s) * x0 + s * noise, sigmas * 1000, TextConditioning(states))
    return (predicted.float() - (noise - x0)).pow(2).mean()


def _engine(model: nn.Module, args) -> OffloadEngine:
    optim = OptimConfig(lr=1e-4, warmup_steps=0, ema_decay=None)
    policy = OffloadPolicy(device=args.device, compute_dtype=getattr(torch, args.dtype), optim=optim)
    return OffloadEngine(model, nn.ModuleList(adapter_for(model).blocks(model)), policy)


def runners(args, resident_cls) -> dict:
    """name -> runner (`train_step(loss_fn)`), the resident ones built by offload.py's `Resident`."""
    out = {}
    rows = [(False, "wan")] * ("full" in args.wan_rows) + [(True, f"wan LoRA r{args.lora_rank}")] * ("lora" in args.wan_rows)
    for lora, prefix in rows:
        for name in args.wan_adamw:
            options = ADAMW[name]
            out[f"{prefix} resident, {name} AdamW"] = resident_cls(wan_model(args, lora), args.device,
                                                                   getattr(torch, args.dtype), **options)
        out[f"{prefix} offloaded"] = _engine(wan_model(args, lora), args)
    return out


def summarize(medians: dict, models: dict, samples: dict | None = None) -> dict:
    """Per group (full, LoRA): the fastest resident AdamW (by median) and every runner's ratio to it;
    with `samples` (seconds per round) also the median of the per-round ratios and the ratio of the
    best rounds, which a shared machine's load (it only ever adds time) disturbs less."""
    groups = {}
    for name, seconds in medians.items():
        groups.setdefault(name.split(" resident")[0].split(" offloaded")[0], {})[name] = seconds
    result = {}
    for group, times in groups.items():
        resident = {n: s for n, s in times.items() if " resident" in n}
        fastest = min(resident, key=resident.get)
        model = models[next(iter(times))]
        result[group] = {"params": sum(p.numel() for p in model.parameters()),
                         "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                         "median_s": times, "fastest_resident": fastest,
                         "ratio_to_fastest_resident": {n: s / resident[fastest] for n, s in times.items()}}
        if samples:
            anchor = samples[fastest]
            result[group]["median_round_ratio"] = {
                n: statistics.median(a / b for a, b in zip(samples[n], anchor)) for n in times}
            result[group]["best_round_ratio"] = {n: min(samples[n]) / min(anchor) for n in times}
    return result


def table(section: dict) -> list[str]:
    lines = [f"Wan-shaped step time ({section['blocks']} blocks, {section['tokens']} video tokens, {section['dtype']} "
             f"on {section['device']}; medians of alternating rounds)"]
    for group, g in section["groups"].items():
        lines.append(f"  {group}: {g['params'] / 1e6:.1f} M params, {g['trainable'] / 1e6:.2f} M trainable; fastest "
                     f"resident: {g['fastest_resident']}")
        for name, seconds in g["median_s"].items():
            engine = section["engine"].get(name)
            host = (f"  host state {engine['host_state_bytes'] / 1e6:.0f} MB = {engine['host_state_bytes'] / g['params']:.2f} "
                    "B per model parameter" if engine else "")
            mfu = f"  MFU {g['mfu'][name]:.1%}" if "mfu" in g else ""
            rounds = (f" (per round x{g['median_round_ratio'][name]:.3f}, best rounds x{g['best_round_ratio'][name]:.3f})"
                      if "median_round_ratio" in g else "")
            lines.append(f"    {name:<44} {seconds * 1e3:9.1f} ms   x{g['ratio_to_fastest_resident'][name]:.3f}{rounds}{mfu}{host}")
    return lines
