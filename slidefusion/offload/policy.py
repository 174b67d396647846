"""`OffloadPolicy`: every knob of `OffloadEngine` in one typed record, validated when built.

The user-facing form is the `offload:` config section (`OffloadConfig`); `slidefusion.offload.training`
derives a policy from it and the `optim:` section. Code that drives the engine directly builds one:

    OffloadEngine(model, blocks, OffloadPolicy(device="cuda", master="bf16", moments="int8",
                                               optim=OptimConfig(lr=1e-4, max_grad_norm=1.0)))
"""

import os
from dataclasses import dataclass, field

import torch

from slidefusion.errors import check
from slidefusion.optim import OptimConfig

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MASTERS = ("fp32", "bf16")  # the weights AdamW updates, on the host
MOMENTS = ("fp32", "bf16", "int8")  # AdamW's two moments, on the host
ROUNDINGS = ("stochastic", "kahan")  # how a bf16 master keeps updates smaller than half its ulp


def engine_optim() -> OptimConfig:
    """The engine's defaults: no clipping (warm-up and EMA belong to the trainer, not the engine)."""
    return OptimConfig(lr=1e-4, max_grad_norm=None, warmup_steps=0, ema_decay=None)


@dataclass(frozen=True)
class OffloadPolicy:
    """How the engine keeps state and moves weights. Sizes in bytes, counts in blocks."""

    device: str = "cuda"
    compute_dtype: torch.dtype = torch.bfloat16  # the streamed copy and the gradients
    master: str = "fp32"
    moments: str = "fp32"
    rounding: str = "stochastic"  # bf16 master only; "kahan" adds a 2 B/param compensation buffer
    optim: OptimConfig = field(default_factory=engine_optim)  # lr, betas, eps, weight_decay, max_grad_norm
    prefetch: int = 1  # blocks uploading ahead of the one computing
    checkpoint: bool = True  # recompute each block in backward (activations: block inputs only)
    resident_blocks: int = 0  # the last N blocks in call order live on the device, never streamed
    optimizer_threads: int | None = None  # default: half the cores with a GPU; the compute's threads when not overlapped
    overlap: bool | None = None  # each group's AdamW on the optimizer thread, beside the compute (None: yes,
    # except on a CPU device computing in place, whose cores are the compute's: see `overlapped`)
    pin_budget: int | None = None  # most page-locked host bytes (None: no limit); the rest is pageable
    pin_chunk: int = 256 << 20  # bytes page-locked per call: one call never locks a whole model
    seed: int = 0  # of the stochastic rounding streams (a function of seed, step, group, element)
    zero_copy: bool | None = None  # compute from the host buffers in place (None: on a CPU device, which
    # has no other memory; False there simulates a device with copy threads, as the race tests do)
    tile: int | None = None  # frames of the token grid per tile inside a block (None: whole blocks); see tiled
    spill_dir: str | None = None  # a folder on a local disk for checkpoints past spill_after (None: keep them)
    spill_after: int = 0  # checkpoint bytes kept in host memory before the rest goes to spill_dir
    spill_reserve: int = 0  # disk bytes reserved before the first step (later steps: what the last one spilled)
    frozen_dtype: torch.dtype | None = None  # an fp8 base (`fp8.FP8_DTYPES`): frozen weights as codes + scales
    frozen_scales: str = "channel"  # per output "channel" or per "tensor" (see `fp8`)

    def __post_init__(self):
        names = ", ".join(f"torch.{name}" for name in COMPUTE_DTYPES)
        check(self.compute_dtype in COMPUTE_DTYPES.values(), f"compute_dtype={self.compute_dtype} is unsupported; valid: {names}")
        check(self.master in MASTERS, f"master={self.master!r} is unknown; valid: {', '.join(MASTERS)}")
        check(self.moments in MOMENTS, f"moments={self.moments!r} is unknown; valid: {', '.join(MOMENTS)}")
        check(self.rounding in ROUNDINGS, f"rounding={self.rounding!r} is unknown; valid: {', '.join(ROUNDINGS)}")
        check(isinstance(self.optim, OptimConfig), f"optim={self.optim!r} must be an OptimConfig")
        check(isinstance(self.prefetch, int) and self.prefetch >= 0, f"prefetch={self.prefetch!r} must be an int >= 0")
        check(isinstance(self.resident_blocks, int) and self.resident_blocks >= 0,
              f"resident_blocks={self.resident_blocks!r} must be an int >= 0 (resolve 'auto' with the planner)")
        check(self.overlap in (None, True, False), f"overlap={self.overlap!r} must be True, False or None (automatic)")
        check(self.optimizer_threads is None or self.optimizer_threads >= 1,
              f"optimizer_threads={self.optimizer_threads} must be >= 1")
        check(self.pin_budget is None or self.pin_budget >= 0, f"pin_budget={self.pin_budget} must be >= 0 bytes or None")
        check(self.pin_chunk >= 4096, f"pin_chunk={self.pin_chunk} must be >= 4096 bytes")
        check(self.tile is None or (isinstance(self.tile, int) and not isinstance(self.tile, bool) and self.tile >= 1),
              f"tile={self.tile!r} must be a number of frames >= 1 or None (resolve 'auto' with the planner)")
        check(self.spill_dir is None or (isinstance(self.spill_dir, str) and self.spill_dir != ""),
              f"spill_dir={self.spill_dir!r} must be a folder or None")
        for name in ("spill_after", "spill_reserve"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 0, f"{name}={value!r} must be an int >= 0 (bytes)")
        for name, value in (("tile", self.tile), ("spill_dir", self.spill_dir)):
            check(value is None or self.checkpoint, f"{name}={value!r} needs checkpoint=True (it works on recomputed blocks)")
        device = self.torch_device  # validates the device
        check(not (self.zero_copy and device.type != "cpu"), f"zero_copy=True needs device='cpu', not {self.device!r}")
        if self.frozen_dtype is not None:
            from slidefusion.offload.fp8 import FP8_DTYPES, SCALES

            check(self.frozen_dtype in FP8_DTYPES.values(), f"frozen_dtype={self.frozen_dtype} is unsupported; "
                                                             f"valid: None, {', '.join(f'torch.{k}' for k in FP8_DTYPES)}")
            check(self.frozen_scales in SCALES, f"frozen_scales={self.frozen_scales!r} is unknown; valid: {', '.join(SCALES)}")
            check(not self.zero_copy, "zero_copy=True computes from the host buffers in place, which an fp8 base "
                                      "(frozen_dtype) does not hold as values; leave zero_copy unset")

    @property
    def torch_device(self) -> torch.device:
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            device = None
        check(device is not None and device.type in ("cpu", "cuda"), f"device={self.device!r} is unsupported; valid: cpu, cuda")
        check(device.type != "cuda" or torch.cuda.is_available(),
              f"device={self.device!r} but CUDA is not available here; use device='cpu'")
        return device

    @property
    def direct(self) -> bool:
        """The device computes from the host buffers themselves: no uploads, no downloads. Not with
        an fp8 base: its blocks are decoded into device buffers, a CPU "device" included."""
        if self.frozen_dtype is not None:
            return False
        return self.zero_copy if self.zero_copy is not None else self.torch_device.type == "cpu"

    @property
    def holds_gradients(self) -> bool:
        """The update reads each gradient where autograd wrote it, with no staging copy: the device
        is the host, and the fp32 state's kernel takes one tensor at a time (the lean kernels take
        a group's gradient as one flat buffer)."""
        return self.direct and self.master == "fp32" and self.moments == "fp32"

    @property
    def overlapped(self) -> bool:
        """Updates run on the optimizer thread while the compute goes on. Not so by default on a CPU
        device computing in place: there every core is the compute's, so an update beside the
        backward only competes with it (its threads stall on the one core they share), and each
        update runs instead in the backward, as soon as its group's gradient is complete, on
        torch's own threads (`benchmarks/offload.py`: 1.06-1.09x the fused resident step
        overlapped, 0.98-1.05x in line)."""
        return self.overlap if self.overlap is not None else not self.direct

    @property
    def threads(self) -> int:
        """Optimizer threads: with a GPU half the cores are free for AdamW; in line, the compute's
        own; a CPU device overlapping (copying engine) leaves one beside the compute."""
        if self.optimizer_threads is not None:
            return self.optimizer_threads
        if not self.overlapped:
            return torch.get_num_threads()
        return 1 if self.torch_device.type == "cpu" else max(1, (os.cpu_count() or 2) // 2)

    @property
    def clip(self) -> float | None:
        return self.optim.max_grad_norm

    @property
    def compute_bytes(self) -> int:
        return torch.finfo(self.compute_dtype).bits // 8
