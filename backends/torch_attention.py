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
     gather; option ``cpu_decode_kernel``, default on), together with the queries of at most
     ``SHORT_QUERY`` tokens that follow them (speculative verifications, short chunks: the runner
     orders requests by query length), one row per token in a group per request, each K/V tile
     read once for the group (``paged_decode_grouped``). It is built (or loaded from the build
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

Per-layer settings (``paged.core.attention.AttentionSettings``, all honoured): the scale is the
layer's (default ``head_dim ** -0.5``); a sliding window ``W`` restricts every query at position
``p`` to keys ``p - W < j <= p``: the fused kernel starts each request at ``seq_len - W``, the
decode gather zeroes and masks the rows before it, and a prefill chunk gathers only the
positions its queries can see (from ``first query - W + 1``) with a banded mask, so positions out
of the window (whose blocks the KV manager may have freed) are never read. Logit soft-capping
(``cap * tanh(s / cap)``) is in the fused kernel; elsewhere SDPA cannot do it and the layer runs
an explicit fp32 ``softmax(cap * tanh(q k^T * scale / cap)) v`` instead. Window-dependent plans
(gather rows, masks) are built lazily, once per step and distinct window, and shared by the
layers that have that window.

Invariants: caches are contiguous ``[num_blocks, block_size, num_kv_heads, head_dim]`` (as
``default_allocate_kv_cache`` makes them); ``num_heads`` is a multiple of ``num_kv_heads``
(query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``).
Attention runs in the cache dtype (the fused kernel reads it and accumulates in fp32); the output
has the query's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from paged.backends import cpu_paged_decode
from paged.core.attention import (
    DEFAULT_SETTINGS,
    FEATURES,
    AttentionLayout,
    AttentionSettings,
    BatchInputs,
    default_allocate_kv_cache,
    write_kv_by_slot,
)
from paged.core.tensors import ScratchBuffers
from paged.core.utils import cdiv


# Queries of at most this many tokens go through the fused CPU kernel, one row per token.
SHORT_QUERY = 16


class TorchAttentionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cpu_decode_kernel: bool = Field(
        True,
        description="decodes on the CPU: the fused C++ paged-decode kernel (built once per machine) instead "
        "of gather + SDPA; falls back to the gather with one warning if it cannot be built",
    )
    cpu_prefill_kernel: bool = Field(
        True,
        description="prefills on the CPU with bfloat16 caches, head dim 64 or 128, no sliding window or soft cap "
        "(CPUs with AVX512-BF16): the C++ causal kernel of the same library instead of SDPA (512 tokens of the "
        "default model 2.4x faster a layer on the 2-core EPYC: benchmarks/attention_torch.py --prefill)",
    )


@dataclass
class FusedDecodeMetadata:
    """The first ``num_decodes`` query rows, for the fused CPU kernel: it reads the block table.
    With ``groups``, request b's rows are ``groups[b] .. groups[b + 1] - 1`` (a short query, one
    row per token) and the block table has a row per request."""

    num_decodes: int  # query rows (tokens)
    block_table: torch.Tensor  # [num_decodes (or requests), max_blocks_per_req] int32
    seq_lens: torch.Tensor  # [num_decodes] int32, per row
    groups: torch.Tensor | None = None  # [requests + 1] int32


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
class PrefillPlan:
    """The prefill chunks of one step for one sliding window (None: full attention)."""

    chunks: list[PrefillChunk]
    slots: torch.Tensor  # [sum of the chunks' context lengths] int64, in chunk order


@dataclass
class _StepShape:
    """What a window's plans are built from, kept from ``build_metadata`` (CPU lists, no sync)."""

    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, on the device
    seq_lens: list[int]
    query_start_loc: list[int]
    seq_lens_cpu: torch.Tensor
    num_decodes: int
    num_reqs: int
    block_size: int
    first_prefill: int = -1  # the first request attended as a prefill chunk (-1: num_decodes)

    def __post_init__(self) -> None:
        if self.first_prefill < 0:
            self.first_prefill = self.num_decodes


@dataclass
class TorchAttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode: DecodeMetadata | FusedDecodeMetadata | None
    prefills: list[PrefillChunk] = field(default_factory=list)
    prefill_slots: torch.Tensor | None = None  # [sum of prefill seq_lens] int64, in chunk order
    fused_decode_only: bool = False  # decodes only, through the C++ kernel (cpu_paged_decode)
    shape: _StepShape | None = None
    # per sliding window (a windowed layer's first call of the step builds them): the gather
    # decode's rows and mask, the prefill chunks (window None: the full-attention plan above)
    windowed_decodes: dict[int, DecodeMetadata] = field(default_factory=dict)
    windowed_prefills: dict[int | None, PrefillPlan] = field(default_factory=dict)

    def decode_for(self, window: int | None) -> DecodeMetadata | FusedDecodeMetadata | None:
        if window is None or not isinstance(self.decode, DecodeMetadata):
            return self.decode  # the fused kernel takes the window itself
        plan = self.windowed_decodes.get(window)
        if plan is None:
            plan = self.windowed_decodes[window] = _gather_decode(self.shape, window)
        return plan

    def prefill_for(self, window: int | None) -> PrefillPlan | None:
        if not self.prefills:
            return None
        plan = self.windowed_prefills.get(window)
        if plan is None:
            plan = self.windowed_prefills[window] = _prefill_plan(self.shape, window)
        return plan


def _gather_decode(shape: _StepShape, window: int | None) -> DecodeMetadata:
    """Gather plan of the decodes: whole blocks ``block_table[:B, :num_blocks]``; rows at or past
    ``seq_len`` (and, with a window, before ``seq_len - window``) are zeroed and masked."""
    num_decodes, device = shape.num_decodes, shape.block_table.device
    num_blocks = cdiv(max(shape.seq_lens[:num_decodes]), shape.block_size)
    max_len = num_blocks * shape.block_size
    block_ids = shape.block_table[:num_decodes, :num_blocks].reshape(-1).long()
    lens = shape.seq_lens_cpu[:num_decodes, None]
    pos = torch.arange(max_len)
    is_pad = pos >= lens
    if window is not None:
        is_pad |= pos <= lens - 1 - window
    pad_rows = attn_mask = None
    if bool(is_pad.any()):  # padding found on the CPU copies: no device sync
        pad_rows = is_pad.view(-1).nonzero().view(-1).to(device)
        attn_mask = (~is_pad).view(num_decodes, 1, 1, max_len).to(device)
    return DecodeMetadata(num_decodes, num_blocks, block_ids, pad_rows, attn_mask)


def _prefill_plan(shape: _StepShape, window: int | None) -> PrefillPlan:
    """Each prefill chunk's context: the positions its queries may see, ``lo .. seq_len - 1``
    with ``lo = 0`` (full attention) or ``first query - window + 1``; the mask is bottom-right
    causal, banded by the window."""
    device, block_size = shape.block_table.device, shape.block_size
    chunks: list[PrefillChunk] = []
    slots: list[torch.Tensor] = []
    context_start = 0
    for i in range(shape.first_prefill, shape.num_reqs):
        q_start, q_end, seq_len = shape.query_start_loc[i], shape.query_start_loc[i + 1], shape.seq_lens[i]
        q_len = q_end - q_start
        first = seq_len - q_len  # the first query's position
        lo = 0 if window is None else max(0, first - window + 1)
        positions = torch.arange(lo, seq_len, device=device)
        slots.append(shape.block_table[i, positions // block_size].long() * block_size + positions % block_size)
        banded = window is not None and window < seq_len - lo  # some query would see a key out of its window
        attn_mask = None
        if banded or 1 < q_len < seq_len - lo:  # a cached prefix (bottom-right causal) or a band
            query_pos = torch.arange(first, seq_len, device=device)
            attn_mask = positions[None, :] <= query_pos[:, None]
            if banded:
                attn_mask &= positions[None, :] > query_pos[:, None] - window
        is_causal = attn_mask is None and q_len == seq_len - lo > 1
        chunks.append(PrefillChunk(q_start, q_end, context_start, context_start + seq_len - lo, attn_mask, is_causal))
        context_start += seq_len - lo
    return PrefillPlan(chunks, torch.cat(slots))


def _rows_of_heads(t: torch.Tensor) -> bool:
    """``[T, H, D]`` whose heads are contiguous (what the kernel library's KV write reads)."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def soft_capped_attention(q, k, v, allowed, scale: float, cap: float) -> torch.Tensor:
    """``softmax(cap * tanh(q k^T * scale / cap)) v`` in fp32 (SDPA has no soft-cap):
    ``q`` [B, Q, H, D], ``k``/``v`` [B, L, Hkv, D], ``allowed`` [B, Q, L] bool (True = attend)
    or None (full); returns fp32 [B, Q, H, D]."""
    b, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qf = q.float().reshape(b, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Q, D]
    kf = k.float().permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, L, D]
    vf = v.float().permute(0, 2, 1, 3).unsqueeze(2)
    scores = torch.tanh(torch.matmul(qf, kf.transpose(-1, -2)) * (scale / cap)) * cap  # [B, Hkv, G, Q, L]
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [B, Hkv, G, Q, D]
    return o.permute(0, 3, 1, 2, 4).reshape(b, q_len, num_heads, head_dim)


class TorchAttentionBackend:
    """Paged attention with ``index_select`` gathers and ``scaled_dot_product_attention``; CPU
    decodes through the fused kernel."""

    name = "torch"
    layer_features = FEATURES  # sliding window, logit soft-cap, per-layer scale

    def __init__(self, layout: AttentionLayout, options: TorchAttentionOptions | None = None) -> None:
        if layout.num_heads % layout.num_kv_heads:
            raise ValueError(f"num_heads {layout.num_heads} is not a multiple of num_kv_heads {layout.num_kv_heads}")
        self.layout = layout
        self.options = options or TorchAttentionOptions()
        self._kernel: Callable[..., None] | None = None  # cpu_paged_decode: (q, k/v_cache, table, lens, scale, out)
        # (q, key, value, k_cache, v_cache, slot_mapping, block_table, seq_lens, scale) -> out
        self._write_and_decode: Callable[..., torch.Tensor] | None = None
        # (q [Lq, H, D], k, v [Lk, Hkv, D], out, scale): a chunk's bottom-right causal prefill, bf16
        self._prefill_causal: Callable[..., None] | None = None
        if (self.options.cpu_decode_kernel or self.options.cpu_prefill_kernel) and layout.device.type == "cpu":
            kernels = cpu_paged_decode.kernels()  # built once per process; None (warned) if it cannot be
            if kernels is not None and self.options.cpu_decode_kernel:
                self._kernel, self._write_and_decode = kernels.paged_decode, kernels.write_and_decode
                self._kernel_grouped = kernels.paged_decode_grouped
                self._write_and_decode_grouped = kernels.write_and_decode_grouped
            if (kernels is not None and self.options.cpu_prefill_kernel and getattr(kernels, "has_prefill_causal", False)
                    and layout.head_dim in (64, 128)):
                self._prefill_causal = kernels.prefill_causal
        self._buffers = ScratchBuffers()  # gather scratch, reused by every layer and step

    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return default_allocate_kv_cache(self.layout, num_blocks)

    def native_decode(self) -> tuple[Any, Any] | None:
        """The C++ functions ``forward`` calls for a step of decodes only (``fused_decode_only``),
        as capsules for native callers that make the same call (``cpu_layer_ops.DecoderPlan``):
        ``(write_and_decode, write_and_decode_grouped)``; None without the kernel, or where
        ``forward`` is not this class's."""
        if (self._write_and_decode is None or type(self).forward is not TorchAttentionBackend.forward
                or "forward" in self.__dict__):
            return None
        kernels = cpu_paged_decode.kernels()
        return kernels.write_and_decode_capsule, kernels.write_and_decode_grouped_capsule

    # ---- once per step -------------------------------------------------------------------------

    def build_metadata(self, batch: BatchInputs) -> TorchAttentionMetadata:
        block_size = self.layout.block_size
        seq_lens = batch.seq_lens_cpu.tolist()
        query_start_loc = batch.query_start_loc_cpu.tolist()
        num_decodes = batch.num_decodes

        assert query_start_loc[num_decodes] == num_decodes, "decodes (query length 1) must come first"
        shape = _StepShape(batch.block_table, seq_lens, query_start_loc, batch.seq_lens_cpu, num_decodes,
                           batch.num_reqs, block_size)
        decode = None
        if self._kernel is not None:
            decode = self._fused_rows(batch, shape, seq_lens, query_start_loc)
        elif num_decodes:
            decode = _gather_decode(shape, None)
        plan = _prefill_plan(shape, None) if batch.num_reqs > shape.first_prefill else None

        return TorchAttentionMetadata(
            num_tokens=batch.num_tokens,
            slot_mapping=batch.slot_mapping.long(),
            decode=decode,
            prefills=plan.chunks if plan else [],
            prefill_slots=plan.slots if plan else None,
            fused_decode_only=isinstance(decode, FusedDecodeMetadata) and plan is None,
            shape=shape,
            windowed_prefills={} if plan is None else {None: plan},
        )

    def _fused_rows(self, batch: BatchInputs, shape: _StepShape, seq_lens: list[int],
                    query_start_loc: list[int]) -> FusedDecodeMetadata | None:
        """The fused kernel's rows: every decode, and each token of the short queries right after
        them (query length <= ``SHORT_QUERY``: speculative verification, short prompts) as a row
        that attends over the positions up to its own, the rows of one request in one group (the
        kernel reads each K/V tile once for the group, through the block table, instead of a
        gathered copy of the context). The requests from ``shape.first_prefill`` on are prefill
        chunks."""
        num_decodes, num_reqs = batch.num_decodes, batch.num_reqs
        first = num_decodes
        while first < num_reqs and query_start_loc[first + 1] - query_start_loc[first] <= SHORT_QUERY:
            first += 1
        shape.first_prefill = first
        if first == num_decodes:
            if not num_decodes:
                return None
            return FusedDecodeMetadata(num_decodes, batch.block_table[:num_decodes], batch.seq_lens[:num_decodes])
        lens = seq_lens[:num_decodes]
        for i in range(num_decodes, first):
            q_len = query_start_loc[i + 1] - query_start_loc[i]
            lens.extend(range(seq_lens[i] - q_len + 1, seq_lens[i] + 1))
        device = batch.block_table.device
        groups = torch.tensor(query_start_loc[: first + 1], dtype=torch.int32).to(device)
        return FusedDecodeMetadata(len(lens), batch.block_table[:first], torch.tensor(lens, dtype=torch.int32).to(device),
                                   groups)

    # ---- per layer -----------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: TorchAttentionMetadata,
        settings: AttentionSettings = DEFAULT_SETTINGS,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        scale = self.layout.scale if settings.scale is None else settings.scale
        window, cap = settings.sliding_window, settings.logits_soft_cap
        decode = metadata.decode
        if (metadata.fused_decode_only and query.dtype == k_cache.dtype and query.stride(-1) == 1
                and _rows_of_heads(key) and _rows_of_heads(value)):
            # a step of decodes only (the steady state), or of short queries: KV write and attention in one C++ call
            if decode.groups is not None:
                return self._write_and_decode_grouped(query, key, value, k_cache, v_cache, metadata.slot_mapping,
                                                      decode.block_table, decode.seq_lens, decode.groups, scale,
                                                      window or 0, cap or 0.0)
            return self._write_and_decode(query, key, value, k_cache, v_cache, metadata.slot_mapping,
                                          decode.block_table, decode.seq_lens, scale, window or 0, cap or 0.0)
        k_flat, v_flat = write_kv_by_slot(key, value, kv_cache, metadata.slot_mapping)

        q = query.to(k_cache.dtype)
        out = torch.empty(query.shape, dtype=k_cache.dtype, device=query.device)
        if isinstance(decode, FusedDecodeMetadata):
            b = decode.num_decodes
            q_dec = q[:b] if q.stride(-1) == 1 else q[:b].contiguous()
            if decode.groups is not None:
                self._kernel_grouped(q_dec, k_cache, v_cache, decode.block_table, decode.seq_lens, decode.groups, scale,
                                     out[:b], window or 0, cap or 0.0)
            else:
                self._kernel(q_dec, k_cache, v_cache, decode.block_table, decode.seq_lens, scale, out[:b],
                             window or 0, cap or 0.0)
        elif decode is not None:
            self._decode(q, k_cache, v_cache, metadata.decode_for(window), out, scale, cap)
        plan = metadata.prefill_for(window)
        if plan is not None:
            self._prefill(q, k_flat, v_flat, plan, out, scale, cap, window)
        return out.to(query.dtype)

    def _decode(self, q, k_cache, v_cache, meta: DecodeMetadata, out, scale: float, cap: float | None) -> None:
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
        if cap is not None:
            allowed = None if meta.attn_mask is None else meta.attn_mask.view(batch, 1, max_len)
            o = soft_capped_attention(q[:batch].unsqueeze(1), kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                      allowed, scale, cap)  # [B, 1, H, D]
            out[:batch] = o.squeeze(1)
            return
        o = F.scaled_dot_product_attention(
            q[:batch].unsqueeze(2), kv[0], kv[1], attn_mask=meta.attn_mask, scale=scale, enable_gqa=True
        )  # [B, H, 1, D]
        out[:batch] = o.squeeze(2)

    def _prefill(self, q, k_flat, v_flat, plan: PrefillPlan, out, scale: float, cap: float | None,
                 window: int | None = None) -> None:
        shape = (plan.slots.numel(), *k_flat.shape[1:])
        k_ctx = torch.index_select(k_flat, 0, plan.slots, out=self._scratch("prefill_k", shape, k_flat))
        v_ctx = torch.index_select(v_flat, 0, plan.slots, out=self._scratch("prefill_v", shape, v_flat))
        # without a window every chunk is bottom-right causal over its whole context: the C++ kernel
        kernel = self._prefill_causal if cap is None and window is None and q.dtype == torch.bfloat16 else None
        for c in plan.chunks:
            if kernel is not None:
                kernel(q[c.query_start : c.query_end], k_ctx[c.context_start : c.context_end],
                       v_ctx[c.context_start : c.context_end], out[c.query_start : c.query_end], scale)
                continue
            if cap is not None:
                q_len, ctx_len = c.query_end - c.query_start, c.context_end - c.context_start
                allowed = c.attn_mask
                if allowed is None and c.is_causal:
                    allowed = torch.ones(q_len, ctx_len, dtype=torch.bool, device=q.device).tril_()
                o = soft_capped_attention(
                    q[c.query_start : c.query_end].unsqueeze(0), k_ctx[c.context_start : c.context_end].unsqueeze(0),
                    v_ctx[c.context_start : c.context_end].unsqueeze(0),
                    None if allowed is None else allowed.unsqueeze(0), scale, cap,
                )
                out[c.query_start : c.query_end] = o[0]
                continue
            o = F.scaled_dot_product_attention(
                q[c.query_start : c.query_end].transpose(0, 1).unsqueeze(0),  # [1, H, q_len, D]
                k_ctx[c.context_start : c.context_end].transpose(0, 1).unsqueeze(0),  # [1, Hkv, seq_len, D]
                v_ctx[c.context_start : c.context_end].transpose(0, 1).unsqueeze(0),
                attn_mask=c.attn_mask,
                is_causal=c.is_causal,
                scale=scale,
                enable_gqa=True,
            )
            out[c.query_start : c.query_end] = o[0].transpose(0, 1)

    def _scratch(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return self._buffers.get(name, shape, like.dtype, like.device)
