"""Host buffers, page-locked where it pays and where it is safe.

Only buffers the copy engines read or write (compute copies, gradient staging) are page-locked;
master weights and moments are touched by the CPU alone and stay pageable. Page-locking is done on
ordinary (pageable) allocations with cudaHostRegister, in chunks of at most `chunk` bytes: no
power-of-two rounding as in torch's pinned allocator, no second copy, and no single call that locks
a whole model. When locking fails, or would take the total past `budget`, the buffer stays
pageable (copies from it are slower, not wrong) and one warning says so; after a failure nothing
more is locked.
"""

import warnings

import torch

PAGE = 4096


class CudaPinner:
    """cudaHostRegister / cudaHostUnregister through torch's CUDA runtime bindings."""

    def register(self, ptr: int, nbytes: int) -> bool:
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)) == 0  # 1: portable

    def unregister(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


class HostAllocator:
    """`empty(numel, dtype, dma)`: a 1-D host tensor; `dma` ones are page-locked while possible."""

    def __init__(self, pinner=None, budget: int | None = None, chunk: int = 256 << 20):
        self.pinner, self.budget, self.chunk = pinner, budget, max(PAGE, chunk // PAGE * PAGE)
        self.pinned_bytes = 0  # page-locked now
        self.pageable_dma_bytes = 0  # copy buffers that stayed pageable
        self.failed = False
        self.warned = False
        self._regions: list[tuple[int, torch.Tensor]] = []  # (pointer, tensor kept alive while locked)

    @classmethod
    def for_device(cls, device: torch.device, budget: int | None, chunk: int) -> "HostAllocator":
        return cls(CudaPinner() if device.type == "cuda" else None, budget, chunk)

    def empty(self, numel: int, dtype: torch.dtype, dma: bool) -> torch.Tensor:
        if not dma or self.pinner is None:
            return torch.empty(numel, dtype=dtype)
        return self.adopt(_page_aligned(numel, dtype))

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-lock `tensor` (page-aligned host memory allocated elsewhere, e.g. shared between
        processes) as a copy buffer, within the budget; returns it."""
        if self.pinner is None:
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        if self.failed or nbytes == 0:
            reason = None
        elif self.budget is not None and self.pinned_bytes + nbytes > self.budget:
            reason = f"locking {nbytes / 1e9:.3g} GB more would pass offload.pin_budget={self.budget / 1e9:.3g} GB"
        else:
            reason = self._lock(tensor, nbytes)
            if reason is None:
                return tensor
        self.pageable_dma_bytes += nbytes
        if reason is not None and not self.warned:
            self.warned = True
            warnings.warn(f"offload: {reason}; the rest of the copy buffers stay pageable (slower transfers)",
                          RuntimeWarning, stacklevel=2)
        return tensor

    def _lock(self, tensor: torch.Tensor, nbytes: int) -> str | None:
        """Page-lock `tensor` chunk by chunk; on failure undo its chunks and say why (None: locked)."""
        base, done = tensor.data_ptr(), []
        for start in range(0, nbytes, self.chunk):
            size = min(self.chunk, nbytes - start)
            try:
                ok = self.pinner.register(base + start, size)
            except RuntimeError:
                ok = False
            if not ok:
                for ptr in done:
                    self.pinner.unregister(ptr)
                self.failed = True
                return f"page-locking failed after {(self.pinned_bytes + start) / 1e9:.3g} GB"
            done.append(base + start)
        self._regions += [(ptr, tensor) for ptr in done]
        self.pinned_bytes += nbytes
        return None

    def close(self) -> None:
        """Unlock everything (the tensors stay valid, pageable)."""
        for ptr, _ in self._regions:
            self.pinner.unregister(ptr)
        self._regions, self.pinned_bytes = [], 0

    def __del__(self):
        if self._regions:  # still holding the tensors: unlock before their memory can be freed
            self.close()


def _page_aligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor whose data starts on a page boundary (cudaHostRegister works on pages)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel * size + PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % PAGE
    return raw[offset:offset + numel * size].view(dtype)
