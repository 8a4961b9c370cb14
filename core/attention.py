"""The paged-attention backend contract.

Once per step the model runner flattens the scheduled requests into ``BatchInputs``; the selected
backend turns that into its own metadata with ``build_metadata`` (shared by all layers); then each
attention layer calls ``forward``, which writes the new K/V into that layer's cache at
``slot_mapping`` and attends over each request's blocks: causal inside the new tokens, full over
the cached prefix, grouped-query (``num_heads`` a multiple of ``num_kv_heads``).

KV cache of one layer: a pair ``(k_cache, v_cache)``, each ``[num_blocks, block_size,
num_kv_heads, head_dim]``. Token ``j`` of a request lives in block ``block_table[j //
block_size]`` at offset ``j % block_size``; its slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class AttentionLayout:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize * self.num_layers


@dataclass
class BatchInputs:
    """One step's batch, flattened. Requests are ordered decodes first (query length 1), then
    prefill chunks; ``num_decodes`` says where the prefills start.

    Device tensors (on the model's device):
      query_start_loc [num_reqs + 1] int32: cumulative query lengths (0, q0, q0+q1, ...)
      seq_lens        [num_reqs] int32: tokens in context after this step (computed + new)
      block_table     [num_reqs, max_blocks_per_req] int32, padded with 0
      slot_mapping    [num_tokens] int64: where each new token's K/V is written
    CPU copies (for planning without a device sync): query_start_loc_cpu, seq_lens_cpu.
    """

    num_reqs: int
    num_tokens: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor


@runtime_checkable
class AttentionBackend(Protocol):
    name: str

    def __init__(self, layout: AttentionLayout, options: Any = None) -> None: ...

    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (k_cache, v_cache) pair per layer."""
        ...

    def build_metadata(self, batch: BatchInputs) -> Any:
        """Called once per step; the result is passed to every layer's ``forward``."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: Any,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def default_allocate_kv_cache(layout: AttentionLayout, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [
        (
            torch.zeros(shape, dtype=layout.dtype, device=layout.device),
            torch.zeros(shape, dtype=layout.dtype, device=layout.device),
        )
        for _ in range(layout.num_layers)
    ]


def write_kv_by_slot(
    key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write each new token's K/V at its slot; returns the caches viewed as
    ``[num_blocks * block_size, num_kv_heads, head_dim]`` (``view``: a non-contiguous cache fails
    loudly instead of being copied)."""
    k_cache, v_cache = kv_cache
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
    return k_flat, v_flat
