"""The fused CPU paged-decode kernel against a brute-force attention written here.

The brute force gathers each request's K/V position by position through the hand-built block table
and takes the softmax in float64; it shares no code with the kernel or the torch backend. Caches
start as NaN: a read of an unused block, of a block-table padding entry (0) or of the stale tail of
a request's last block shows up as a non-finite output. Block ids are handed out shuffled.
"""

from __future__ import annotations

import itertools
import logging
import random
import shutil

import pytest
import torch

from paged.backends import cpu_paged_decode
from paged.backends.torch_attention import TorchAttentionBackend, TorchAttentionOptions
from paged.core.attention import AttentionLayout

from helpers.batch import make_batch

TOLERANCE = {  # (atol, rtol) against float64 on inputs already rounded to the dtype
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (1e-2, 8e-3),  # fp32 accumulation, one rounding of the output
    torch.float16: (2e-3, 2e-3),
}


@pytest.fixture(scope="module")
def kernel():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the backend falls back to gather + SDPA")
    op = cpu_paged_decode.load()
    assert op is not None, "a compiler is here but the kernel did not build (see the warning)"
    return op


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_case(lens, *, num_kv_heads, group, head_dim, block_size, dtype, seed=0, q_gain=1.0):
    """Caches, block table and queries for decodes with context lengths ``lens``."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(cdiv(n, block_size) for n in lens) + 3  # block 0 (padding) and spares unused
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    tables = [[ids.pop() for _ in range(cdiv(n, block_size))] for n in lens]
    table = torch.zeros(len(lens), max(map(len, tables)) + 2, dtype=torch.int32)  # padded with 0
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for i, (n, blocks) in enumerate(zip(lens, tables)):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for p in range(n):
            k_cache[blocks[p // block_size], p % block_size] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[blocks[p // block_size], p % block_size] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    q = (torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen) * q_gain).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


def brute_force(q, k_cache, v_cache, table, lens):
    """float64, one request and one query head at a time."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        k = torch.stack([k_cache[table[b, p // block_size], p % block_size] for p in range(n)]).double()
        v = torch.stack([v_cache[table[b, p // block_size], p % block_size] for p in range(n)]).double()
        for h in range(q.shape[1]):
            scores = k[:, h // group] @ q[b, h].double() * head_dim**-0.5
            out[b, h] = torch.softmax(scores, dim=0) @ v[:, h // group]
    return out


def check(kernel, q, k_cache, v_cache, table, lens, out=None):
    out = torch.empty_like(q) if out is None else out
    kernel(q, k_cache, v_cache, table, lens, q.shape[-1] ** -0.5, out)
    assert torch.isfinite(out).all(), "read a NaN slot: an unused block, a padding entry or a stale tail"
    atol, rtol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.double(), brute_force(q, k_cache, v_cache, table, lens), atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 3])
def test_kernel_matches_brute_force(kernel, dtype, head_dim, block_size, group):
    # a single position, block boundaries (one block, one past it, two blocks), a tile of 64
    # and one past it (the online softmax's rescale), and uneven lengths
    lens = [1, block_size, block_size + 1, 2 * block_size, 64, 65, 37, 150]
    case = make_case(lens, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                     seed=block_size + group)
    check(kernel, *case)


@pytest.mark.parametrize("head_dim", [3, 8, 80, 96])
def test_other_head_dims_and_fp16(kernel, head_dim):
    # head dims that are not a multiple of 16 take the scalar tail; fp16 the generic load
    for dtype in (torch.float32, torch.float16):
        check(kernel, *make_case([5, 70, 1], num_kv_heads=3, group=2, head_dim=head_dim, block_size=4, dtype=dtype))


def test_rescaling_across_tiles(kernel):
    # large scores: the running max grows tile after tile (and then not), so every rescale path
    # of the online softmax matters; the softmax is nearly one-hot, unforgiving of a missed rescale
    q, k_cache, v_cache, table, lens = make_case([300, 129, 64], num_kv_heads=1, group=4, head_dim=64,
                                                 block_size=16, dtype=torch.float32, q_gain=6.0)
    for b, n in enumerate(lens.tolist()):  # later positions align more and more with the query
        for p in range(n):
            blk, off = table[b, p // 16], p % 16
            k_cache[blk, off, 0] += q[b, 0] * (p / n) * 0.05
    check(kernel, q, k_cache, v_cache, table, lens)


def test_strided_query_output_and_block_table(kernel):
    # q and out as views with row strides (as slices of a larger step), block-table rows strided
    q, k_cache, v_cache, table, lens = make_case([17, 3, 40], num_kv_heads=2, group=3, head_dim=64, block_size=8,
                                                 dtype=torch.float32)
    q_big = torch.randn(5, 8, 70)
    q_big[1:4, 1:7, :64] = q
    wide_table = torch.zeros(3, table.shape[1] + 5, dtype=torch.int32)
    wide_table[:, : table.shape[1]] = table
    out_big = torch.full((4, 6, 64), float("nan"))
    kernel(q_big[1:4, 1:7, :64], k_cache, v_cache, wide_table[:, : table.shape[1]], lens, 0.125, out_big[1:])
    torch.testing.assert_close(out_big[1:].double(), brute_force(q, k_cache, v_cache, table, lens), atol=2e-5, rtol=1e-5)
    assert torch.isnan(out_big[0]).all()  # nothing outside the output view written


def test_threads_and_work_split_do_not_change_the_result(kernel):
    # 1 thread: one work item per request; 4 threads for 5 requests: one per (request, KV head).
    # Each query head is computed the same way either way: equal bit for bit. 8 threads: 15 items
    # are fewer than 2 per thread, so each item's positions are split in runs of 128 positions
    # whose softmax states are merged (split-KV): for the request of 290 positions the same
    # values up to rounding (check: against brute force); one run alone merges to the same bits.
    case = make_case([33, 1, 290, 16, 7], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 4, 8):
            torch.set_num_threads(n)
            results.append(check(kernel, *case))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])  # the split path did run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1], [63], [64], [65], [500], [1000, 3]])
def test_split_kv_for_small_batches(kernel, dtype, lens):
    """Batch 1-2 on 2+ threads: the positions of each (request, KV head) are split in runs of two
    64-position tiles from position 0, one for short contexts, and merged."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        check(kernel, *make_case(lens, num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=dtype))
        torch.set_num_threads(6)  # one item, six runs
        check(kernel, *make_case(lens, num_kv_heads=1, group=4, head_dim=64, block_size=16, dtype=dtype))
    finally:
        torch.set_num_threads(threads)


def test_rejects_bad_inputs(kernel):
    q, k_cache, v_cache, table, lens = make_case([5], num_kv_heads=2, group=2, head_dim=16, block_size=4,
                                                 dtype=torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(q.bfloat16(), k_cache, v_cache, table, lens, 0.25, out)
    with pytest.raises(RuntimeError, match="int32"):
        kernel(q, k_cache, v_cache, table.long(), lens, 0.25, out)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        kernel(q[:, :3], k_cache, v_cache, table, lens, 0.25, out[:, :3])


# ---- the torch backend with and without the kernel ----------------------------------------------


def backend_step(kernel_on: bool):
    layout = AttentionLayout(1, 6, 2, 64, 16, torch.float32, torch.device("cpu"))
    backend = TorchAttentionBackend(layout, TorchAttentionOptions(cpu_decode_kernel=kernel_on))
    [kv] = backend.allocate_kv_cache(20)
    gen = torch.Generator().manual_seed(3)
    kv[0].copy_(torch.randn(kv[0].shape, generator=gen))
    kv[1].copy_(torch.randn(kv[1].shape, generator=gen))
    # two decodes and a prefill chunk after a cached prefix
    batch = make_batch([[3, 7], [5], [9, 11, 2]], [20, 9, 30], [1, 1, 4], 16)
    q, k, v = (torch.randn(6, n, 64, generator=gen) for n in (6, 2, 2))
    return backend, backend.forward(q, k, v, kv, backend.build_metadata(batch))


def test_backend_kernel_and_gather_paths_agree(kernel):
    on, out_on = backend_step(True)
    off, out_off = backend_step(False)
    assert on.options.cpu_decode_kernel and not off.options.cpu_decode_kernel
    torch.testing.assert_close(out_on, out_off, atol=2e-5, rtol=1e-5)
    assert "decode_k" not in on._buffers and "decode_k" in off._buffers  # the kernel path gathers nothing


def test_build_failure_warns_once_and_falls_back(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there: load_inline is asked
    monkeypatch.setattr(cpp_extension, "load_inline", fail)
    cpu_paged_decode.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="paged.backends.cpu_paged_decode"):
            assert cpu_paged_decode.load() is None
            _, out = backend_step(True)  # the backend asks again: no second build, no second warning
        assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] == [
            "CPU paged-decode kernel unavailable, the torch backend gathers K/V instead: no compiler here"
        ]
    finally:
        monkeypatch.undo()
        cpu_paged_decode.load.cache_clear()
    _, expected = backend_step(False)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)  # the gather path, bit for bit


def brute_force_banded(q_row, k, v, n: int, window: int, cap: float, head_dim: int, group: int):
    """float64 attention of one query row over positions max(0, n - window) .. n - 1 of k/v
    ([positions, Hkv, D]), soft-capped when ``cap``."""
    lo = max(0, n - window) if window else 0
    out = torch.empty(q_row.shape, dtype=torch.float64)
    for h in range(q_row.shape[0]):
        scores = k[lo:n, h // group] @ q_row[h].double() * head_dim**-0.5
        if cap:
            scores = cap * torch.tanh(scores / cap)
        out[h] = torch.softmax(scores, dim=0) @ v[lo:n, h // group]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (70, 0.0), (0, 5.0), (9, 3.0)])
@pytest.mark.parametrize("contexts", [[200], [1, 64, 130, 7], [40] * 9])
def test_grouped_rows_match_brute_force(kernel, dtype, window, cap, contexts):
    """``paged_decode_grouped``: each request has a group of 1-6 query rows, the tokens after its
    context (row t attends over positions < context + t + 1: causal within the group), windows and
    soft-caps applied per row; one request (split-KV over the threads), a few, and nine (whole
    requests as work items). The float64 reference attends row by row."""
    check_grouped_rows(dtype, window, cap, contexts, group=3, head_dim=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 80])
@pytest.mark.parametrize("group", [1, 4])
def test_grouped_rows_of_any_head_dim_and_group_match_brute_force(kernel, dtype, head_dim, group):
    """The same for head dims with a scalar tail (8: no whole vector; 80: one past 64), fp16's
    generic widening, and one or four query heads per KV head, in groups of 5, 1 and 4 rows."""
    check_grouped_rows(dtype, 0, 0.0, [130, 7, 64], group=group, head_dim=head_dim, sizes=[5, 1, 4])


def check_grouped_rows(dtype, window, cap, contexts, group, head_dim, sizes=None):
    kernels = cpu_paged_decode.kernels()
    if kernels is None:
        pytest.skip("no kernel")
    rng = random.Random(len(contexts) * 7 + window)
    sizes = sizes or [rng.randint(1, 6) for _ in contexts]
    totals = [c + s for c, s in zip(contexts, sizes)]
    num_kv_heads, block_size = 2, 16
    _, k_cache, v_cache, table, _ = make_case(totals, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                              block_size=block_size, dtype=dtype, seed=len(contexts))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(sizes), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([c + t + 1 for c, s in zip(contexts, sizes) for t in range(s)], dtype=torch.int32)
    groups = torch.tensor([0] + list(itertools.accumulate(sizes)), dtype=torch.int32)
    out = torch.empty_like(q)
    kernels.paged_decode_grouped(q, k_cache, v_cache, table, lens, groups, head_dim**-0.5, out, window, cap)
    atol, rtol = TOLERANCE[dtype]
    row = 0
    for b, (total, size) in enumerate(zip(totals, sizes)):
        k = torch.stack([k_cache[table[b, p // block_size], p % block_size] for p in range(total)]).double()
        v = torch.stack([v_cache[table[b, p // block_size], p % block_size] for p in range(total)]).double()
        for t in range(size):
            want = brute_force_banded(q[row], k, v, int(lens[row]), window, cap, head_dim, group)
            torch.testing.assert_close(out[row].double(), want, atol=atol * (3 if cap else 1), rtol=rtol)
            row += 1


def test_grouped_rows_reject_what_is_not_a_group(kernel):
    kernels = cpu_paged_decode.kernels()
    if kernels is None:
        pytest.skip("no kernel")
    q, k_cache, v_cache, table, _ = make_case([8, 8], num_kv_heads=1, group=1, head_dim=8, block_size=4,
                                              dtype=torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="must rise by one"):
        kernels.paged_decode_grouped(q, k_cache, v_cache, table, torch.tensor([5, 5], dtype=torch.int32),
                                     torch.tensor([0, 2], dtype=torch.int32), 1.0, out)
    with pytest.raises(RuntimeError, match="from 0 to the number of rows"):
        kernels.paged_decode_grouped(q, k_cache, v_cache, table, torch.tensor([5, 6], dtype=torch.int32),
                                     torch.tensor([0, 1], dtype=torch.int32), 1.0, out)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (50, 4.0)])
def test_a_row_has_the_same_bits_alone_or_in_a_group(kernel, head_dim, window, cap):
    """bf16 with AVX512-BF16 puts a KV head's softmax states in the lanes of a vector (one row's 3
    heads, or a verification's 5 rows x 3 heads, or more than 16 in chunks); a lane's arithmetic
    must not depend on which states share its vector, so that a speculative verification scores a
    row exactly as the plain decode of that row would. One thread here (no split-KV; the test
    after this one has it)."""
    kernels = cpu_paged_decode.kernels()
    if kernels is None:
        pytest.skip("no kernel")
    sizes, contexts = [5, 1, 7], [140, 9, 66]
    totals = [c + s for c, s in zip(contexts, sizes)]
    for group in (3, 7):  # 15 and 35 states of a KV head at the most: one chunk, three chunks
        _, k_cache, v_cache, table, _ = make_case(totals, num_kv_heads=2, group=group, head_dim=head_dim,
                                                  block_size=16, dtype=torch.bfloat16, seed=group)
        q = torch.randn(sum(sizes), 2 * group, head_dim, generator=torch.Generator().manual_seed(group)).bfloat16()
        lens = torch.tensor([c + t + 1 for c, s in zip(contexts, sizes) for t in range(s)], dtype=torch.int32)
        groups = torch.tensor([0] + list(itertools.accumulate(sizes)), dtype=torch.int32)
        request = [b for b, s in enumerate(sizes) for _ in range(s)]
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            grouped = torch.empty_like(q)
            kernels.paged_decode_grouped(q, k_cache, v_cache, table, lens, groups, head_dim**-0.5, grouped, window, cap)
            alone = torch.empty_like(q)
            for row, b in enumerate(request):
                kernels.paged_decode(q[row : row + 1], k_cache, v_cache, table[b : b + 1], lens[row : row + 1],
                                     head_dim**-0.5, alone[row : row + 1], window, cap)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(grouped, alone)
        atol, rtol = TOLERANCE[torch.bfloat16]
        for row, b in enumerate(request):  # and both right
            n = int(lens[row])
            k = torch.stack([k_cache[table[b, p // 16], p % 16] for p in range(n)]).double()
            v = torch.stack([v_cache[table[b, p // 16], p % 16] for p in range(n)]).double()
            want = brute_force_banded(q[row], k, v, n, window, cap, head_dim, group)
            torch.testing.assert_close(grouped[row].double(), want, atol=atol * (3 if cap else 1), rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [0, 100])
def test_split_kv_gives_a_row_the_same_bits_alone_or_in_a_group(kernel, dtype, window):
    """One request on two threads splits its KV positions into runs (split-KV). The runs start at
    fixed positions, not at the group's first or by its longest row, so that a verification's
    rows (5 here, ending on either side of a run boundary, 128 positions, and of a tile, 64) get
    the bits the decode of each row alone gets, there too."""
    kernels = cpu_paged_decode.kernels()
    if kernels is None:
        pytest.skip("no kernel")
    for context in (121, 124, 190, 317, 1021):
        size = 5
        _, k_cache, v_cache, table, _ = make_case([context + size], num_kv_heads=3, group=3, head_dim=64,
                                                  block_size=16, dtype=dtype, seed=context)
        q = torch.randn(size, 9, 64, generator=torch.Generator().manual_seed(context)).to(dtype)
        lens = torch.tensor([context + t + 1 for t in range(size)], dtype=torch.int32)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            grouped = torch.empty_like(q)
            kernels.paged_decode_grouped(q, k_cache, v_cache, table, lens, torch.tensor([0, size], dtype=torch.int32),
                                         0.125, grouped, window, 0.0)
            alone = torch.empty_like(q)
            for row in range(size):
                kernels.paged_decode(q[row : row + 1], k_cache, v_cache, table, lens[row : row + 1], 0.125,
                                     alone[row : row + 1], window, 0.0)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(grouped, alone), context
        atol, rtol = TOLERANCE[dtype]
        for row in range(size):  # and both right
            n = int(lens[row])
            k = torch.stack([k_cache[table[0, p // 16], p % 16] for p in range(n)]).double()
            v = torch.stack([v_cache[table[0, p // 16], p % 16] for p in range(n)]).double()
            want = brute_force_banded(q[row], k, v, n, window, 0.0, 64, 3)
            torch.testing.assert_close(grouped[row].double(), want, atol=atol, rtol=rtol)


# ---- the causal prefill kernel (prefill_causal) ----------------------------------------------


def brute_force_prefill(q, k, v, scale):
    """float64, query row t of q [Lq, H, D] sees keys 0 .. Lk - Lq + t of k, v [Lk, Hkv, D]."""
    (q_len, num_heads, _), (seq_len, num_kv_heads, _) = q.shape, k.shape
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q_len):
        seen = seq_len - q_len + t + 1
        for h in range(num_heads):
            g = h // (num_heads // num_kv_heads)
            scores = (k[:seen, g].double() * q[t, h].double()).sum(-1) * scale
            weights = torch.exp(scores - scores.max())
            out[t, h] = (weights[:, None] * v[:seen, g].double()).sum(0) / weights.sum()
    return out


@pytest.fixture(scope="module")
def prefill(kernel):
    """``prefill_causal`` (the library built, as ``kernel`` checks); skips on CPUs without
    AVX512-BF16, where the torch backend prefills with SDPA."""
    kernels = cpu_paged_decode.kernels()
    if not kernels.has_prefill_causal:
        pytest.skip("no AVX512-BF16: the torch backend prefills with SDPA")
    return kernels.prefill_causal


@pytest.mark.parametrize("head_dim,heads", [(64, (9, 3)), (128, (4, 4)), (64, (2, 1))])
@pytest.mark.parametrize("q_len,seq_len", [(1, 1), (7, 7), (33, 100), (70, 70), (5, 130)])
def test_prefill_causal_matches_brute_force(prefill, head_dim, heads, q_len, seq_len):
    """Row blocks of 16 and key blocks of 64, with their tails; a prefix (seq_len > q_len); GQA;
    queries as strided rows of a wider tensor, as the model's fused qkv projection leaves them."""
    gen = torch.Generator().manual_seed(q_len * 1000 + seq_len)
    num_heads, num_kv_heads = heads
    qkv = (torch.randn(q_len, (num_heads + 1) * head_dim, generator=gen) * 2).bfloat16()
    q = qkv[:, head_dim:].view(q_len, num_heads, head_dim)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).bfloat16()
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    prefill(q, k, v, out, scale)
    atol, rtol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), brute_force_prefill(q, k, v, scale), atol=atol, rtol=rtol)


