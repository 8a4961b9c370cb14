"""Small helpers shared by the engine and the attention backends."""

from __future__ import annotations

import math

import torch


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``, in integers."""
    return -(-a // b)


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
