"""Paged attention in Triton: one KV-write kernel and one attention kernel for decodes and
prefill chunks alike (plus a small kernel that merges split-KV partial results).

Kernels (built on first use by ``_kernels()``; importing this module does not import Triton)
--------------------------------------------------------------------------------------------
``write_kv``: grid ``cdiv(num_tokens, BLOCK_T)``. Each program copies ``BLOCK_T`` tokens' K and V
rows (``num_kv_heads * head_dim`` values each, the column axis padded to a power of two and
masked) to ``(slot // block_size, slot % block_size)`` of the caches, converting to the cache
dtype. A negative slot is skipped.

``paged_attention``: grid ``(num_tiles, num_kv_heads, num_splits)``. A *tile* is up to ``BLOCK_Q``
consecutive query tokens of one request (a decode is one tile of one token); the host lists the
tiles once per step (``tile_req``, ``tile_start``). A program takes one tile and one KV head and
handles the ``GROUP = num_heads // num_kv_heads`` query heads that share that KV head together:
its ``BLOCK_M = BLOCK_Q * GROUP_P`` rows are (token, head) pairs, row ``r`` = token ``r //
GROUP_P``, head ``kv_head * GROUP + r % GROUP_P`` (``GROUP_P`` = GROUP rounded up to a power of
two; the extra rows are masked), so each K/V tile is read once for the whole group. It walks the
request's keys ``BLOCK_N`` at a time: for key position ``j`` it reads the block id
``block_table[req, j // block_size]`` and the row at offset ``j % block_size`` (any power-of-two
block size, also 1 or larger than ``BLOCK_N``), computes ``S = Q K^T`` with ``tl.dot`` and keeps
an online softmax (running max ``m``, sum ``l``, accumulator, base-2 exponentials with
``scale * log2(e)`` folded in). The mask is bottom-right causal: query token ``t`` of a request
with ``q_len`` new tokens and ``seq_len`` context sits at position ``seq_len - q_len + t`` and
sees keys ``<= `` that position; the walk stops at the last key the tile's last query sees, so
no key past ``seq_len`` is ever read. Per-layer settings (``AttentionSettings``): the layer's
scale; a sliding window ``W`` (``WINDOWED``) starts the walk at the tile's first query position
``- W + 1`` (so keys out of every query's window, whose blocks may be freed, are never read) and
bands the mask (``k_pos > q_pos - W``); a logit soft-cap (``SOFT_CAP``) turns the scaled scores
into ``cap * tanh(s / cap)`` (tanh from ``exp``: stable at both ends) before the softmax. Both are
constexpr switches, so a layer without them runs the kernel it ran before. Head dims that are
not a power of two (80) are padded to one (128) and masked on every load and store. Every load is masked (``other=0``), so stale or
NaN cache rows, padding entries of the block table and padded rows never enter the sums.

Decodes and prefill chunks go through the same kernel in two launches per layer (requests are
ordered decodes first): decode tiles with a small ``BLOCK_M`` (``block_m_decode``), prefill tiles
with a larger one (``block_m_prefill``); every ``tl.dot`` operand is at least 16 x 16, as the GPU
compiler requires.

Split KV (flash-decoding): when a launch has fewer programs than the GPU has SMs (batch-1
decode), each tile's key range is cut into ``num_splits`` pieces, one program each; they store
unnormalised partial results (``acc``, ``m``, ``l``) in fp32 scratch, and ``merge_splits`` (grid:
one program per token) rescales and sums them. ``num_kv_splits`` (option) forces a count.

Dtypes: the caches may be fp32, fp16 or bf16; queries are converted to the cache dtype (as the
torch backend does), scores and the accumulator are fp32. fp16/bf16 tiles go to ``tl.dot`` as
they are (fp32 accumulation); fp32 uses ``input_precision="ieee"`` (no TF32). Under the
interpreter (``TRITON_INTERPRET=1``) bf16 arithmetic is wrong, so there bf16 tiles are upcast to
fp32 first. The output has the cache dtype, then the query's dtype.

On the CPU the kernels run only under ``TRITON_INTERPRET=1`` (correctness tests). Triton reads the
variable when it is first imported (its standard library, ``tl.zeros``, ``tl.max``..., is jit'd
then) and when our kernels are built (first backend construction): set it before both.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from paged.core.attention import (
    DEFAULT_SETTINGS,
    FEATURES,
    AttentionLayout,
    AttentionSettings,
    BatchInputs,
    default_allocate_kv_cache,
)
from paged.core.tensors import ScratchBuffers
from paged.core.utils import cdiv

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
tl: Any = None  # triton.language, bound by _kernels()


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def is_available(device: str) -> tuple[bool, str]:
    """Cheap (no Triton import) and never raises."""
    try:
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed: pip install 'paged[triton]'"
    except (ImportError, ValueError):
        return False, "triton is not installed: pip install 'paged[triton]'"
    if device == "cuda":
        return True, ""
    if interpreter_enabled():
        return True, ""
    return False, "Triton kernels need a CUDA GPU; on the CPU they run only under TRITON_INTERPRET=1"


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class TritonAttentionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    block_m_decode: int = Field(16, description="rows (query tokens x grouped heads) per decode tile")
    block_m_prefill: int = Field(64, description="rows (query tokens x grouped heads) per prefill tile")
    block_n: int = Field(64, description="keys per step of the softmax loop")
    num_kv_splits: int = Field(
        0, ge=0, le=64, description="split each tile's keys across programs; 0 = auto (fill the GPU's SMs), 1 = never"
    )
    max_kv_splits: int = Field(16, ge=1, le=64, description="upper bound of the automatic split count")
    num_warps: int = Field(4, ge=1, le=16)

    @field_validator("block_m_decode", "block_m_prefill", "block_n")
    @classmethod
    def _tile(cls, v: int) -> int:
        if v < 16 or v > 256 or v & (v - 1):
            raise ValueError(f"must be a power of two between 16 and 256 (tl.dot tiles), got {v}")
        return v


@dataclass
class Launch:
    """One attention launch over a contiguous range of requests (the decodes, or the prefill
    chunks) whose query tokens are ``[tok_lo, tok_hi)`` of the step."""

    tile_req: torch.Tensor  # [num_tiles] int32: request index of each tile
    tile_start: torch.Tensor  # [num_tiles] int32: first query token of the tile, within its request
    num_tiles: int
    block_m: int
    block_q: int
    num_splits: int
    tok_lo: int
    tok_hi: int


@dataclass
class TritonAttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32 (device)
    seq_lens: torch.Tensor  # [num_reqs] int32 (device)
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32 (device)
    launches: list[Launch]


def tile_map(query_lens: np.ndarray, req_offset: int, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """Tiles of ``block_q`` query tokens for requests whose query lengths are ``query_lens`` (the
    first one being request ``req_offset``): (request index, first token within the request)."""
    n_tiles = cdiv(query_lens, block_q)
    reqs = np.repeat(np.arange(len(query_lens), dtype=np.int64) + req_offset, n_tiles)
    first = np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    starts = (np.arange(int(n_tiles.sum()), dtype=np.int64) - first) * block_q
    return reqs.astype(np.int32), starts.astype(np.int32)


class TritonAttentionBackend:
    """Paged attention with Triton kernels (see the module docstring)."""

    name = "triton"
    layer_features = FEATURES  # sliding window, logit soft-cap, per-layer scale

    def __init__(self, layout: AttentionLayout, options: TritonAttentionOptions | None = None) -> None:
        if layout.num_heads % layout.num_kv_heads:
            raise ValueError(f"num_heads {layout.num_heads} is not a multiple of num_kv_heads {layout.num_kv_heads}")
        if layout.dtype not in _DTYPES:
            raise ValueError(f"triton attention: unsupported KV cache dtype {layout.dtype}")
        bs = layout.block_size
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"triton attention: block_size must be a power of two, got {bs}")
        self.layout = layout
        self.options = options or TritonAttentionOptions()
        device = torch.device(layout.device)
        self.interpret = interpreter_enabled()
        if device.type != "cuda" and not self.interpret:
            raise RuntimeError(
                "Triton kernels need a CUDA GPU; on the CPU they run only under TRITON_INTERPRET=1"
            )
        self.kernels = _kernels(self.interpret)
        self.group = layout.num_heads // layout.num_kv_heads
        self.group_p = _pow2(self.group)
        self.head_dim_p = max(16, _pow2(layout.head_dim))
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        # bf16 arithmetic is wrong in the interpreter: upcast there; fp32 tiles use exact fp32 dots
        self.upcast = self.interpret and layout.dtype == torch.bfloat16
        self.dot_precision = "ieee" if layout.dtype == torch.float32 or self.upcast else "tf32"
        self._scratch = ScratchBuffers()  # fp32 split partials, grown on demand

    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return default_allocate_kv_cache(self.layout, num_blocks)

    # ---- once per step -------------------------------------------------------------------------

    def _block_m(self, block_m: int) -> tuple[int, int]:
        block_m = max(block_m, self.group_p)
        return block_m, block_m // self.group_p

    def _num_splits(self, num_tiles: int, max_kv_len: int) -> int:
        opts = self.options
        if opts.num_kv_splits:
            return opts.num_kv_splits
        programs = num_tiles * self.layout.num_kv_heads
        if self.interpret or programs >= self.num_sms:
            return 1
        # enough programs to cover the SMs twice, each with at least 4 key steps
        by_sms = -(-2 * self.num_sms // programs)
        by_len = max(1, max_kv_len // (4 * opts.block_n))
        return max(1, min(opts.max_kv_splits, by_sms, by_len))

    def build_metadata(self, batch: BatchInputs) -> TritonAttentionMetadata:
        device = batch.block_table.device
        qsl = batch.query_start_loc_cpu.numpy().astype(np.int64)
        seq_lens = batch.seq_lens_cpu.numpy().astype(np.int64)
        nd, nr = batch.num_decodes, batch.num_reqs
        assert qsl[nd] == nd, "decodes (query length 1) must come first"
        launches = []
        for lo, hi, block_m in ((0, nd, self.options.block_m_decode), (nd, nr, self.options.block_m_prefill)):
            if hi <= lo:
                continue
            block_m, block_q = self._block_m(block_m)
            reqs, starts = tile_map(qsl[lo + 1 : hi + 1] - qsl[lo:hi], lo, block_q)
            num_splits = self._num_splits(len(reqs), int(seq_lens[lo:hi].max()))
            launches.append(
                Launch(
                    tile_req=torch.from_numpy(reqs).to(device, non_blocking=True),
                    tile_start=torch.from_numpy(starts).to(device, non_blocking=True),
                    num_tiles=len(reqs),
                    block_m=block_m,
                    block_q=block_q,
                    num_splits=num_splits,
                    tok_lo=int(qsl[lo]),
                    tok_hi=int(qsl[hi]),
                )
            )
        return TritonAttentionMetadata(
            num_tokens=batch.num_tokens,
            slot_mapping=batch.slot_mapping.long(),
            query_start_loc=batch.query_start_loc.int(),
            seq_lens=batch.seq_lens.int(),
            block_table=batch.block_table.int(),
            launches=launches,
        )

    # ---- per layer -----------------------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: TritonAttentionMetadata,
        settings: AttentionSettings = DEFAULT_SETTINGS,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        out_dtype = query.dtype
        self.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        # attention runs in the cache dtype (as in the torch backend); converting here, not in the
        # kernel, keeps the rounding torch's (the interpreter's bf16 conversion differs)
        query = query.to(k_cache.dtype)
        out = torch.empty(query.shape, dtype=k_cache.dtype, device=query.device)
        for launch in metadata.launches:
            self._attend(query, k_cache, v_cache, out, metadata, launch, settings)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        key = key.to(k_cache.dtype)  # no-op in the engine (activations have the cache dtype)
        value = value.to(v_cache.dtype)
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        width = num_kv_heads * head_dim
        width_p = _pow2(width)
        block_t = 16 if self.interpret else max(1, min(8, 8192 // width_p))  # <= 8K values per program
        self.kernels.write_kv[(cdiv(num_tokens, block_t),)](
            key, value, k_cache, v_cache, slot_mapping, num_tokens,
            key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, WIDTH=width, WIDTH_P=width_p, BLOCK_T=block_t,
            num_warps=4,
        )

    def _attend(self, query, k_cache, v_cache, out, meta: TritonAttentionMetadata, launch: Launch,
                settings: AttentionSettings) -> None:
        layout = self.layout
        num_heads, head_dim = layout.num_heads, layout.head_dim
        split = launch.num_splits > 1
        if split:
            n_tok = launch.tok_hi - launch.tok_lo
            acc = self._scratch.get("acc", (launch.num_splits, n_tok, num_heads, head_dim), torch.float32, query.device)
            ml = self._scratch.get("ml", (2, launch.num_splits, n_tok, num_heads), torch.float32, query.device)
            dst, m_buf, l_buf = acc, ml[0], ml[1]
            s_dst, t_dst, h_dst, d_dst = acc.stride()
            s_ml, t_ml, h_ml = m_buf.stride()
        else:
            dst, m_buf, l_buf = out, out, out  # m/l unused without splits
            s_dst = 0
            t_dst, h_dst, d_dst = out.stride()
            s_ml = t_ml = h_ml = 0
        self.kernels.paged_attention[(launch.num_tiles, layout.num_kv_heads, launch.num_splits)](
            query, k_cache, v_cache, dst, m_buf, l_buf,
            meta.block_table, meta.seq_lens, meta.query_start_loc, launch.tile_req, launch.tile_start,
            settings.softmax_scale(head_dim), settings.sliding_window or 0, float(settings.logits_soft_cap or 1.0),
            launch.num_splits, launch.tok_lo if split else 0,
            query.stride(0), query.stride(1), query.stride(2),
            t_dst, h_dst, d_dst, s_dst,
            t_ml, h_ml, s_ml,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            meta.block_table.stride(0),
            GROUP=self.group, GROUP_P=self.group_p, BLOCK_M=launch.block_m, BLOCK_Q=launch.block_q,
            BLOCK_N=self.options.block_n, HEAD_DIM=head_dim, HEAD_DIM_P=self.head_dim_p,
            BLOCK_SIZE=k_cache.shape[1], SPLIT=split, UPCAST=self.upcast, DOT_PRECISION=self.dot_precision,
            WINDOWED=settings.sliding_window is not None, SOFT_CAP=settings.logits_soft_cap is not None,
            num_warps=self.options.num_warps,
        )
        if split:
            n_tok = launch.tok_hi - launch.tok_lo
            o = out[launch.tok_lo : launch.tok_hi]
            self.kernels.merge_splits[(n_tok,)](
                acc, m_buf, l_buf, o, launch.num_splits,
                s_dst, t_dst, h_dst, d_dst, s_ml, t_ml, h_ml,
                o.stride(0), o.stride(1), o.stride(2),
                NUM_HEADS=num_heads, HEADS_P=_pow2(num_heads), HEAD_DIM=head_dim, HEAD_DIM_P=self.head_dim_p,
                num_warps=4,
            )


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """Build the kernels (imports Triton). ``interpret`` must equal the current
    ``TRITON_INTERPRET`` setting: Triton reads it when the functions are decorated."""
    assert interpret == interpreter_enabled()
    global tl  # the interpreter looks for triton.language among the kernels' globals
    import triton
    import triton.language as tl

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.zeros, InterpretedFunction):  # tl.zeros, tl.max, ... were jit'd for a GPU
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton had been imported; set it before the first "
                "`import triton` (Triton builds its standard library when it is imported)"
            )

    @triton.jit
    def write_kv(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_kcb, stride_kco, stride_kch, stride_kcd,
        stride_vcb, stride_vco, stride_vch, stride_vcd,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, WIDTH: tl.constexpr, WIDTH_P: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        col = tl.arange(0, WIDTH_P)
        head = col // HEAD_DIM
        dim = col % HEAD_DIM
        slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
        mask = (slot >= 0)[:, None] & (col < WIDTH)[None, :]
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k = tl.load(key_ptr + tok[:, None] * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd,
                    mask=mask, other=0.0)
        v = tl.load(value_ptr + tok[:, None] * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd,
                    mask=mask, other=0.0)
        k_dst = k_cache_ptr + block[:, None] * stride_kcb + offset[:, None] * stride_kco
        v_dst = v_cache_ptr + block[:, None] * stride_vcb + offset[:, None] * stride_vco
        tl.store(k_dst + head[None, :] * stride_kch + dim[None, :] * stride_kcd,
                 k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + head[None, :] * stride_vch + dim[None, :] * stride_vcd,
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def paged_attention(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, m_ptr, l_ptr,
        block_table_ptr, seq_lens_ptr, query_start_ptr, tile_req_ptr, tile_start_ptr,
        scale, window, soft_cap, num_splits, tok_offset,
        stride_qt, stride_qh, stride_qd,
        stride_ot, stride_oh, stride_od, stride_os,
        stride_mt, stride_mh, stride_ms,
        stride_kb, stride_ko, stride_kh, stride_kd,
        stride_vb, stride_vo, stride_vh, stride_vd,
        stride_bt,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        WINDOWED: tl.constexpr, SOFT_CAP: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        req = tl.load(tile_req_ptr + tile)
        tile_start = tl.load(tile_start_ptr + tile)
        q_begin = tl.load(query_start_ptr + req)
        q_len = tl.load(query_start_ptr + req + 1) - q_begin
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len  # cached prefix before this step's tokens

        rows = tl.arange(0, BLOCK_M)
        tok = tile_start + rows // GROUP_P  # query token within the request
        head_in_group = rows % GROUP_P
        head = kv_head * GROUP + head_in_group
        row_ok = (tok < q_len) & (head_in_group < GROUP)
        dims = tl.arange(0, HEAD_DIM_P)
        dim_ok = dims < HEAD_DIM
        q_pos = context_len + tok  # absolute position of each row's query

        cache_ty = k_cache_ptr.dtype.element_ty
        q = tl.load(
            q_ptr + (q_begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
            mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
        ).to(cache_ty)
        if UPCAST:
            q = q.to(tl.float32)

        # keys this tile needs: up to the last query's position (from the first query's window
        # start, with a window); split across programs if asked
        kv_end = context_len + tl.minimum(tile_start + BLOCK_Q, q_len)
        kv_first = 0
        if WINDOWED:
            kv_first = tl.maximum(context_len + tile_start - window + 1, 0)
        if SPLIT:
            steps = tl.cdiv(kv_end - kv_first, BLOCK_N)
            per_split = tl.cdiv(steps, num_splits)
            kv_lo = kv_first + split * per_split * BLOCK_N
            kv_hi = tl.minimum(kv_end, kv_lo + per_split * BLOCK_N)
        else:
            kv_lo = kv_first
            kv_hi = kv_end

        qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        cols = tl.arange(0, BLOCK_N)
        row_base = block_table_ptr + req.to(tl.int64) * stride_bt
        for start in range(kv_lo, kv_hi, BLOCK_N):
            k_pos = start + cols
            k_ok = k_pos < kv_hi
            block = tl.load(row_base + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            offset = k_pos % BLOCK_SIZE
            kv_mask = k_ok[:, None] & dim_ok[None, :]
            k = tl.load(
                k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko + kv_head * stride_kh
                + dims[None, :] * stride_kd,
                mask=kv_mask, other=0.0,
            )
            v = tl.load(
                v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo + kv_head * stride_vh
                + dims[None, :] * stride_vd,
                mask=kv_mask, other=0.0,
            )
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if SOFT_CAP:  # cap * tanh(s / cap) on the scaled scores, then the log2(e) of exp2
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (scale / soft_cap)
                s = (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * (soft_cap * 1.4426950408889634)
            else:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if WINDOWED:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        store_mask = row_ok[:, None] & dim_ok[None, :]
        if SPLIT:
            row = (q_begin + tok - tok_offset).to(tl.int64)
            tl.store(out_ptr + split * stride_os + row[:, None] * stride_ot + head[:, None] * stride_oh
                     + dims[None, :] * stride_od, acc, mask=store_mask)
            ml = split * stride_ms + row * stride_mt + head * stride_mh
            tl.store(m_ptr + ml, m_i, mask=row_ok)
            tl.store(l_ptr + ml, l_i, mask=row_ok)
        else:
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            o = acc / l_safe[:, None]
            row = (q_begin + tok).to(tl.int64)
            tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
                     o.to(out_ptr.dtype.element_ty), mask=store_mask)

    @triton.jit
    def merge_splits(
        acc_ptr, m_ptr, l_ptr, out_ptr, num_splits,
        stride_as, stride_at, stride_ah, stride_ad,
        stride_ms, stride_mt, stride_mh,
        stride_ot, stride_oh, stride_od,
        NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HEADS_P)
        dims = tl.arange(0, HEAD_DIM_P)
        h_ok = heads < NUM_HEADS
        mask = h_ok[:, None] & (dims < HEAD_DIM)[None, :]
        m_max = tl.full([HEADS_P], -1.0e30, tl.float32)
        for s in range(0, num_splits):
            m_s = tl.load(m_ptr + s * stride_ms + tok * stride_mt + heads * stride_mh, mask=h_ok, other=-1.0e30)
            m_max = tl.maximum(m_max, m_s)
        l_sum = tl.zeros([HEADS_P], tl.float32)
        o = tl.zeros([HEADS_P, HEAD_DIM_P], tl.float32)
        for s in range(0, num_splits):
            m_s = tl.load(m_ptr + s * stride_ms + tok * stride_mt + heads * stride_mh, mask=h_ok, other=-1.0e30)
            l_s = tl.load(l_ptr + s * stride_ms + tok * stride_mt + heads * stride_mh, mask=h_ok, other=0.0)
            a_s = tl.load(acc_ptr + s * stride_as + tok * stride_at + heads[:, None] * stride_ah
                          + dims[None, :] * stride_ad, mask=mask, other=0.0)
            w = tl.exp2(m_s - m_max)
            l_sum += w * l_s
            o += w[:, None] * a_s
        l_sum = tl.where(l_sum > 0.0, l_sum, 1.0)
        o = o / l_sum[:, None]
        tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(write_kv=write_kv, paged_attention=paged_attention, merge_splits=merge_splits)