def test_prefill_causal_rejects_what_it_cannot_run(prefill):
    q, kv = torch.zeros(4, 2, 64).bfloat16(), torch.zeros(4, 1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        prefill(q.float(), kv, kv, torch.empty_like(q), 0.1)
    with pytest.raises(RuntimeError, match="Lk >= Lq"):
        prefill(q, kv[:2], kv[:2], torch.empty_like(q), 0.1)
    with pytest.raises(RuntimeError, match="head dim of 64 or 128"):
        small = torch.zeros(4, 2, 32).bfloat16()
        prefill(small, small[:, :1], small[:, :1], torch.empty_like(small), 0.1)


def test_backend_prefills_with_the_kernel_where_it_can(prefill):
    """A bf16 prefill after a cached prefix, through the torch backend: the kernel runs (and not
    with a sliding window or a soft cap, which SDPA keeps), and matches SDPA's output."""
    from paged.core.attention import AttentionSettings

    layout = AttentionLayout(1, 9, 3, 64, 16, torch.bfloat16, torch.device("cpu"))
    outs, calls = {}, []
    for use in (True, False):
        backend = TorchAttentionBackend(layout, TorchAttentionOptions(cpu_prefill_kernel=use))
        assert (backend._prefill_causal is not None) == use
        if use:
            kernel = backend._prefill_causal
            backend._prefill_causal = lambda *a: (calls.append(a[0].shape[0]), kernel(*a))[1]
        (k_cache, v_cache), = backend.allocate_kv_cache(16)
        gen = torch.Generator().manual_seed(3)
        batch = make_batch([[1, 2, 3, 4, 5, 6]], [20], [70], block_size=16)  # 20 cached, 70 new
        cached = torch.randn(20, 3, 64, generator=gen).bfloat16(), torch.randn(20, 3, 64, generator=gen).bfloat16()
        slots = [b * 16 + o for b in (1, 2) for o in range(16)][:20]
        k_cache.view(-1, 3, 64)[slots], v_cache.view(-1, 3, 64)[slots] = cached
        q, k, v = (torch.randn(70, h, 64, generator=gen).bfloat16() for h in (9, 3, 3))
        meta = backend.build_metadata(batch)
        outs[use] = backend.forward(q, k, v, (k_cache, v_cache), meta)
        if use:
            assert calls == [70]
            backend.forward(q, k, v, (k_cache, v_cache), meta, AttentionSettings(sliding_window=30))
            backend.forward(q, k, v, (k_cache, v_cache), meta, AttentionSettings(logits_soft_cap=5.0))
            assert calls == [70]
    torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=1e-2, rtol=8e-3)
