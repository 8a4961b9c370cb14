"""Bundled LoRA kernels (contract: ``paged.core.lora``): ``cpu``, paged's C++ kernel (one pass over
the rows, each reading only its own adapter's rows; ``paged.plugins.lora_kernels``), and ``torch``
(for each slot the step uses, its rows' two matmuls: any device, the reference)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from paged.core.hookspecs import LoRAKernelSpec, hookimpl
from paged.core.lora import LoRABatch, LoRAKernelContext, LoRALayerWeights


def add_grouped(y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, slots, rows_by_slot) -> None:
    """For each slot, its rows through two matmuls: ``y[rows] += (x[rows] @ a[s]^T) @ b[s]``."""
    ranks = weights.ranks
    for slot, rows in zip(slots, rows_by_slot):
        if not ranks[slot]:
            continue
        a, b = weights.a[slot], weights.b[slot]
        if rows.numel() == x.shape[0]:  # every row has this adapter: no gather, no scatter
            y.addmm_(x @ a.T, b)
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b)


class TorchLoRAKernel:
    """Rows grouped by slot (SGMV-style): per slot, ``x[rows] @ a[s]^T @ b[s]`` added into ``y``."""

    def __init__(self, options=None, context: LoRAKernelContext | None = None) -> None:
        pass

    def apply(self, y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, batch: LoRABatch) -> None:
        add_grouped(y, x, weights, batch.slots, batch.rows_by_slot)


class CpuLoRAOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gemm_min_rows: int = Field(32, ge=1, description="a slot with at least this many rows in a step goes through "
                               "torch's matmuls (oneDNN) instead of the per-row kernel")


class CpuLoRAKernel:
    """``paged.plugins.lora_kernels.lora_apply`` for the slots with few rows in the step (decodes:
    each row reads its own adapter, 4 rows of one slot at a time), and torch's GEMMs for a slot with
    ``gemm_min_rows`` rows or more (a prefill chunk: the matmul reads each adapter once for all of
    its rows). Measured per layer of the default model's shapes, rank 16, bfloat16 (``python
    benchmarks/lora.py``'s kernel table): the per-row kernel is faster up to ~32 rows of a slot,
    the GEMMs beyond."""

    def __init__(self, options: CpuLoRAOptions | None = None, context: LoRAKernelContext | None = None) -> None:
        from paged.plugins import lora_kernels

        self.ops = lora_kernels.load()
        if self.ops is None:
            raise RuntimeError("the C++ LoRA kernel could not be built or loaded (see the warning above); "
                               "use lora.kernel=torch")
        self.gemm_min_rows = (options or CpuLoRAOptions()).gemm_min_rows
        self._step = -1
        self._plan: tuple[list, list, torch.Tensor | None] = ([], [], None)

    def _split(self, batch: LoRABatch) -> tuple[list, list, torch.Tensor | None]:
        """Once per step: the slots for the GEMMs and their rows, and the rows' slots left to the
        per-row kernel (-1 where the GEMMs take them; None when they take every row)."""
        if self._step != batch.step:
            big = [(s, rows) for s, rows in zip(batch.slots, batch.rows_by_slot) if rows.numel() >= self.gemm_min_rows]
            small = batch.token_slots
            if big:
                small = small.clone()
                for _, rows in big:
                    small[rows] = -1
                if not bool((small >= 0).any()):
                    small = None
            self._plan = ([s for s, _ in big], [rows for _, rows in big], small)
            self._step = batch.step
        return self._plan

    def apply(self, y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, batch: LoRABatch) -> None:
        slots, rows, small = self._split(batch)
        if slots:
            add_grouped(y, x, weights, slots, rows)
        if small is not None:
            if x.stride(-1) != 1:
                x = x.contiguous()
            self.ops.lora_apply(y, x, weights.a, weights.b, small, weights.ranks, weights.parts)


def _cpu_available(device: str) -> tuple[bool, str]:
    if device != "cpu":
        return False, f"the C++ kernel runs on the CPU, not {device!r}"
    return True, ""


@hookimpl
def register_lora_kernels():
    return [
        LoRAKernelSpec(
            name="cpu",
            factory=CpuLoRAKernel,
            options=CpuLoRAOptions,
            description="C++ for the slots with few rows in a step (each row its own adapter), torch's GEMMs for "
            "a slot with many (a prefill chunk)",
            is_available=_cpu_available,
            auto_priority=10,
        ),
        LoRAKernelSpec(
            name="torch",
            factory=TorchLoRAKernel,
            description="torch ops: the rows of each adapter in the step through two matmuls (any device)",
        ),
    ]
