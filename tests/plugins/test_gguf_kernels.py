"""The GGUF kernels and the ``gguf`` method: every block type's products against a float64
product with gguf's own dequantized weight, both kernel paths (few rows; many rows on AMX tiles
or AVX-512 panels), int8 activations against their arithmetic in float64, the rows
of the embedding, the torch fallback, the packed-weight cache, and the memory held."""

from __future__ import annotations

import pytest
import torch

from helpers.gguf_blocks import block_scales, gguf_dequantized, random_blocks
from paged.core.loading import gguf_blocks
from paged.plugins import gguf_kernels
from paged.plugins.gguf_quantization import GGUFOptions, GGUFWeight, quantize_gguf

KINDS = list(gguf_blocks.TYPES)
KERNELS = gguf_kernels.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the GGUF kernels need AVX-512 BF16 and a compiler")


def _weight(kind: str, n: int = 96, k: int = 512, seed: int = 0):
    blocks = random_blocks(kind, n, k, seed=seed)
    exact = torch.from_numpy(gguf_dequantized(blocks, kind, n, k))
    return exact, block_scales(blocks, kind, n, k)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def _mean_relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().mean() / ref.abs().mean()).item()


def _tail_k(kind: str) -> int:
    """Inputs whose groups are not a multiple of 16 (the kernels' 16 x 16 transposes of the scales
    end in a partial block): the default model's 576 for the legacy types, 768 for the K-quants."""
    return 768 if gguf_blocks.TYPES[kind].super_block == 256 else 576


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tail", [False, True], ids=["k512", "k_tail"])
def test_products_match_float64_with_gguf_weights(kind, tail):
    exact, scales = _weight(kind, k=_tail_k(kind) if tail else 512)
    # the row layout (interleave_types empty; by default every type is interleaved), few rows and panels
    w = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(amx_min_rows=0, panel_min_rows=0, int8_activations=False,
                                                            interleave_types=()))
    assert w.packed is not None and w.interleave == 1
    int8 = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(amx_min_rows=0, panel_min_rows=0, int8_activations=True))
    many = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(amx_min_rows=1, panel_min_rows=1, interleave_types=()))
    many8 = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(amx_min_rows=1, panel_min_rows=1, int8_panels=True))
    # the interleaved layout (the default), few rows and panels
    interleaved = [quantize_gguf(exact.bfloat16(), scales, GGUFOptions(amx_min_rows=a, panel_min_rows=a))
                   for a in (0, 1)]
    assert all(x.interleave == 16 for x in interleaved)
    gen = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 4, 5, 7, 9, 14, 33):  # the panels' row tails 1-7 and whole blocks of 8
        x = torch.randn(m, exact.shape[1], generator=gen).bfloat16()
        ref = x.double() @ exact.double().T
        # exact products summed in fp32, then one bf16 rounding: a few bf16 ulps of the largest output
        assert _relative_error(w.linear(x, None), ref) < 1e-2, m
        if KERNELS.int8_activations_available():  # x rounded to int8 per 32 inputs: ~1/254 of each block's max
            assert _relative_error(int8.linear(x, None), ref) < 3e-2, m
        # the many-rows path: 32-row panels of bf16 weights on AMX tiles, or (without AMX) in vdpbf16ps blocks of 8 rows
        assert _relative_error(many.linear(x, None), ref) < 1e-2, m
        # which is the weights rounded to bf16 once, then fp32 sums and one rounding of each output
        assert _relative_error(many.linear(x, None), x.double() @ exact.bfloat16().double().T) < 5e-3, m
        assert _relative_error(interleaved[0].linear(x, None), ref) < 1e-2, m
        if KERNELS.amx_available():  # the few rows of the interleaved layout with vdpbf16ps, not AMX tiles
            before = KERNELS.set_amx_few_rows(False)
            try:
                assert _relative_error(interleaved[0].linear(x, None), ref) < 1e-2, m
            finally:
                KERNELS.set_amx_few_rows(before)
        assert _relative_error(interleaved[1].linear(x, None), x.double() @ exact.bfloat16().double().T) < 5e-3, m
        # with int8_panels (CPUs with VNNI, not AMX): x rounded to int8 per 32 inputs, as the few-rows int8 path
        assert _relative_error(many8.linear(x, None), ref) < (3e-2 if KERNELS.int8_activations_available() else 1e-2), m
    bias = torch.randn(exact.shape[0]).bfloat16()
    x = torch.randn(2, exact.shape[1], generator=gen).bfloat16()
    torch.testing.assert_close(w.linear(x, bias), w.linear(x, None) + bias)


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_k"])
def test_many_rows_larger_than_l2_match_float64_and_row_chunks(kind):
    """A prefill's x of more than 2 MB (1,900 rows x 576 or 768 inputs: padded to 1,904) runs the
    AMX panels in groups (gemm_amx): the weights rounded to bf16 once, fp32 sums, as a float64
    product says; and each output has the bits of the same rows multiplied 400 at a time (x in
    L2: a panel at a time), 3 threads or 1."""
    k = _tail_k(kind)
    exact, scales = _weight(kind, n=160, k=k, seed=7)
    w = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(amx_min_rows=1, panel_min_rows=1))
    x = torch.randn(1900, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert x.numel() * 2 > 2 * 1024 * 1024
    whole = w.linear(x, None)
    assert _relative_error(whole, x.double() @ exact.bfloat16().double().T) < 5e-3
    assert torch.equal(whole, torch.cat([w.linear(x[i : i + 400], None) for i in range(0, 1900, 400)]))
    threads = torch.get_num_threads()
    try:
        for n in (3, 1):
            torch.set_num_threads(n)
            assert torch.equal(w.linear(x, None), whole), n
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tail", [False, True], ids=["k512", "k_tail"])
def test_few_rows_give_an_x_row_the_same_bits_in_any_batch(kind, tail):
    """The few-rows path sums each output in the same order whatever the number of x rows and the
    weight rows' tile: a decode step (1 row) and a speculative verification (k + 1 rows) give one
    token the same logits, so greedy outputs do not depend on the batch. (512 inputs: 4- and 8-bit
    codes in the codes' word order, tile_words; 576: 4-bit codes per chunk, tile.) On AMX CPUs the
    interleaved layout's few rows run on tiles from 2 x rows on and one x row with vdpbf16ps (a
    decode step is faster that way): there the same bits hold from 2 rows on."""
    tiles_from_two_rows = KERNELS.amx_available()
    # 37 rows: tiles of 4 weight rows and a tail (the row layout); 144: the interleaved layout (every
    # type, without int8), 9 tiles of 16 (one x row takes four tiles at a time, 2-5 x rows two, 6-8
    # one: with one or two threads every group size and a tail)
    for n in (37, 144):
        exact, scales = _weight(kind, n=n, k=_tail_k(kind) if tail else 512, seed=4)
        for int8 in (False, True):
            w = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(amx_min_rows=0, panel_min_rows=0, int8_activations=int8,
                                                                    interleave_types=gguf_kernels.INTERLEAVABLE_TYPES))
            x = torch.randn(11, exact.shape[1], generator=torch.Generator().manual_seed(6)).bfloat16()
            if tiles_from_two_rows and w.interleave == gguf_kernels.X16_ROWS:  # each row beside a copy of itself
                alone = torch.cat([w.linear(x[i : i + 1].repeat(2, 1), None)[:1] for i in range(11)])
            else:
                alone = torch.cat([w.linear(x[i : i + 1], None) for i in range(11)])
            for m in (2, 3, 4, 5, 6, 8, 11):  # every tiling of the x rows, and passes of 8 plus a tail
                assert torch.equal(w.linear(x[:m], None), alone[:m]), (n, int8, m)


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_k", "q6_k"])
def test_float_outputs_are_the_sums_before_their_bfloat16_rounding(kind):
    """``linear_float`` (the LM head's logits) returns the kernels' fp32 sums: rounded to bf16 they
    are ``linear``'s outputs bit for bit, on every path (the row and the interleaved layout, few
    rows with vdpbf16ps or AMX tiles, int8 activations, the many-rows path), and the exact paths
    are within fp32 rounding of a float64 product, where bf16 outputs are only within ~1e-2."""
    exact, scales = _weight(kind, n=144, k=_tail_k(kind), seed=9)
    cases = {  # name: options, and for the exact paths the float64 product's tolerance
        "rows": (GGUFOptions(amx_min_rows=0, panel_min_rows=0, interleave_types=()), 1e-5),
        "interleaved": (GGUFOptions(amx_min_rows=0, panel_min_rows=0), 1e-5),
        "int8": (GGUFOptions(amx_min_rows=0, panel_min_rows=0, int8_activations=True), None),
        "many": (GGUFOptions(amx_min_rows=1, panel_min_rows=1), None),  # weights rounded to bf16
    }
    gen = torch.Generator().manual_seed(10)
    for name, (options, tolerance) in cases.items():
        w = quantize_gguf(exact.bfloat16(), scales, options)
        for m in (1, 2, 5, 17):
            x = torch.randn(m, exact.shape[1], generator=gen).bfloat16()
            sums = w.linear_float(x)
            assert sums.dtype == torch.float32, name
            assert torch.equal(sums.bfloat16(), w.linear(x, None)), (name, m)
            if tolerance is not None:
                ref = x.double() @ exact.double().T
                assert _relative_error(sums, ref) < tolerance, (name, m)
                assert not torch.equal(sums, sums.bfloat16().float()), (name, m)  # not rounded to bf16


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_the_interleaved_layout_puts_each_code_where_its_docstring_says(kind):
    """``pack_x16`` against the layout written out by hand, code by code: in tile t, word 2l + e of
    unit j holds row 16t + l's input 4j + 2q + e at bits 8q (8 bits: q8_0's codes as unsigned c +
    128, offset -128 d), or else the low 4 bits of input 8j + 2q + e at bits 4q, with, after the
    tile's 8 K bytes of units, its bit 4 as bit 2l + e of the unit's uint32 mask q (5 bits) or its
    bits 4 and 5 at bits 2q, 2q + 1 of the unit's byte 2l + e (6 bits); then the scale fields, 16
    rows side by side: one-level, per group of 32 the
    rows' d, then their dm (float16); two-level (K-quants), per group the rows' a, then their o
    (int8), then per super-block of 256 their d, then their dm (float16). Every type with rows a
    multiple of 16 takes it by default; not with the int8 paths, nor with other row counts."""
    t_ = gguf_blocks.TYPES[kind]
    two_level = t_.super_block != t_.group
    n, k = 32, 256 if two_level else 64
    exact, scales = _weight(kind, n=n, k=k, seed=8)
    assert quantize_gguf(exact.bfloat16(), scales, None).interleave == gguf_kernels.X16_ROWS  # the default
    w = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(interleave_types=(kind,)))
    assert w.interleave == gguf_kernels.X16_ROWS
    packed = w.packed.view(-1).tolist()
    bits = gguf_kernels.held_bits(t_.bits)
    codes = (scales.codes(exact.bfloat16()).to(torch.int32) + (128 if kind == "q8_0" else 0)).tolist()
    unit_bits = 8 if bits == 8 else 4
    per = 32 // unit_bits  # a unit's inputs of one row
    tile_bytes = 16 * gguf_kernels.row_bytes(k, t_.bits, t_.group, t_.super_block)

    def field(at: int, dtype: torch.dtype) -> float:
        size = 2 if dtype == torch.float16 else 1
        return torch.tensor(packed[at:at + size], dtype=torch.uint8).view(dtype).item()

    for row in range(n):
        t, l = divmod(row, 16)
        for i in range(k):
            j, q, e = i // per, i % per // 2, i % 2
            at = t * tile_bytes + 64 * j + 2 * (2 * l + e)
            word = packed[at] | packed[at + 1] << 8
            code = (word >> unit_bits * q) & (2**unit_bits - 1)
            if bits == 5:
                at = t * tile_bytes + 8 * k + 16 * j + 4 * q
                mask = int.from_bytes(bytes(packed[at:at + 4]), "little")
                code |= (mask >> (2 * l + e) & 1) << 4
            elif bits == 6:
                code |= (packed[t * tile_bytes + 8 * k + 32 * j + 2 * l + e] >> 2 * q & 3) << 4
            assert code == codes[row][i], (row, i)
        meta = t * tile_bytes + 2 * bits * k
        groups, supers = k // t_.group, k // 256
        if not two_level:
            offset = -128.0 * scales.scale.float() if kind == "q8_0" else scales.offset
            for g in range(groups):
                assert field(meta + 2 * (16 * g + l), torch.float16) == scales.scale[row, g].item(), (row, g)
                assert field(meta + k + 2 * (16 * g + l), torch.float16) == offset[row, g].item(), (row, g)
            continue
        for g in range(groups):
            assert field(meta + 16 * g + l, torch.int8) == scales.scale_codes[row, g].item(), (row, g)
            assert field(meta + 16 * groups + 16 * g + l, torch.int8) == scales.offset_codes[row, g].item(), (row, g)
        for s_ in range(supers):
            at = meta + 32 * groups + 2 * (16 * s_ + l)
            assert field(at, torch.float16) == scales.super_scale[row, s_].item(), (row, s_)
            assert field(at + 32 * supers, torch.float16) == scales.super_offset[row, s_].item(), (row, s_)
    for options in ({"int8_activations": True}, {"int8_panels": True}, {"interleave_types": ()}):
        options = GGUFOptions(interleave_types=(kind,)).model_copy(update=options)
        assert quantize_gguf(exact.bfloat16(), scales, options).interleave == 1, options
    # not whole tiles of 16 rows
    assert quantize_gguf(*_weight(kind, n=40, k=k), GGUFOptions(interleave_types=(kind,))).interleave == 1


