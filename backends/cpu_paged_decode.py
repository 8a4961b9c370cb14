"""A fused paged-decode attention kernel for the CPU (C++, built once per machine: by
``.ci/setup``, else on first use).

Why: the torch backend's decode path gathers every request's K/V blocks into a contiguous buffer
(``index_select``) and then runs SDPA over it, so each layer writes a full copy of the batch's
context before reading it again; on a 2-core CPU that gather is as expensive as the attention
itself. This kernel reads the K/V rows straight from the paged cache through the block table.

``paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale, out, window=0, soft_cap=0.)``,
one query token per request (``b`` in ``0..B-1``)::

    q, out       [B, H, D]       the cache's dtype; any strides with a contiguous last dim
    k/v_cache    [num_blocks, block_size, Hkv, D] contiguous; float32, bfloat16 or float16
    block_table  [B, >= cdiv(seq_lens[b], block_size)] int32 (rows may be strided)
    seq_lens     [B] int32, >= 1: request b attends over its positions 0 .. seq_lens[b] - 1
    window       > 0: only over its last ``window`` positions (``seq_lens[b] - window ..``; the
                 earlier ones are never read, their block-table entries may be placeholders)
    soft_cap     > 0: each scaled score ``s`` becomes ``soft_cap * tanh(s / soft_cap)``

Design. Work items are whole requests (or, when there are fewer than 2 per thread, (request, KV
head) pairs, so that batch 1 still uses every core), handed to the threads dynamically (contexts
are ragged). Still fewer than 2 per thread (batch 1 of a model with 3 KV heads on 2 threads:
one thread would do two, the other one), each item's positions are split into runs of two
tiles from position 0 (positions 0-127, 128-255, ...) computed as separate units, whose softmax
states (running max, sum, fp32 accumulator) are merged at the end in run order (split-KV).
Tiles and runs start at fixed positions, not at an item's first position or by its length, so
that a speculative verification's row and the decode of that row cut the positions alike and get
the same bits (before, two runs per item split at the middle of the group's longest row; on the
2-core Xeon, 30 layers at batch 1: level at 400 and 1,024 positions, 12-18% slower at 128, where
each KV head is one run and three runs share two threads; runs of one tile were level at 128 and
~10% slower at 1,024). An item walks its positions ``TILE`` (64) at a time; a tile may span several blocks,
so block size 1 costs nothing extra. Per tile and KV head, the ``G = H / Hkv`` query heads that
share the KV head are processed one after the other while the tile's K/V rows are hot in L1
(bf16/fp16 rows are read in place and widened to fp32 as they are loaded, once per query head: a
per-thread fp32 copy of the tile, made once, cost more than it saved when the caches come from
memory, as they do in a decode step after the weights streamed by; 5-10% at 256-600 positions.
With AVX-512 a row is widened by one ``vpmovzxwd`` from memory and a shift (``native_vec.h``; the
generic vector conversion compiled to two 256-bit widenings and an insert): one row at 3,000
positions, 30 layers, 4.3 -> 3.3 ms in cache on the 2-core EPYC; and a per-thread fp32 copy of
the tile no longer pays even for a verification's 5 rows x 3 heads: at 900 positions 4.19 in place
against 4.27 ms copied in cache, 4.73 against 4.78 from memory, and 2 rows at 3,000 positions 5.71
against 6.70 in cache, where with the old widening the copy had taken 5 rows from 6.4-7.0 to
4.5-4.8 ms). The next tile's K/V rows of the item's KV heads are prefetched while a tile is
computed (a head's rows are a strided run the hardware prefetchers follow poorly: one row from
memory, 30 layers, 900 positions 1.94 -> 1.66 ms, 3,000 positions 9.3 -> 8.4; in the bf16 lanes
path below a position at a time during each head's V pass, 3-10% faster than one burst), and a run's
first tile its own rows before it starts (with the lanes path below, 900 positions from memory
1.81-1.91 -> 1.75-1.78 ms for one row, 2.6-2.8 -> 2.43-2.50 for 5; 300 positions level). Per tile: the
tile's scores and their max, one online-softmax update (running max and sum; the accumulator is
rescaled once per tile, not once per key), then the tile's V rows weighted into the fp32
accumulator. Reading every KV head of a tile together makes each block one contiguous run of
memory, which the hardware prefetchers follow. Only positions below ``seq_len`` are ever read, so
padding entries of the block table and the stale tail of the last block (NaN in the tests) never
enter the sums. Scores, softmax and accumulation are fp32 whatever the cache dtype; the output is
rounded once at the end. The inner loops use 16-lane GCC/Clang vector types (plain loops over a
64-long head dim vectorized poorly: serial horizontal sums, spilled accumulators), and head dims
64 and 128 are compile-time constants; any other head dim works through the generic instance.
A tile's scores are taken four positions at a time, their lane sums in one shuffle tree (the same
additions as one sum per position, so the same bits: a position's score does not depend on which
four it falls in): 13.0 against 15.9 us a call at 200 positions, 43 against 55 at 900 (batch 1,
2 threads, 3 KV heads of 3 queries each, bf16).

bf16 caches on CPUs with AVX512-BF16 (head dims 64 and 128) take another scoring path: the
softmax states of a KV head (its query heads, for each row of a group) are the lanes of one
vector, 16 to a chunk. A tile's scores are computed with the positions in the lanes: its K rows,
loaded whole in position order (which the hardware prefetchers follow), are transposed in
registers into pairs by position (16 positions x 16 pairs of bf16 at a time), and each state's
scores are then a chain of ``vdpbf16ps`` over the pairs, 16 positions' pairs times the state's
query pair broadcast (products exact, fp32 sums; the scale applied to the sum): D / 32
instructions a position and state, stored into the states' lanes. No widening of K and no
horizontal sums. (Until 2026-12-06 the states were the lanes here too: D / 2 broadcasts of a K
pair and D / 2 ``vdpbf16ps`` a position, however few the states; a decode has 3. The same
numbers, bit for bit; the attention 1.3-1.5x faster, ``attention_torch.py --kernel-sweep``,
2-core Xeon with AMX.) The online softmax runs on the lanes (a lane's positions outside its row's
range masked out), and the V rows are widened once per block of up to 6 states and weighted
into each state's fp32 accumulator (a masked weight is an exact 0). A lane's arithmetic does not
depend on which states share its vector: a row's output has the same bits decoded alone or in
a group (``test_a_row_has_the_same_bits_alone_or_in_a_group``). 30 layers, batch 1, 3 KV heads
x 3 query heads, 2 threads on the 2-core EPYC, ms, old path / lanes (``gguf_kernel_ab``-style
alternation of the two builds in separate processes): 5 rows at 900 positions 4.2 -> 1.8 in
cache, 5.0 -> 2.5 from memory; at 3,000 positions 13.1-13.5 -> 5.5 and 17.0-17.3 -> 8.4-8.6;
one row level in cache (1.0 at 900, 3.1-3.4 at 3,000) and 0.1 ms / 0.2-0.3 ms faster from
memory (1.81-1.84 -> 1.71, 6.2-6.5 -> 6.0-6.2).

Prefill (``prefill_causal(q, k, v, out, scale)``, AVX512-BF16 CPUs, bf16, head dims 64 and 128):
one chunk's query rows ``q [Lq, H, D]`` against its gathered context ``k, v [Lk, Hkv, D]`` (the
torch backend's ``index_select`` of the chunk's slots; ``Lk >= Lq``, the last ``Lq`` positions the
queries'), bottom-right causal: row ``t`` sees keys ``0 .. Lk - Lq + t``. torch's CPU flash
attention ran a 512-token prefill of the default model's heads at 4.4 ms a layer (~55 G
multiply-adds a second: 37% of the prefill's time) where a bf16 matmul of those sizes runs ~400.
Here K is transposed once per call into pairs by key (a block of 64 keys one run of memory) and
V widened to fp32; work items are (query head, 16 rows), the last rows first (they see the most
keys), handed out dynamically. Per block of 64 keys, four rows at a time: their scores are
``vdpbf16ps`` of 16 keys' pairs (lanes = keys) times a query pair broadcast once for four of them;
then each row's online softmax in fp32 (exact 0 past its causal end) and its fp32 accumulator
plus the weights times V with FMAs (no rounding of the weights to bf16). Against float64 it is as
close as SDPA (max error 7.6e-3 against 7.6e-3 on 512 tokens, the bf16 output's rounding); 512
tokens 2.1x faster, 128 2.5x, 2048 1.4x (per layer, 2 threads, the 2-core EPYC). The backend
uses it for every chunk of a layer without a sliding window or soft cap (option
``cpu_prefill_kernel``); a 512-token prefill of the default model 510 -> 412 ms, its attention
(KV write and gather included) 193 -> 101 ms.

Threads: OpenMP with ``at::get_num_threads()`` threads (``torch.set_num_threads`` applies); the
library links libgomp, which resolves to the copy torch has loaded, so there is one thread pool.

Build: ``paged.core.native`` compiles it with ``-O3 -march=native -fopenmp`` (by ``.ci/setup``,
else on first use) and every later process loads that build: one per machine, torch version and
source (a C++ compiler and ninja are needed).
``load()`` returns ``None`` (after one warning) when the build or the load fails; the caller then
keeps its own path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from paged.core import native

logger = logging.getLogger(__name__)

_SOURCE = native.read_source(Path(__file__).with_suffix(".cpp"))  # the kernel, next to this loader

_CFLAGS = native.CFLAGS


def build_name() -> str:
    """The library's name in the build folder (``paged.core.native.build_name``)."""
    return native.build_name("paged_cpu_decode_", _SOURCE, _CFLAGS)


