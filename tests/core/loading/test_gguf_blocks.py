"""GGUF block types -> codes and scales (``paged.core.loading.gguf_blocks``), checked against
gguf's own dequantization bit for bit, type by type."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gguf_blocks import gguf_dequantized, random_blocks
from paged.core.loading import gguf_blocks

KINDS = list(gguf_blocks.TYPES)


@pytest.mark.parametrize("kind", KINDS)
def test_codes_and_scales_dequantize_bit_for_bit_like_gguf(kind):
    rows, cols = 6, 768
    blocks = random_blocks(kind, rows, cols, seed=3)
    reference = gguf_dequantized(blocks, kind, rows, cols)
    decoded = gguf_blocks.decode_blocks(blocks, kind.upper(), (rows, cols))
    ours = gguf_blocks.dequantize(decoded)
    # the same float32 numbers (+ 0.0 folds gguf's -0.0, d * (8 - 8) with d < 0, into +0.0)
    assert np.array_equal((ours + np.float32(0)).view(np.uint32), (reference + np.float32(0)).view(np.uint32))
    t = gguf_blocks.TYPES[kind]
    lo, hi = (-128, 127) if kind == "q8_0" else (0, 2**t.bits - 1)
    assert decoded.codes.min() >= lo and decoded.codes.max() <= hi
    assert decoded.codes.min() == lo and decoded.codes.max() == hi  # random bits reach both ends


@pytest.mark.parametrize("kind", KINDS)
def test_group_scales_are_super_block_scale_times_a_small_integer(kind):
    rows, cols = 4, 512
    decoded = gguf_blocks.decode_blocks(random_blocks(kind, rows, cols, seed=5), kind.upper(), (rows, cols))
    t = gguf_blocks.TYPES[kind]
    per = t.super_block // t.group
    assert decoded.scale.shape == (rows, cols // t.group) and decoded.super_scale.shape == (rows, cols // t.super_block)
    # float16 values, exactly (what the kernels' layout stores)
    for a in (decoded.super_scale, decoded.super_offset):
        assert np.array_equal(a.astype(np.float16).astype(np.float32), a)
    assert np.array_equal(np.repeat(decoded.super_scale, per, 1) * decoded.scale_codes, decoded.scale)
    assert np.array_equal(np.repeat(decoded.super_offset, per, 1) * decoded.offset_codes, decoded.offset)


def test_types_without_blocks_are_not_decoded():
    raw = np.zeros((4, 64), np.float32)
    assert gguf_blocks.decode_blocks(raw, "F32", (4, 64)) is None
    assert gguf_blocks.decode_blocks(raw, "IQ4_NL", (4, 64)) is None
    assert gguf_blocks.decode_blocks(raw.reshape(-1), "Q4_0", (256,)) is None  # 1-D: a norm or a bias
