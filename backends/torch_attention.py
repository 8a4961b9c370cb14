"""The reference paged-attention backend: plain PyTorch, any device, fp32 / bf16 / fp16.

One step: ``build_metadata`` turns the ``BatchInputs`` into gather indices and masks (once, shared
by every layer); each layer's ``forward`` then

1. writes the new K/V into its cache at ``slot_mapping`` (``index_copy_`` on the cache flattened
   to ``[num_blocks * block_size, num_kv_heads, head_dim]``; in a step of decodes only on the
   CPU, the kernel library's ``write_and_decode``: KV write and attention in one call), before
   anything is read, so a request may read blocks that another request of the same step has just written;
2. attends, decodes and prefill chunks separately:

   - decodes (query length 1, the first ``num_decodes`` requests) on the CPU: one call of the
     fused C++ kernel of ``cpu_paged_decode`` (online softmax straight over the block table, no
     gather; option ``cpu_decode_kernel``, default on). It is built (or loaded from the build
     cache) when the first CPU backend of the process is constructed, so that a first build's
     seconds fall in start-up and not in a step; if it cannot be built (no compiler, no ninja)
     the backend warns once and takes the path below;
   - decodes on other devices (or without the kernel), as one batch: whole blocks
     ``block_table[:B, :num_blocks]`` are gathered with ``index_select`` into a persistent buffer
     viewed as ``[B, max_len, Hkv, D]``, the rows past each request's ``seq_len`` are zeroed (the
     padding blocks and the stale tail of the last block may hold anything, even NaN: a masked
     NaN still poisons a softmax), and one SDPA call with ``enable_gqa=True`` and a key-padding
     mask attends over the strided ``[B, Hkv, max_len, D]`` view (no ``repeat_interleave``, no
     ``.contiguous()``: both measured slower, see benchmarks/attention_torch.py);
   - prefill chunks, one SDPA call each (there are few per step): the chunk's context, exactly
     positions ``0 .. seq_len - 1``, is gathered token by token through its slots. The queries
     are the last ``q_len`` of those positions, so query ``t`` sees positions
     ``<= seq_len - q_len + t``: a bottom-right causal mask. SDPA's ``is_causal`` is top-left
     aligned and is used only when there is no cached prefix (``q_len == seq_len``).

Invariants: caches are contiguous ``[num_blocks, block_size, num_kv_heads, head_dim]`` (as
``default_allocate_kv_cache`` makes them); ``num_heads`` is a multiple of ``num_kv_heads``
(query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``); scale ``head_dim ** -0.5``.
Attention runs in the cache dtype (the fused kernel reads it and accumulates in fp32); the output
has the query's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from paged.backends import cpu_paged_decode
from paged.core.attention import AttentionLayout, BatchInputs, default_allocate_kv_cache, write_kv_by_slot
from paged.core.utils import ScratchBuffers, cdiv


class TorchAttentionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cpu_decode_kernel: bool = Field(
        True,
        description="decodes on the CPU: the fused C++ paged-decode kernel (built once per machine) instead "
        "of gather + SDPA; falls back to the gather with one warning if it cannot be built",
    )


@dataclass
class FusedDecodeMetadata:
    """The first ``num_decodes`` requests, for the fused CPU kernel: it reads the block table."""

    num_decodes: int
    block_table: torch.Tensor  # [num_decodes, max_blocks_per_req] int32
    seq_lens: torch.Tensor  # [num_decodes] int32


@dataclass
class DecodeMetadata:
    """The first ``num_decodes`` requests, gathered as a padded batch of ``max_len`` positions."""

    num_decodes: int
    num_blocks: int  # blocks gathered per request: enough for the longest decode context
    block_ids: torch.Tensor  # [num_decodes * num_blocks] int64: block_table[:B, :num_blocks]
    pad_rows: torch.Tensor | None  # [n] int64 rows b * max_len + j, j >= seq_lens[b]; None if n == 0
    attn_mask: torch.Tensor | None  # [B, 1, 1, max_len] bool, True = attend; None if no padding


@dataclass
class PrefillChunk:
    """One prefill request: queries ``query_start:query_end``, context rows
    ``context_start:context_end`` of the gathered prefill context."""

    query_start: int
    query_end: int
    context_start: int
    context_end: int
    attn_mask: torch.Tensor | None  # [q_len, seq_len] bool bottom-right causal, None if not needed
    is_causal: bool  # no cached prefix (q_len == seq_len): top-left equals bottom-right


@dataclass
class TorchAttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode: DecodeMetadata | FusedDecodeMetadata | None
    prefills: list[PrefillChunk] = field(default_factory=list)
    prefill_slots: torch.Tensor | None = None  # [sum of prefill seq_lens] int64, in chunk order
    fused_decode_only: bool = False  # decodes only, through the C++ kernel (cpu_paged_decode)


class TorchAttentionBackend:
    """Paged attention with ``index_select`` gathers and ``scaled_dot_product_attention``; CPU
    decodes through the fused kernel."""

    name = "torch"

    def __init__(self, layout: AttentionLayout, options: TorchAttentionOptions | None = None) -> None:
        if layout.num_heads % layout.num_kv_heads:
            raise ValueError(f"num_heads {layout.num_heads} is not a multiple of num_kv_heads {layout.num_kv_heads}")
        self.layout = layout
        self.options = options or TorchAttentionOptions()
        self._kernel: Callable[..., None] | None = None  # cpu_paged_decode: (q, k/v_cache, table, lens, scale, out)
        # (q, key, value, k_cache, v_cache, slot_mapping, block_table, seq_lens, scale) -> out
        self._write_and_decode: Callable[..., torch.Tensor] | None = None
        if self.options.cpu_decode_kernel and layout.device.type == "cpu":
            kernels = cpu_paged_decode.kernels()  # built once per process; None (warned) if it cannot be
            if kernels is not None:
                self._kernel, self._write_and_decode = kernels.paged_decode, kernels.write_and_decode
        self._buffers = ScratchBuffers()  # gather scratch, reused by every layer and step

    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return default_allocate_kv_cache(self.layout, num_blocks)

    # ---- once per step -------------------------------------------------------------------------

    def build_metadata(self, batch: BatchInputs) -> TorchAttentionMetadata:
        device = batch.block_table.device
        block_size = self.layout.block_size
        seq_lens = batch.seq_lens_cpu.tolist()
        query_start_loc = batch.query_start_loc_cpu.tolist()
        num_decodes = batch.num_decodes

        assert query_start_loc[num_decodes] == num_decodes, "decodes (query length 1) must come first"
        decode = None
        if num_decodes and self._kernel is not None:
            decode = FusedDecodeMetadata(num_decodes, batch.block_table[:num_decodes], batch.seq_lens[:num_decodes])
        elif num_decodes:
            num_blocks = cdiv(max(seq_lens[:num_decodes]), block_size)
            max_len = num_blocks * block_size
            block_ids = batch.block_table[:num_decodes, :num_blocks].reshape(-1).long()
            # padding found on the CPU copies: no device sync
            is_pad = torch.arange(max_len) >= batch.seq_lens_cpu[:num_decodes, None]
            pad_rows = attn_mask = None
            if bool(is_pad.any()):
                pad_rows = is_pad.view(-1).nonzero().view(-1).to(device)
                attn_mask = (~is_pad).view(num_decodes, 1, 1, max_len).to(device)
            decode = DecodeMetadata(num_decodes, num_blocks, block_ids, pad_rows, attn_mask)

        prefills: list[PrefillChunk] = []
        slots: list[torch.Tensor] = []
        context_start = 0
        for i in range(num_decodes, batch.num_reqs):
            q_start, q_end, seq_len = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
            q_len = q_end - q_start
            positions = torch.arange(seq_len, device=device)
            slots.append(batch.block_table[i, positions // block_size].long() * block_size + positions % block_size)
            attn_mask = None
            if 1 < q_len < seq_len:  # cached prefix: bottom-right causal
                query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                attn_mask = positions[None, :] <= query_pos[:, None]
            prefills.append(
                PrefillChunk(q_start, q_end, context_start, context_start + seq_len, attn_mask, q_len == seq_len > 1)
            )
            context_start += seq_len

        return TorchAttentionMetadata(
            num_tokens=batch.num_tokens,
            slot_mapping=batch.slot_mapping.long(),
            decode=decode,
            prefills=prefills,
            prefill_slots=torch.cat(slots) if slots else None,
            fused_decode_only=isinstance(decode, FusedDecodeMetadata) and not prefills,
        )

    # ---- per layer -----------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        decode = metadata.decode
        if metadata.fused_decode_only and query.dtype == k_cache.dtype and query.stride(-1) == 1:
            # a step of decodes only (the steady state): KV write and attention in one C++ call
            return self._write_and_decode(query, key, value, k_cache, v_cache, metadata.slot_mapping,
                                          decode.block_table, decode.seq_lens, self.layout.scale)
        k_flat, v_flat = write_kv_by_slot(key, value, kv_cache, metadata.slot_mapping)

        q = query.to(k_cache.dtype)
        out = torch.empty(query.shape, dtype=k_cache.dtype, device=query.device)
        if isinstance(decode, FusedDecodeMetadata):
            b = decode.num_decodes
            q_dec = q[:b] if q.stride(-1) == 1 else q[:b].contiguous()
            self._kernel(q_dec, k_cache, v_cache, decode.block_table, decode.seq_lens, self.layout.scale, out[:b])
        elif decode is not None:
            self._decode(q, k_cache, v_cache, decode, out)
        if metadata.prefills:
            self._prefill(q, k_flat, v_flat, metadata, out)
        return out.to(query.dtype)

    def _decode(self, q, k_cache, v_cache, meta: DecodeMetadata, out) -> None:
        batch, num_blocks = meta.num_decodes, meta.num_blocks
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        max_len = num_blocks * block_size
        shape = (batch * num_blocks, block_size, num_kv_heads, head_dim)
        kv = []
        for name, cache in (("decode_k", k_cache), ("decode_v", v_cache)):
            buf = self._scratch(name, shape, cache)
            torch.index_select(cache, 0, meta.block_ids, out=buf)
            rows = buf.view(batch * max_len, num_kv_heads, head_dim)
            if meta.pad_rows is not None:
                rows.index_fill_(0, meta.pad_rows, 0)
            kv.append(rows.view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2))  # strided view
        o = F.scaled_dot_product_attention(
            q[:batch].unsqueeze(2), kv[0], kv[1], attn_mask=meta.attn_mask, scale=self.layout.scale, enable_gqa=True
        )  # [B, H, 1, D]
        out[:batch] = o.squeeze(2)

    def _prefill(self, q, k_flat, v_flat, meta: TorchAttentionMetadata, out) -> None:
        shape = (meta.prefill_slots.numel(), *k_flat.shape[1:])
        k_ctx = torch.index_select(k_flat, 0, meta.prefill_slots, out=self._scratch("prefill_k", shape, k_flat))
        v_ctx = torch.index_select(v_flat, 0, meta.prefill_slots, out=self._scratch("prefill_v", shape, v_flat))
        for c in meta.prefills:
            o = F.scaled_dot_product_attention(
                q[c.query_start : c.query_end].transpose(0, 1).unsqueeze(0),  # [1, H, q_len, D]
                k_ctx[c.context_start : c.context_end].transpose(0, 1).unsqueeze(0),  # [1, Hkv, seq_len, D]
                v_ctx[c.context_start : c.context_end].transpose(0, 1).unsqueeze(0),
                attn_mask=c.attn_mask,
                is_causal=c.is_causal,
                scale=self.layout.scale,
                enable_gqa=True,
            )
            out[c.query_start : c.query_end] = o[0].transpose(0, 1)

    def _scratch(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return self._buffers.get(name, shape, like.dtype, like.device)
