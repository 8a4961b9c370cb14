"""GGUF block types -> integer codes and their scales, exactly (read by ``paged.core.loading.gguf``).

Every type here stores, per group of ``group`` weights along a row, a scale and an offset, and
per weight an unsigned code, with ``W = scale * code + offset`` computed in float32 giving
``gguf.quants.dequantize``'s values bit for bit (tests/core/loading/test_gguf_blocks.py checks
each type). K-quants derive their group scales from a super-block of 256 weights: ``scale =
super_scale * scale_code`` and ``offset = super_offset * offset_code``, a float16 number times a
small integer (exact in float32); the legacy types have one group per super-block (codes 1).

================  ====  =====  =====  ==============================================
type              bits  group  super  W
================  ====  =====  =====  ==============================================
Q4_0              4     32     32     d * (q - 8)
Q4_1              4     32     32     d * q + m
Q5_0              5     32     32     d * (q - 16)
Q5_1              5     32     32     d * q + m
Q8_0              8     32     32     d * q, q signed (the one type with signed codes)
Q2_K              2     16     256    d * sc * q - dmin * m            (sc, m: 4 bits)
Q3_K              3     16     256    d * (sc - 32) * (q - 4)          (sc: 6 bits)
Q4_K              4     32     256    d * sc * q - dmin * m            (sc, m: 6 bits)
Q5_K              5     32     256    d * sc * q - dmin * m
Q6_K              6     16     256    d * sc * (q - 32)                (sc: int8)
================  ====  =====  =====  ==============================================

The bit layouts follow ggml's block structs (``block_q4_K`` etc.), as ``gguf.quants`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256


@dataclass(frozen=True)
class BlockType:
    bits: int  # code width as stored
    group: int  # weights per scale/offset
    super_block: int  # weights per super_scale/super_offset
    block_bytes: int  # bytes per super-block


TYPES: dict[str, BlockType] = {
    "q4_0": BlockType(4, 32, 32, 18),
    "q4_1": BlockType(4, 32, 32, 20),
    "q5_0": BlockType(5, 32, 32, 22),
    "q5_1": BlockType(5, 32, 32, 24),
    "q8_0": BlockType(8, 32, 32, 34),
    "q2_k": BlockType(2, 16, QK_K, 84),
    "q3_k": BlockType(3, 16, QK_K, 110),
    "q4_k": BlockType(4, 32, QK_K, 144),
    "q5_k": BlockType(5, 32, QK_K, 176),
    "q6_k": BlockType(6, 16, QK_K, 210),
}


@dataclass
class DecodedBlocks:
    """One weight ``[rows, cols]`` as codes and scales (float32 unless said)."""

    kind: str
    codes: np.ndarray  # uint8 [rows, cols], 0 .. 2**bits - 1 (q8_0: int8, -128 .. 127)
    scale: np.ndarray  # [rows, cols / group]
    offset: np.ndarray  # [rows, cols / group]
    super_scale: np.ndarray  # [rows, cols / super_block], float16 values
    super_offset: np.ndarray  # [rows, cols / super_block], float16 values
    scale_codes: np.ndarray  # int8 [rows, cols / group]: scale = super_scale * scale_code
    offset_codes: np.ndarray  # int8 [rows, cols / group]: offset = super_offset * offset_code


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte ``at`` of each block, as float32 ``[n, 1]``."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes ``[n, 16]`` -> codes ``[n, 32]``: the low nibbles are weights 0-15, the high 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bits of ``packed`` bytes ``[n, count / 8]`` -> ``[n, count]`` of 0/1."""
    return np.unpackbits(packed, axis=-1, bitorder="little")[:, :count]


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> ``(sc, m)`` ``[n, 8]`` each."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes of 6-bit scales -> ``sc - 32`` ``[n, 16]`` (low 4 bits in bytes 0-7, two
    nibbles each; the high 2 bits in bytes 8-11, four per byte)."""
    low = np.concatenate([scales[:, 0:8] & 0x0F, scales[:, 0:8] >> 4], axis=-1)
    high = np.concatenate([(scales[:, 8:12] >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-1)
    return (low | (high << 4)).astype(np.int16) - 32


def _decode(kind: str, b: np.ndarray) -> tuple[np.ndarray, ...]:
    """Super-blocks ``b [n, block_bytes]`` -> ``(codes [n, S], d [n, 1], dm [n, 1], a [n, S/G],
    o [n, S/G])`` with ``scale = d * a``, ``offset = dm * o``."""
    n = b.shape[0]
    one = np.ones((n, 1), np.int16)
    if kind == "q4_0":
        d = _f16(b, 0)
        return _nibbles(b[:, 2:18]), d, -8 * d, one, one
    if kind == "q4_1":
        return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2), one, one
    if kind == "q5_0":
        d = _f16(b, 0)
        return _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4), d, -16 * d, one, one
    if kind == "q5_1":
        return _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4), _f16(b, 0), _f16(b, 2), one, one
    if kind == "q8_0":
        d = _f16(b, 0)
        return b[:, 2:34].view(np.int8), d, 0 * d, one, one
    if kind == "q2_k":  # scales[16], qs[64], d, dmin; qs: per 128 weights 32 bytes, 2 bits x 4 shifts
        sc = b[:, 0:16]
        qs = b[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        codes = (qs & 3).reshape(n, QK_K)
        return codes, _f16(b, 80), _f16(b, 82), (sc & 0x0F).astype(np.int16), -(sc >> 4).astype(np.int16)
    if kind == "q3_k":  # hmask[32], qs[64], scales[12], d; a set hmask bit means no -4
        qs = b[:, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        low = (qs & 3).reshape(n, QK_K)
        high = (b[:, 0:32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        codes = low | (high.reshape(n, QK_K) << 2)  # q + 4, 0..7
        a = _q3_k_scales(b[:, 96:108])
        d = _f16(b, 108)
        return codes, d, -4 * d, a, a
    if kind in ("q4_k", "q5_k"):  # d, dmin, scales[12], (qh[32],) qs[128]
        sc, mn = _k_scale_min(b[:, 4:16])
        qs = b[:, 48:176] if kind == "q5_k" else b[:, 16:144]
        low = np.concatenate([qs.reshape(n, 4, 32) & 0x0F, qs.reshape(n, 4, 32) >> 4], axis=-1)
        low = low.reshape(n, QK_K)  # per 64 weights: 32 low nibbles, then 32 high
        if kind == "q5_k":
            high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            low = low | (high.reshape(n, QK_K) << 4)
        return low, _f16(b, 0), _f16(b, 2), sc.astype(np.int16), -mn.astype(np.int16)
    if kind == "q6_k":  # ql[128], qh[64], scales[16] int8, d
        ql = b[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(n, 2, 4, 32)
        qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        codes = (ql | (qh << 4)).reshape(n, QK_K)  # q, 0..63 (W uses q - 32)
        a = b[:, 192:208].view(np.int8).astype(np.int16)
        d = _f16(b, 208)
        return codes, d, -32 * d, a, a
    raise KeyError(kind)


def decode_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> DecodedBlocks | None:
    """The codes and scales of a 2-D GGUF tensor's raw blocks (``shape`` = ``[rows, cols]``), or
    None for a type this module does not read (F32, F16, BF16, the IQ types, ...)."""
    kind = type_name.lower()
    if kind not in TYPES or len(shape) != 2:
        return None
    t = TYPES[kind]
    rows, cols = shape
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, t.block_bytes)
    codes, d, dm, a, o = _decode(kind, blocks)
    groups = t.super_block // t.group
    a = np.broadcast_to(a, (blocks.shape[0], groups))
    o = np.broadcast_to(o, (blocks.shape[0], groups))
    # s = d * a and m = dm * o are exact in float32 (an 11-bit float16 mantissa times <= 8 bits)
    scale = (d * a.astype(np.float32)).reshape(rows, cols // t.group)
    offset = (dm * o.astype(np.float32)).reshape(rows, cols // t.group)
    return DecodedBlocks(
        kind, codes.reshape(rows, cols), scale, offset,
        d.reshape(rows, cols // t.super_block), dm.reshape(rows, cols // t.super_block),
        a.astype(np.int8).reshape(rows, cols // t.group), o.astype(np.int8).reshape(rows, cols // t.group),
    )


def dequantize(blocks: DecodedBlocks) -> np.ndarray:
    """``scale * code + offset`` in float32 (gguf's values, bit for bit)."""
    t = TYPES[blocks.kind]
    rows, cols = blocks.codes.shape
    q = blocks.codes.astype(np.float32).reshape(rows, cols // t.group, t.group)
    return (blocks.scale[..., None] * q + blocks.offset[..., None]).reshape(rows, cols)
