"""GEMMs on GGUF block weights as the file stores them (C++, built once per machine like
``paged.plugins.quant_kernels``), used by the bundled ``gguf`` quantization method
(``paged.plugins.gguf_quantization``).

Every GGUF type of ``paged.core.loading.gguf_blocks`` is ``W = scale_g * u + offset_g`` with
unsigned codes ``u`` and, per group of 16 or 32 inputs, ``scale_g = d_s * a_g`` and ``offset_g =
dm_s * o_g`` (``d_s``, ``dm_s`` float16 per super-block of 256 inputs, ``a_g``, ``o_g`` int8; the
legacy types have one group per super-block and no ``a``/``o``). The packed layout keeps that,
so nothing is rounded on the way in::

    packed [N, row_bytes] uint8 (the row layout; the interleaved one below keeps the size but not
        the rows), per row: per 64 inputs the codes (chunk_bytes), then (K-quants)
        a [K/G] int8 and o [K/G] int8, then d [K/S] and dm [K/S] float16.
    codes of a 64-input chunk: 32 bytes whose byte j holds input j (low nibble) and input 32 + j
        (high nibble); 5 and 6 bits add 1 or 2 bit planes of 8 bytes (bit i: input i's bit 4 + p);
        8 bits: the 64 bytes as they are. 2- and 3-bit codes are held as 4 (exact, more memory).

Arithmetic, for few rows (decode steps; ``gemm`` below ``many_min_rows``): each 32-input half
becomes the bf16 numbers ``128 + u`` (one OR: exact, ``u < 128``; 8 bits: two nibbles, the high one
as ``2048 + 16 hi``), one ``vdpbf16ps`` per x row gives 16 fp32 lanes of pair sums, multiplied by
the lane's group scale (with groups of 16, the lower 8 lanes are one group, the upper 8 the next);
the offsets add ``sum_g (offset_g - 128 scale_g) * sum_{k in g} x_k``. No product is rounded
before the fp32 sum. A row's scales and offsets are read 16 groups (a block) at a time into two
vectors and stay in registers (a lane scale is a permute of them; the block's offsets are added
after its chunks), in the same order of sums whatever the number of rows, so that an x row gets
the same bits in any batch (one-row GEMVs 10-15% faster than with the scales written to memory
and read back). Where a row is a whole number of 128-input units (4 bits; always with 8 bits) the
codes are read another way (``tile_words``): a unit's 64 bytes as 32 words whose nibbles at bits 0,
4, 8 and 12 become four bf16 vectors with one shift and one ternary-logic op each (no widening),
against x reordered once per call to match, the two vectors of a lane's group summed in one
``vdpbf16ps`` chain before its scale (one FMA per 64 codes): on rows of 768-2048 inputs 5-13%
faster at one x row and 15-26% at five (a verification), in cache on one thread
(``benchmarks/gguf_kernel_ab.py``, 2-core Xeon). 4-bit rows of 64 more inputs (the default model's
576) keep the per-chunk path: their last half unit cost as much as a whole one and made the other
no faster. Exact either way, each in its own order of sums (the same for every batch size). Rows
of the weight stream once per four x rows, with software prefetch (as the int4 kernel). With ``int8_activations`` (an option, CPUs with AVX-512 VNNI) x is quantized
per 32 inputs instead (scale ``max|x| / 127``, as llama.cpp's Q8 activations), a chunk's 64
codes become 64 bytes and one ``vpdpbusd`` per x row multiplies them by 64 int8 x into 16 int32
lanes, scaled per lane by the weight group's scale times the x block's; the offsets still use
x's exact sums.

Interleaved layout (``pack(..., interleave=True)``, the kernels' ``interleave = 16``; for every type's
weights whose rows are a multiple of 16, what the ``gguf`` method packs for its ``interleave_types``,
by default all of them; 5 and 6 bits: the units hold the low nibbles, and after them 5 bits keep a
mask per nibble position (bit 4 added with one masked add), 6 bits a byte per word (bits 4 and 5
put in place with a shift and a ternary-logic op per nibble position); the K-quants keep their two-level
scales, the 16 rows' int8 ``a``, ``o`` per group and float16 ``d``, ``dm`` per super-block, and the
kernel forms the 16 rows' ``d * a`` and ``dm * o`` per group as the row layout does):
16 weight rows side by side (``pack_x16`` has the bytes). A unit of 64 code bytes is read as 32
words whose nibbles at bits 0, 4, 8 and 12 become four bf16 vectors (one shift and one
ternary-logic op each, as ``tile_words``), but here lane l of each is weight row l at one pair of
inputs, the same pair for every lane: one ``vdpbf16ps`` with x's pair broadcast from memory
multiplies 16 rows, a group's products stay in two fp32 chains until one FMA with the 16 rows'
scales, and the 16 outputs need no horizontal sum. Per extra x row that is half the instructions
of the row layout (a verification of 5 rows, 30 layers of the default model's shapes: 8.1 -> 6.3
ms for Q4_1 on the 2-core EPYC; one row level, at the memory's speed). The many-rows panels read
it without a transpose (each unit's pair of inputs is already a B-tile row). Exact as the row
layout, in its own order of sums (the same for every number of x rows). The int8 paths read the
row layout only.

On CPUs with AMX, 2 or more x rows of the interleaved layout run on AMX tiles, still on the exact
codes (``gemm_rows_x16_amx``): a group's decoded vectors (as above: lane l weight row l, one input
pair, the codes as ``128 + u``) stored in order are a B tile of G / 2 rows, x's G inputs of up to
16 rows straight from memory the A tile, and one ``tdpbf16ps`` sums the exact products of every
x row in fp32; the C tile is read back per group and scaled as above. Where ``vdpbf16ps`` costs a
multiply per x row and input pair, this costs one tile product for all of them (30 layers of the
default model's shapes, 2-core Xeon: Q4_1 5 rows 7.47 -> 4.49 ms, 8 rows 12.5 -> 5.4, 16 rows
23.8 -> 6.4, where the dequantized tiles below take 11; Q8_0 5 rows 12.6 -> 7.3; Q6_K 5 rows 16.1
-> 10.6). One x row stays on ``vdpbf16ps``: a decode step on tiles was 12-17% slower end to end.
So on AMX CPUs one row and a batch of rows sum in different orders (both exact products, fp32
sums): an x row has the same bits in every call of 2 rows up to ``many_min_rows``, not alone. ``set_amx_few_rows
(False)`` turns the tiles off for the whole process (benchmarks compare the two with it).

For many rows (prefill, large batches) on CPUs with AMX: 32 weight rows at a time are
dequantized to bfloat16 into AMX's B layout (pairs of inputs): their codes transposed in
registers as bytes (a vector holds 4 inputs of 16 rows; 4-bit codes transposed as stored, 8 inputs
of 16 rows, and taken apart into nibbles after), then ``scale * u + offset`` in fp32 with
the rows' scales as vectors, rounded once (as a dense bf16 copy holds them); x goes straight from memory
into A tiles, and ``tdpbf16ps`` accumulates ``C[m, n]`` in fp32 (2 x 2 tiles per step). Where x
is over 2 MB (a prefill's thousands of rows, more than L2 holds) a thread dequantizes up to 512 KB
of panels at a time and takes each 32-row block of x through all of them, so x streams from L3
once per group, not once per panel: 2,048 rows of the default model's shapes 0.81-0.90x the time
(the same bits). No dense copy lives beyond the call's panels. (Weights as A tiles and x transposed into B instead: 10%
faster up to 32 rows, 10-20% slower from 128, the output transposes; not kept.) Without AMX the
same panels (32 weight rows as bf16, in the B tiles' pair layout) feed a register-blocked
``vdpbf16ps`` kernel: per input pair, the panel's two vectors times a broadcast of 8 x rows'
pair, into 16 fp32 accumulators; the same weights rounded once as on AMX, then fp32 sums. The
call's ``many_min_rows`` (the ``gguf`` method's ``amx_min_rows`` on AMX CPUs, by default 20-28 (by
code width) for the interleaved layout and 6 for the row layout, its ``panel_min_rows`` elsewhere; 0 = never) is
where the many-rows path starts.

With ``int8_panels`` (CPUs with AVX-512 VNNI and without AMX) the many-rows path quantizes x as
``int8_activations`` does (per 32 inputs) and keeps a panel's codes as bytes, transposed so that
one vector holds 4 consecutive inputs of 16 weight rows (AMX's int8 B layout); per group,
``vpdpbusd`` of the panel's two vectors with a broadcast of 4 int8 x gives exact int32 dot
products, then in fp32 times the rows' group scale and the x block's scale, plus the group
offsets times x's sums. Twice the multiply-adds per instruction of ``vdpbf16ps`` and no
per-weight float work to prepare a panel (only the groups' scales): 1.1-1.5x the bf16 panels from
8 rows on (``benchmarks/gguf_gemm.py``, ``many-i8``), at int8 activations' cost in exactness.
Without VNNI, or with AMX, the option changes nothing.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from paged.core import native
from paged.core.quantization import BlockScales

logger = logging.getLogger(__name__)

_SOURCE = native.read_source(Path(__file__).with_suffix(".cpp"))
_CFLAGS = native.CFLAGS
CHUNK = 64
X16_ROWS = 16  # the interleaved layout's rows per tile (pack_x16); the kernels' ``interleave``
INTERLEAVABLE_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
PANEL = 32  # the many-rows path (AMX or AVX-512 panels): weight rows dequantized together; N must be a multiple


def build_name() -> str:
    """The library's name in the build folder (``paged.core.native.build_name``)."""
    return native.build_name("paged_gguf_", _SOURCE, _CFLAGS)


