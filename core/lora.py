"""The LoRA contract: low-rank adapters on the linear layers, chosen per request, batched together.

A LoRA adapter (a PEFT checkpoint: ``adapter_config.json`` + ``adapter_model.safetensors``) adds
``x A^T B^T * scaling`` to the output of each linear layer it targets (``A [r, in]``, ``B [out,
r]``, ``scaling = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA). With ``lora.enable_lora`` the
engine serves many adapters over one base model, in any dtype and over quantized base weights:

1. A request names its adapter with a ``LoRARequest`` (name, a positive ``lora_int_id`` unique
   per adapter, the folder). The engine core reads and checks the adapter when it is first
   registered (``add_lora``), before any request of it is queued: an error names the file and the
   field (``paged.core.loading.lora``); nothing is read in a step. Up to ``lora.max_cpu_loras``
   adapters stay in memory (least recently used ones are dropped, never one that an unfinished
   request uses, and read again from their folder when asked for).
2. Each linear layer holds ``lora.max_loras`` *slots* (``LoRALayerWeights``); the scheduler admits
   requests so that one step never needs more distinct adapters than there are slots, and before
   each step the adapters of the scheduled requests are put into slots (least recently used slot
   first). A step's ``LoRABatch`` says which slot each token row uses (-1: the base model alone).
3. The layers call the selected kernel once per layer and projection for the whole batch:
   ``kernel.apply(y, x, weights, batch)`` adds each row's adapter to ``y`` in place. The kernel is a
   plugin (``register_lora_kernels``, ``LoRAKernelSpec`` in ``paged.core.hookspecs``; selected by
   ``lora.kernel``): the bundled ``cpu`` (C++, one pass over the rows) and ``torch`` (grouped
   matmuls per slot, any device) in ``paged.plugins.lora`` are the reference implementations.

Layout of a layer's slots (``LoRALayerWeights``): a linear layer made of ``parts`` checkpoint
projections (a fused QKV has three, gate-up two, others one) has ``R = parts * max_lora_rank``
adapter rows; part p's rank-r adapter fills rows ``[p * max_lora_rank, p * max_lora_rank + r)`` of
``a`` (``[max_loras, R, in_features]``, A's rows) and of ``b`` (``[max_loras, R, out_features]``,
B transposed and multiplied by the scaling, nonzero only in the part's output columns); every
other entry is zero. So for a row ``x`` of slot ``s``: ``y += (a[s] @ x) @ b[s]``, whatever the
parts. Under tensor parallelism each rank holds its share as the base layer does: the output
columns of a column-parallel layer, the input columns of ``a`` for a row-parallel one (whose
partial sums the layer's all-reduce adds up with its own).

Prefix caching: a request's block hashes include its ``lora_int_id`` (``extend_block_hashes``), so
the same prompt under two adapters, or under an adapter and the base, never shares KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:  # annotations only: the front-end imports LoRARequest without torch
    import torch


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """An adapter as a request names it (vLLM's ``LoRARequest``): ``lora_name`` (what clients send
    as ``model``), ``lora_int_id`` (> 0, unique per adapter: the engine keys its caches and the
    prefix cache on it) and ``lora_path`` (the PEFT folder)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class LoRALayerWeights:
    """One linear layer's adapter slots (see the module docstring for the layout)."""

    a: "torch.Tensor"  # [max_loras, R, in_features]
    b: "torch.Tensor"  # [max_loras, R, out_features]: B transposed, times the scaling
    # [max_loras] int32, on the CPU: the largest rank of slot s's adapter in this layer (its
    # parts' rows beyond it are zero); 0 = the slot is empty or its adapter leaves this layer alone
    ranks: "torch.Tensor"
    parts: int  # checkpoint projections in this layer (R = parts * max_lora_rank)
    name: str = ""  # the module's name in the model (for messages)


@dataclass
class LoRABatch:
    """Which adapter slot each row of this step's tokens uses. ``token_slots`` (``[num_tokens]``
    int32 on the model's device, -1 = no adapter) is None in a step where no row has one, and
    then no layer calls the kernel. ``slots``: the slots the step uses, ascending;
    ``rows_by_slot``: for each of them, the rows (int64 indices on the device) that use it, for
    kernels that group rows by adapter. ``step`` changes from one step to the next: a kernel may
    keep what it derives from the batch (once per step, not per layer) under it."""

    token_slots: "torch.Tensor | None" = None
    slots: list[int] = field(default_factory=list)
    rows_by_slot: list["torch.Tensor"] = field(default_factory=list)
    step: int = 0


@dataclass(frozen=True)
class LoRAKernelContext:
    """What a kernel is built for (``factory(options, context)``)."""

    device: str  # "cpu" or "cuda"
    dtype: Any  # the model's torch dtype
    max_loras: int
    max_lora_rank: int


@runtime_checkable
class LoRAKernel(Protocol):
    def apply(self, y: "torch.Tensor", x: "torch.Tensor", weights: LoRALayerWeights, batch: LoRABatch) -> None:
        """``y[t] += (weights.a[s] @ x[t]) @ weights.b[s]`` for every row t whose slot
        ``s = batch.token_slots[t]`` is not -1, in place; ``x [T, in_features]`` and ``y [T,
        out_features]`` in the model's dtype (``y`` is the base layer's fresh output). Called once per
        layer and projection per step, for every row at once."""