def test_interleave_types_name_what_they_accept():
    assert GGUFOptions(interleave_types="q8_0, q4_1").interleave_types == ("q8_0", "q4_1")  # as a --quantization-option
    assert GGUFOptions(interleave_types="").interleave_types == ()
    with pytest.raises(ValueError, match=r"interleave_types: \['iq4_xs'\] cannot be interleaved; accepted: q4_0, q4_1, "
                       r"q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k"):
        GGUFOptions(interleave_types="q4_0,iq4_xs")


def _int8_reference(x: torch.Tensor, exact: torch.Tensor, scales) -> torch.Tensor:
    """What int8 activations compute, in float64: x rounded per 32 inputs to ``q * d`` (``d = max|x| /
    127``, ``q = round(x * 127 / max|x|)`` in float32, half to even, as the kernel's vcvtps2dq), times the
    weight less its group offsets, plus the offsets times the unrounded x (the kernel sums x for them).
    q8_0 is held as unsigned codes ``c + 128`` with the offset ``-128 d``."""
    n, k = exact.shape
    xf = x.float().view(x.shape[0], k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    q = torch.round(xf * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    x_hat = (q.double() * (amax / 127.0).double()).view(x.shape[0], k)
    offset = -128.0 * scales.scale if scales.kind == "q8_0" else scales.offset
    offsets = offset.double().repeat_interleave(scales.block, dim=1)  # [N, K]
    return x_hat @ (exact.double() - offsets).T + x.double() @ offsets.T


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tail", [False, True], ids=["k512", "k_tail"])
def test_int8_panels_compute_int8_activations_times_the_exact_codes(kind, tail):
    """The many-rows path with int8_panels (CPUs with AVX-512 VNNI and no AMX) against its arithmetic
    done in float64, and the few-rows int8 path against the same: both quantize x per 32 inputs."""
    if not KERNELS.int8_activations_available() or KERNELS.amx_available():
        pytest.skip("int8 panels run on CPUs with AVX-512 VNNI and without AMX")
    exact, scales = _weight(kind, k=_tail_k(kind) if tail else 512, seed=3)
    panels = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(panel_min_rows=1, int8_panels=True))
    rows = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(panel_min_rows=0, int8_activations=True))
    gen = torch.Generator().manual_seed(5)
    for m in (1, 3, 8, 13, 40):  # register blocks of 8 and every tail
        x = torch.randn(m, exact.shape[1], generator=gen).bfloat16()
        x[:, 7] *= 30  # an outlier: its blocks' other inputs round coarsely, as the reference does
        ref = _int8_reference(x, exact, scales)
        out = panels.linear(x, None)
        # fp32 sums of exact int32 dot products, one bf16 rounding of each output (~0.0015 on average)
        assert _relative_error(out, ref) < 5e-3 and _mean_relative_error(out, ref) < 2.5e-3, m
        assert _relative_error(rows.linear(x, None), ref) < 5e-3, m
        # the rounding of x is what the reference adds: against the unrounded x the outputs are off by 0.006-0.02
        assert _mean_relative_error(out, x.double() @ exact.double().T) > 4e-3, m


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_are_the_exact_weights_rounded_to_bfloat16(kind):
    exact, scales = _weight(kind, seed=2)
    for types in ((), gguf_kernels.INTERLEAVABLE_TYPES):  # the row layout, and the interleaved (every type)
        w = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(interleave_types=types))
        ids = torch.tensor([[0, 95], [7, 7]])
        assert torch.equal(w.embedding(ids), exact[ids].bfloat16()), types
        assert torch.equal(w.dequantize(), exact.bfloat16()), types