@functools.cache
def load() -> Any | None:
    """The kernels as a Python module (``gemm``, ``dequantize_rows``, ``amx_available``), built if
    need be on first use; None where they cannot run here (no compiler, no AVX-512 BF16)."""
    try:
        module = native.build_and_load(build_name(), _SOURCE, _CFLAGS, "CPU GGUF kernels", logger)
    except Exception as e:  # noqa: BLE001 -- no compiler, unwritable cache, ...: never fatal
        logger.warning("CPU GGUF kernels unavailable, GGUF weights use torch ops instead: %s", e)
        return None
    if not module.available():
        logger.info("CPU GGUF kernels: this CPU has no AVX-512 BF16; GGUF weights use torch ops")
        return None
    _register_fakes()
    return module


@functools.cache
def _register_fakes() -> None:
    @torch.library.register_fake("paged_gguf::gemm")
    def _fake_gemm(x, packed, bits, group, super_block, many_min_rows, int8_activations, int8_panels, interleave):
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("paged_gguf::gemm_f32")
    def _fake_gemm_f32(x, packed, bits, group, super_block, many_min_rows, int8_activations, int8_panels, interleave):
        return x.new_empty(x.shape[0], packed.shape[0], dtype=torch.float32)

    @torch.library.register_fake("paged_gguf::dequantize_rows")
    def _fake_rows(packed, ids, K, bits, group, super_block, interleave):
        return packed.new_empty(ids.numel(), K, dtype=torch.bfloat16)


