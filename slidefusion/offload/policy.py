"""`OffloadPolicy`: the one offload config. It is the `offload:` section of a training config, the
planner's input (`slidefusion plan` flags set the same fields) and what `OffloadEngine` runs.

    offload:                  # YAML, or offload.KEY=VALUE overrides
      enabled: true           # (--offload) the trainer uses the engine
      master: bf16
      resident_blocks: auto
      tile: auto

    OffloadEngine(model, blocks, OffloadPolicy(device="cuda", master="bf16", moments="int8",
                                               optim=OptimConfig(lr=1e-4, max_grad_norm=1.0)))

Values a config may leave to the program are `auto`: `compute_dtype`, `overlap` and
`optimizer_threads` follow the device (the properties below); `resident_blocks` and `tile` need
the model and one step's workload, and `slidefusion.offload.plan.resolve.resolve` turns them into
numbers. The engine takes a policy whose `resident_blocks` and `tile` are numbers (or None).

`device`, `optim` and `spill_reserve` are set by the program that builds the engine (the trainer
takes them from `run.device`, the `optim:` section and the planner), never by a config file.
"""

import os
from dataclasses import dataclass, field

import torch

from slidefusion.core import validate
from slidefusion.core.errors import UserError, check
from slidefusion.io.config import PROGRAM_SET
from slidefusion.optim import OptimConfig

AUTO = "auto"
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the storage formats' spelling
SHORT_NAMES = {v: k for k, v in DTYPE_ALIASES.items()}  # float32 -> fp32, as the storage formats spell it
MASTERS = ("fp32", "bf16")  # the weights AdamW updates, on the host
MOMENTS = ("fp32", "bf16", "int8")  # AdamW's two moments, on the host
ROUNDINGS = ("stochastic", "kahan")  # how a bf16 master keeps updates smaller than half its ulp
DEVICE_DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}  # compute_dtype=auto: bf16 on a GPU, fp32 on a CPU


def engine_optim() -> OptimConfig:
    """The engine's defaults: no clipping (warm-up and EMA belong to the trainer, not the engine)."""
    return OptimConfig(lr=1e-4, max_grad_norm=None, warmup_steps=0, ema_decay=None)


def _is_count(value, low: int = 1) -> bool:
    """An int >= `low` (YAML's true and false are bools, which Python counts as ints)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _compute_dtype(value):
    """A torch dtype, from a dtype or its name (float32, bfloat16, float16; fp32, bf16, fp16), or auto."""
    if value == AUTO or value in COMPUTE_DTYPES.values():
        return value
    name = DTYPE_ALIASES.get(value, value) if isinstance(value, str) else None
    if name in COMPUTE_DTYPES:
        return COMPUTE_DTYPES[name]
    valid = ", ".join([*COMPUTE_DTYPES, *DTYPE_ALIASES, AUTO])
    raise UserError(f"offload.compute_dtype={value!r} is unsupported; valid: {valid}")


def _storage(key: str, value, valid: tuple[str, ...]) -> str:
    """A storage format's short name (fp32, bf16, int8), from it or its long name (float32, bfloat16)."""
    name = SHORT_NAMES.get(value, value) if isinstance(value, str) else value
    check(name in valid, f"offload.{key}={value!r} is unknown; valid: {', '.join(valid)}")
    return name


def _bytes(key: str, value, none_ok: bool) -> int | None:
    """A byte count from an int or a size such as 64GB; 0 is allowed (nothing kept / nothing locked)."""
    if value is None and none_ok:
        return None
    if _is_count(value, 0):
        return value
    check(isinstance(value, str) and not isinstance(value, bool), f"offload.{key}={value!r} must be a size, e.g. 64GB")
    return 0 if value.strip() == "0" else validate.byte_size(value, f"offload.{key}")