@needs_kernels
@pytest.mark.parametrize("kind", gguf_kernels.INTERLEAVABLE_TYPES)
def test_the_panels_are_the_same_from_either_layout(kind):
    """Many rows dequantize each weight to bf16 once (``scale * u + offset``, one rounding) from
    whichever layout holds it, then the same panel kernel runs: the outputs agree bit for bit."""
    exact, scales = _weight(kind, k=_tail_k(kind), seed=9)
    rows, interleaved = (quantize_gguf(exact.bfloat16(), scales, GGUFOptions(amx_min_rows=1, panel_min_rows=1,
                                                                             interleave_types=types))
                         for types in ((), (kind,)))
    assert (rows.interleave, interleaved.interleave) == (1, 16)
    x = torch.randn(19, exact.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(interleaved.linear(x, None), rows.linear(x, None))


@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q8_0", "q5_0"])
def test_the_torch_fallback_keeps_codes_and_matches(kind):
    exact, scales = _weight(kind, seed=4)
    w = quantize_gguf(exact, scales, GGUFOptions(kernel=False))  # float32: the torch form
    assert w.packed is None and w.codes.dtype == torch.uint8
    assert torch.equal(w.dequantize(), exact)
    x = torch.randn(3, exact.shape[1])
    torch.testing.assert_close(w.linear(x, None), x @ exact.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(w.embedding(torch.tensor([3, 1])), exact[[3, 1]])


@needs_kernels
def test_held_bytes_stay_close_to_the_file():
    for kind, t in gguf_blocks.TYPES.items():
        exact, scales = _weight(kind, n=64, k=768)
        w = quantize_gguf(exact.bfloat16(), scales, None)
        file_bytes = exact.numel() // t.super_block * t.block_bytes
        ratio = w.nbytes() / file_bytes
        # 4 to 8 bits: the file's bytes plus at most 12% (int8 group codes, float16 super scales);
        # 2 and 3 bits are held as 4
        assert ratio <= (1.12 if t.bits >= 4 else 2.0), (kind, ratio)


@needs_kernels
def test_a_cached_gguf_weight_is_read_back_as_it_was_packed():
    exact, scales = _weight("q5_k")
    w = quantize_gguf(exact.bfloat16(), scales, None)
    tensors, meta = w.cache_tensors()
    back = GGUFWeight.restore({k: v.clone() for k, v in tensors.items()}, meta, None)
    x = torch.randn(2, exact.shape[1]).bfloat16()
    assert torch.equal(back.linear(x, None), w.linear(x, None)) and back.nbytes() == w.nbytes()
    # packed for kernels a process without them cannot run: quantized again there
    assert GGUFWeight.restore(tensors, meta, GGUFOptions(kernel=False)) is None


@needs_kernels
def test_a_cached_interleaved_weight_is_packed_again_for_options_that_read_rows():
    exact, scales = _weight("q4_1")
    w = quantize_gguf(exact.bfloat16(), scales, None)
    tensors, meta = w.cache_tensors()
    assert meta["interleave"] == "16"
    back = GGUFWeight.restore(dict(tensors), meta, None)
    x = torch.randn(3, exact.shape[1]).bfloat16()
    assert back.interleave == 16 and torch.equal(back.linear(x, None), w.linear(x, None))
    assert GGUFWeight.restore(dict(tensors), meta, GGUFOptions(int8_activations=True)) is None
    # a cache written before the interleaved layout (no "interleave"): rows, packed again for these options
    old_meta = {key: value for key, value in meta.items() if key != "interleave"}
    rows = quantize_gguf(exact.bfloat16(), scales, GGUFOptions(interleave_types=()))
    assert GGUFWeight.restore(rows.cache_tensors()[0], old_meta, None) is None
    kept = GGUFWeight.restore(rows.cache_tensors()[0], old_meta, GGUFOptions(interleave_types=()))
    assert kept.interleave == 1 and torch.equal(kept.linear(x, None), rows.linear(x, None))


def test_weights_without_blocks_stay_dense():
    assert quantize_gguf(torch.randn(64, 256), None, None) is None