def held_bits(bits: int) -> int:
    """The code width the layout holds for ``bits`` (2 and 3 are held as 4)."""
    return max(bits, 4)


def chunk_bytes(bits: int) -> int:
    bits = held_bits(bits)
    return 64 if bits == 8 else 32 + 8 * (bits - 4)


def row_bytes(k: int, bits: int, group: int, super_block: int) -> int:
    return k // CHUNK * chunk_bytes(bits) + (2 * (k // group) if super_block != group else 0) + 4 * (k // super_block)


def _f16_exact(values: torch.Tensor, what: str) -> torch.Tensor:
    half = values.to(torch.float16)
    if not torch.equal(half.float(), values.float()):
        raise ValueError(f"{what} is not a float16 value (the layout stores it as one)")
    return half


def _bit_planes(bits: torch.Tensor) -> torch.Tensor:
    """0/1 ``[..., 64]`` -> 8 bytes ``[..., 8]``, bit i of the little-endian 64 bits = element i."""
    weights = (2 ** torch.arange(8, dtype=torch.int32)).view(*([1] * (bits.dim() - 1)), 1, 8)
    return (bits.view(*bits.shape[:-1], 8, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def interleavable(n: int, bits: int, group: int, super_block: int) -> bool:
    """Whether a weight of ``n`` rows can take the interleaved layout (every format the kernels
    have: rows a multiple of 16)."""
    return n % X16_ROWS == 0


def pack(scales: BlockScales, weight: torch.Tensor, interleave: bool = False) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``scales`` (with codes, or codes recovered from ``weight``) -> ``(packed, (bits, group,
    super_block))``; with ``interleave`` where ``interleavable``, the interleaved layout (``pack_x16``;
    pass ``X16_ROWS`` as the kernels' ``interleave``). Raises ValueError where the weight's scales do
    not fit the layout."""
    n, k = weight.shape
    bits, group = scales.bits, scales.block
    two_level = scales.super_block is not None and scales.super_block != group
    super_block = scales.super_block if two_level else group
    if k % CHUNK or k % super_block:
        raise ValueError(f"{k} inputs are not a multiple of 64 and of the super-block ({super_block})")
    codes = scales.codes(weight)
    if scales.kind == "q8_0":  # signed codes: u = c + 128, offset -128 d
        codes = codes + 128
    u = codes.to(torch.int32).view(n, k // CHUNK, CHUNK)
    if interleave and interleavable(n, bits, group, super_block):
        if two_level:
            fields = [scales.scale_codes.to(torch.int8), scales.offset_codes.to(torch.int8),
                      _f16_exact(scales.super_scale, "a scale"), _f16_exact(scales.super_offset, "an offset")]
        else:
            dm = scales.offset if scales.kind != "q8_0" else -128.0 * scales.scale.float()
            fields = [_f16_exact(scales.scale, "a scale"), _f16_exact(dm, "an offset")]
        packed = pack_x16(u.view(n, k), held_bits(bits), fields)
        assert packed.shape[1] == row_bytes(k, bits, group, super_block)
        return packed, (bits, group, super_block)
    hb = held_bits(bits)
    if hb == 8:
        chunks = [u.to(torch.uint8)]
    else:
        low = u & 15
        chunks = [(low[..., :32] | (low[..., 32:] << 4)).to(torch.uint8)]
        chunks += [_bit_planes((u >> (4 + p)) & 1) for p in range(hb - 4)]
    parts = [torch.cat(chunks, dim=-1).reshape(n, -1)]
    if two_level:
        parts += [scales.scale_codes.to(torch.int8).view(torch.uint8), scales.offset_codes.to(torch.int8).view(torch.uint8)]
        d, dm = scales.super_scale, scales.super_offset
    else:
        d = scales.scale
        dm = scales.offset if scales.kind != "q8_0" else -128.0 * scales.scale.float()
    parts += [_f16_exact(d, "a scale").contiguous().view(torch.uint8), _f16_exact(dm, "an offset").contiguous().view(torch.uint8)]
    packed = torch.cat(parts, dim=1).contiguous()
    assert packed.shape[1] == row_bytes(k, bits, group, super_block)
    return packed, (bits, group, super_block)


def pack_x16(codes: torch.Tensor, bits: int, fields: list[torch.Tensor]) -> torch.Tensor:
    """The interleaved layout of unsigned codes ``[N, K]`` of ``bits`` (4, 5, 6 or 8; 2 and 3 held
    as 4) with their scale ``fields`` (``[N, F]`` float16 or int8 each, F per group or per
    super-block: one-level ``d``, ``dm``; two-level ``a``, ``o``, ``d``, ``dm``): rows in tiles of
    16, each ``16 x row_bytes`` long. A tile: its codes in units of 64 bytes, 32 little-endian
    16-bit words each, word ``2l + e`` holding codes of row ``l`` (8 bits: unit j is inputs ``4j ..
    4j + 3``, byte ``q`` input ``4j + 2q + e``; fewer: unit j is inputs ``8j .. 8j + 7``, the nibble
    at bits ``4q`` the low 4 bits of input ``8j + 2q + e``); after the units, 5 bits: per unit ``j``
    four little-endian uint32 masks, bit ``2l + e`` of mask ``q`` the bit 4 of row ``l``'s input
    ``8j + 2q + e``; 6 bits: per unit 32 bytes, byte ``2l + e`` holding bits 4 and 5 of those
    inputs, nibble ``q``'s at bits ``2q``, ``2q + 1`` (either way the same bytes per 16 rows as the
    row layout's codes); then each field, ``[F, 16]`` (the 16 rows side by side). A unit's nibble
    positions are then vectors whose 16 lanes are the 16 rows at one pair of inputs (see
    ``tile_x16`` in the source)."""
    n, k = codes.shape
    unit_bits = 8 if bits == 8 else 4
    tiles, per = n // X16_ROWS, 32 // unit_bits  # per: a unit's inputs of one row (8 or 4)
    u = codes.to(torch.int32).view(tiles, X16_ROWS, k // per, per // 2, 2)  # [tile, l, j, q, e]
    low = u & (2**unit_bits - 1)
    words = sum(low[:, :, :, q] << (unit_bits * q) for q in range(per // 2))  # [tile, l, j, e]
    words = words.permute(0, 2, 1, 3).contiguous()  # [tile, j, l, e]: word 2l + e of unit j
    parts = [torch.stack([words & 0xFF, words >> 8], dim=-1).to(torch.uint8).view(tiles, -1)]
    if bits == 5:
        bit4 = ((u >> 4) & 1).permute(0, 2, 3, 1, 4).reshape(tiles, k // per, 4, 32)  # [tile, j, q, 2l + e]
        masks = (bit4.to(torch.int64) << torch.arange(32)).sum(-1)  # [tile, j, q] uint32 values
        mask_bytes = torch.stack([(masks >> (8 * b)) & 0xFF for b in range(4)], dim=-1).to(torch.uint8)
        parts.append(mask_bytes.view(tiles, -1))
    elif bits == 6:
        high = ((u >> 4) & 3).permute(0, 2, 1, 4, 3)  # [tile, j, l, e, q]
        high_bytes = (high << (2 * torch.arange(4))).sum(-1).to(torch.uint8)  # [tile, j, 2l + e]
        parts.append(high_bytes.view(tiles, -1))
    for values in fields:  # [N, F] -> [tile, F x 16] bytes
        side_by_side = values.contiguous().view(tiles, X16_ROWS, -1).transpose(1, 2).contiguous()
        parts.append(side_by_side.view(torch.uint8).view(tiles, -1))
    return torch.cat(parts, dim=1).view(n, -1).contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, fmt: tuple[int, int, int], many_min_rows: int,
         int8_activations: bool, int8_panels: bool, interleave: int) -> torch.Tensor:
    """The kernel as the torch op (what ``torch.compile`` traces; eager code calls ``load()``'s).
    ``interleave``: 1 for the row layout, ``X16_ROWS`` for the interleaved one (``fmt`` does not say
    which; the packed bytes have the same size either way, so a wrong value is not detected)."""
    return torch.ops.paged_gguf.gemm(x, packed, *fmt, many_min_rows, int8_activations, int8_panels, interleave)


def gemm_f32(x: torch.Tensor, packed: torch.Tensor, fmt: tuple[int, int, int], many_min_rows: int,
             int8_activations: bool, int8_panels: bool, interleave: int) -> torch.Tensor:
    """``gemm`` with float32 outputs, the fp32 sums not rounded to bfloat16 (the LM head's logits)."""
    return torch.ops.paged_gguf.gemm_f32(x, packed, *fmt, many_min_rows, int8_activations, int8_panels, interleave)


def dequantize_rows(packed: torch.Tensor, ids: torch.Tensor, k: int, fmt: tuple[int, int, int],
                    interleave: int) -> torch.Tensor:
    return torch.ops.paged_gguf.dequantize_rows(packed, ids, k, *fmt, interleave)