def config_size(value, key: str):
    """A size as a config file or a `key=value` override gives it: 0, or a number with its unit (64GB).
    YAML reads `64` as an int; a bare number is refused here as on the command line (24 bytes or
    24 GB?). The Python API's ints are bytes (`_bytes`): only config text reaches this."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
        raise UserError(f"{key}={value!r} has no unit; write e.g. {value:g}GB (units: B, KB, MB, GB, TB or "
                        "KiB, MiB, GiB, TiB), or 0")
    return value  # text, 0, None: the policy reads and checks it


def size_text(value):
    """A byte count as exact text with its unit (what `config_size` reads back): 64000000000 -> '64GB'."""
    if not _is_count(value, 1):
        return value
    for unit, scale in (("TiB", 2**40), ("TB", 10**12), ("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6),
                        ("KiB", 2**10), ("KB", 10**3)):
        if value % scale == 0:
            return f"{value // scale}{unit}"
    return f"{value}B"


SIZE = {"parse": config_size, "plain": size_text}  # field metadata: a byte count a config file writes with its unit


@dataclass(frozen=True)
class OffloadPolicy:
    """How the engine keeps state and moves weights. Sizes in bytes (or text such as 64GB; a config
    file needs the unit), counts in blocks, tiles in frames of the token grid; see the module
    docstring for `auto`."""

    enabled: bool = False  # the trainer trains with the engine (`--offload`); the engine itself ignores it
    compute_dtype: str | torch.dtype = AUTO  # the streamed copy and the gradients: float32, bfloat16, float16 or auto
    master: str = "fp32"  # fp32 | bf16 (stochastic rounding): the weights AdamW updates, on the host
    moments: str = "fp32"  # fp32 | bf16 | int8 (blockwise, as in 8-bit Adam): AdamW's moments
    rounding: str = "stochastic"  # bf16 master: stochastic | kahan (+2 B/param of compensation)
    prefetch: int = 1  # blocks uploading ahead of the one computing
    checkpoint: bool = True  # recompute each block in backward (activations kept: block inputs only)
    resident_blocks: int | str = 0  # the last N blocks in call order live on the device, never streamed; or auto
    tile: int | str | bool | None = None  # frames of the token grid per tile in a block, auto, or None / off: whole
    pin_budget: int | str | None = field(default=None, metadata=SIZE)  # most page-locked host bytes (None: no
    # limit); the rest is pageable
    spill_dir: str | None = None  # a folder on a local disk for the block checkpoints past spill_after
    spill_after: int | str = field(default=0, metadata=SIZE)  # checkpoint bytes kept in host memory before the
    # rest goes to spill_dir
    overlap: bool | str = AUTO  # each group's AdamW on the optimizer thread beside the compute: true, false or auto
    optimizer_threads: int | str = AUTO  # threads of the host AdamW: N >= 1 or auto (see `threads`)
    seed: int = 0  # of the stochastic rounding streams (a function of seed, step, group, element)
    pin_chunk: int = 256 << 20  # bytes page-locked per call: one call never locks a whole model
    zero_copy: bool | None = None  # compute from the host buffers in place (None: on a CPU device, which
    # has no other memory; False there simulates a device with copy threads, as the race tests do)
    device: str | None = field(default=None, metadata=PROGRAM_SET)  # None: cuda (the trainer: run.device)
    optim: OptimConfig = field(default_factory=engine_optim, metadata=PROGRAM_SET)  # the trainer: optim:
    spill_reserve: int = field(default=0, metadata=PROGRAM_SET)  # disk bytes reserved before the first
    # step (later steps: what the last one spilled); the planner's figure
    # An fp8 base (`fp8.FP8_DTYPES`): the frozen weights on the host as 1-byte codes + float32 scales,
    # per output "channel" or per "tensor". The trainer sets both from lora.base_dtype / base_scales.
    frozen_dtype: torch.dtype | None = field(default=None, metadata=PROGRAM_SET)
    frozen_scales: str = field(default="channel", metadata=PROGRAM_SET)

    def __post_init__(self):
        setattr_ = object.__setattr__.__get__(self)
        setattr_("compute_dtype", _compute_dtype(self.compute_dtype))
        for key, valid in (("master", MASTERS), ("moments", MOMENTS)):
            setattr_(key, _storage(key, getattr(self, key), valid))
        check(self.rounding in ROUNDINGS, f"offload.rounding={self.rounding!r} is unknown; valid: {', '.join(ROUNDINGS)}")
        check(_is_count(self.prefetch, 0), f"offload.prefetch={self.prefetch!r} must be an int >= 0")
        check(self.resident_blocks == AUTO or _is_count(self.resident_blocks, 0),
              f"offload.resident_blocks={self.resident_blocks!r} must be an int >= 0 or auto")
        setattr_("tile", None if self.tile is False or self.tile == "off" else self.tile)  # YAML reads `off` as false
        check(self.tile in (None, AUTO) or _is_count(self.tile),
              f"offload.tile={self.tile!r} must be a number of frames >= 1, auto, or off (whole blocks)")
        setattr_("overlap", AUTO if self.overlap is None else self.overlap)
        check(self.overlap == AUTO or isinstance(self.overlap, bool),
              f"offload.overlap={self.overlap!r} must be True, False or None (automatic); in a config file true, false "
              "or auto")
        setattr_("optimizer_threads", AUTO if self.optimizer_threads is None else self.optimizer_threads)
        check(self.optimizer_threads == AUTO or _is_count(self.optimizer_threads),
              f"offload.optimizer_threads={self.optimizer_threads!r} must be an int >= 1 or auto")
        self._check_memory(setattr_)
        check(isinstance(self.optim, OptimConfig), f"optim={self.optim!r} must be an OptimConfig")
        check(_is_count(self.seed, 0), f"offload.seed={self.seed!r} must be an int >= 0")
        if self.device is not None:
            self.torch_device  # noqa: B018 - validates the device where it is given
        check(not (self.zero_copy and self.device_type != "cpu"), f"zero_copy=True needs device='cpu', not {self.device!r}")
        if self.frozen_dtype is not None:
            self._check_frozen()

    def _check_frozen(self) -> None:
        from slidefusion.offload.engine.fp8 import FP8_DTYPES, SCALES

        check(self.frozen_dtype in FP8_DTYPES.values(), f"frozen_dtype={self.frozen_dtype} is unsupported; "
                                                         f"valid: None, {', '.join(f'torch.{k}' for k in FP8_DTYPES)}")
        check(self.frozen_scales in SCALES, f"frozen_scales={self.frozen_scales!r} is unknown; valid: {', '.join(SCALES)}")
        check(not self.zero_copy, "zero_copy=True computes from the host buffers in place, which an fp8 base "
                                  "(frozen_dtype) does not hold as values; leave zero_copy unset")

    def _check_memory(self, setattr_) -> None:
        """The byte sizes as ints, the spill folder, and what needs recomputed blocks."""
        setattr_("pin_budget", _bytes("pin_budget", self.pin_budget, none_ok=True))
        setattr_("spill_after", _bytes("spill_after", self.spill_after, none_ok=False))
        check(_is_count(self.pin_chunk, 4096), f"offload.pin_chunk={self.pin_chunk!r} must be >= 4096 bytes")
        check(_is_count(self.spill_reserve, 0), f"spill_reserve={self.spill_reserve!r} must be an int >= 0 (bytes)")
        check(self.spill_dir is None or (isinstance(self.spill_dir, str) and self.spill_dir.strip() != ""),
              f"offload.spill_dir={self.spill_dir!r} must name a folder")
        check(self.spill_dir is not None or self.spill_after == 0, "offload.spill_after needs offload.spill_dir")
        for name, value in (("tile", self.tile), ("spill_dir", self.spill_dir)):
            check(value is None or self.checkpoint,
                  f"offload.{name}={value!r} needs checkpoint=True (offload.checkpoint=true): it works on recomputed blocks")

    # -- what the device decides ----------------------------------------------------------------

    @property
    def device_type(self) -> str:
        """"cuda" or "cpu", without asking whether the device exists (the planner sizes a GPU anywhere)."""
        return "cuda" if self.device is None else torch.device(self.device).type

    @property
    def torch_device(self) -> torch.device:
        """The device the engine computes on (None: cuda), checked to exist here."""
        name = "cuda" if self.device is None else self.device
        try:
            device = torch.device(name)
        except (RuntimeError, TypeError):
            device = None
        check(device is not None and device.type in ("cpu", "cuda"), f"device={name!r} is unsupported; valid: cpu, cuda")
        check(device.type != "cuda" or torch.cuda.is_available(),
              f"device={name!r} but CUDA is not available here; use device='cpu'")
        return device

    @property
    def dtype(self) -> torch.dtype:
        """`compute_dtype`, `auto` read as bfloat16 on a GPU and float32 on a CPU (where bf16
        matmuls are emulated and slower than fp32)."""
        return DEVICE_DTYPES[self.device_type] if self.compute_dtype == AUTO else self.compute_dtype

    @property
    def compute_bytes(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    @property
    def direct(self) -> bool:
        """The device computes from the host buffers themselves: no uploads, no downloads. Not with
        an fp8 base: its blocks are decoded into device buffers, a CPU "device" included."""
        if self.frozen_dtype is not None:
            return False
        return self.zero_copy if self.zero_copy is not None else self.device_type == "cpu"

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
        backward only competes with it (its threads stall on the one core they share); each update
        runs instead in the backward, as soon as its group's gradient is complete, on torch's own
        threads (`benchmarks/offload.py` compares the two)."""
        return self.overlap if self.overlap != AUTO else not self.direct

    @property
    def threads(self) -> int:
        """Optimizer threads: with a GPU half the cores are free for AdamW; in line, the compute's
        own; a CPU device overlapping (copying engine) leaves one beside the compute."""
        if self.optimizer_threads != AUTO:
            return self.optimizer_threads
        if not self.overlapped:
            return torch.get_num_threads()
        return 1 if self.device_type == "cpu" else max(1, (os.cpu_count() or 2) // 2)

    @property
    def clip(self) -> float | None:
        return self.optim.max_grad_norm

    @property
    def resolved(self) -> bool:
        """No `auto` left that needs the model (`resident_blocks`, `tile`)."""
        return self.resident_blocks != AUTO and self.tile != AUTO