_loaded: dict[str, ModuleType | None] = {}


@functools.cache
def load() -> Callable[..., None] | None:
    """The kernel as a torch op (``torch.ops.paged_cpu.paged_decode``), loaded (built if need be) on first use;
    ``None`` with one warning per process if it cannot be built or loaded."""
    try:
        _loaded["module"] = native.build_and_load(build_name(), _SOURCE, _CFLAGS, "CPU paged-decode kernel", logger)
        return torch.ops.paged_cpu.paged_decode
    except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, unwritable cache, ...: never fatal
        logger.warning("CPU paged-decode kernel unavailable, the torch backend gathers K/V instead: %s", e)
        return None


def kernels() -> ModuleType | None:
    """The library as a Python module, for eager callers (no dispatcher: ~0.15 us a call instead
    of ~1.7): ``paged_decode(...)`` as above, ``write_kv(key, value, k_cache, v_cache,
    slot_mapping)`` (each token's K/V rows into the caches at its slot) and
    ``write_and_decode(q, key, value, k_cache, v_cache, slot_mapping, block_table, seq_lens,
    scale, window=0, soft_cap=0.) -> out`` (both, for a step of decodes only), and the same two
    with query rows in groups, ``paged_decode_grouped(q, k_cache, v_cache, block_table, seq_lens,
    groups, scale, out, window=0, soft_cap=0.)`` and ``write_and_decode_grouped(..., seq_lens,
    groups, scale, ...)``: request b's rows are ``groups[b] .. groups[b + 1] - 1`` (int32,
    ``groups[0] = 0``), consecutive tokens of one sequence (``seq_lens`` one apart, block-table row
    b), each K/V tile read once for all of them (speculative verification, short chunks); and, where
    ``has_prefill_causal``, ``prefill_causal(q, k, v, out, scale)`` (above).
    ``None`` where ``load`` fails."""
    return _loaded.get("module") if load() is not None else None
