"""Tensor helpers shared by the engine and the attention backends (torch; ``paged.core.utils``
stays torch-free so that the front-end's imports do not load torch)."""

from __future__ import annotations

import math

import torch


class ScratchBuffers:
    """Named scratch tensors that only ever grow: ``get(name, shape, dtype, device)`` returns a
    contiguous ``shape`` view of a persistent buffer, reallocated only when a larger one (or
    another dtype/device) is asked for. Reused by every layer and step, so the hot path does not
    allocate. A view is valid until the next ``get`` of the same name."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device):
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def __contains__(self, name: str) -> bool:
        return name in self._buffers


_UNSIGNED_BY_SIZE = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros``, except that on a CPU the memory is a private anonymous ``mmap`` of its own,
    so the operating system hands out zero pages as they are first written instead of
    ``torch.zeros`` writing every byte up front: a 1 GiB KV cache costs nothing until it fills
    (about 1 s at start-up otherwise, and its whole size in resident memory).

    Its own mapping, not numpy's ``calloc``: with the engine's malloc settings
    (``paged.core.engine.cpu_malloc``) calloc served the cache from the heap and cleared it by
    writing it, all resident at start-up. And not advised into 2 MiB pages, as numpy advises its
    large arrays: where transparent huge pages are on for advised memory only (the usual
    ``madvise`` setting), a fault there may compact memory to find a huge page. On a 2-core Xeon
    VM, writing 300 MiB took 3.0-3.3 s advised against 0.11-0.13 s in 4 KiB pages, and a B = 64
    run's first use of its 283 MiB of cache cost ~3 s; decode and prefill steps once warm were
    no faster in huge pages. A system set to ``always`` still uses huge pages for it as its
    ``defrag`` setting allows."""
    device = torch.device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or itemsize not in _UNSIGNED_BY_SIZE or dtype.is_complex:
        return torch.zeros(shape, dtype=dtype, device=device)
    import mmap

    import numpy as np

    nbytes = math.prod(shape) * itemsize
    if nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # (Windows: numpy's calloc)
        return torch.from_numpy(np.zeros(shape, dtype=_UNSIGNED_BY_SIZE[itemsize])).view(dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the array keeps the mapping (its base) alive, and the tensor the array: unmapped with the last of them
    array = np.frombuffer(mapping, dtype=_UNSIGNED_BY_SIZE[itemsize]).reshape(shape)
    return torch.from_numpy(array).view(dtype)
