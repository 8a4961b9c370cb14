"""The KV manager with a sliding window (every layer windowed): blocks that fell wholly out of the
window go back to the pool and their table entries become the placeholder; prefix hits out of a
new request's window are not taken. Block tables here are computed by hand (block size 4, window
6: the query at position p reads positions p - 5 .. p)."""

from __future__ import annotations

from paged.core.engine.kv_cache_manager import PLACEHOLDER_BLOCK, KVCacheManager
from paged.core.engine.request import Request
from paged.core.sampling_params import SamplingParams
from paged.core.utils import cdiv

BS, W = 4, 6


def make_request(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=500), arrival_time=0.0)


def table_of(kv: KVCacheManager, rid: str) -> list[int | None]:
    """Block ids, None for a placeholder."""
    return [None if b is PLACEHOLDER_BLOCK else b.block_id for b in kv.block_tables[rid]]


def run(kv: KVCacheManager, request: Request, num_new: int) -> None:
    """Schedule ``num_new`` tokens (they are computed by the step) and append one sampled token
    when the request has caught up with its tokens."""
    need = kv.num_blocks_to_allocate(request, num_new)
    free = kv.num_free_blocks
    assert kv.allocate_slots(request, num_new) is not None
    assert free - kv.num_free_blocks <= max(need, 0)  # it never takes more than the estimate (net of what it freed)
    request.num_computed_tokens += num_new
    if request.num_computed_tokens == request.num_tokens:
        request.append_output_token(7)


def test_decode_frees_blocks_behind_the_window_by_hand():
    kv = KVCacheManager(8, BS, enable_caching=False, sliding_window=W)
    r = make_request("a", range(10, 20))  # 10 prompt tokens
    run(kv, r, 10)
    assert table_of(kv, "a") == [0, 1, 2] and kv.num_free_blocks == 5
    run(kv, r, 1)  # position 10: the new token fits in block 2
    assert table_of(kv, "a") == [0, 1, 2]
    run(kv, r, 1)  # position 11 reads 6..11: block 0 (0..3) is out of every later window
    assert table_of(kv, "a") == [None, 1, 2] and kv.num_free_blocks == 6
    # position 12: a new block, the front of the free queue: block 0 again (freed without a hash,
    # it went to the front)
    run(kv, r, 1)
    assert table_of(kv, "a") == [None, 1, 2, 0] and kv.num_free_blocks == 5
    run(kv, r, 1)
    run(kv, r, 1)
    assert table_of(kv, "a") == [None, 1, 2, 0]  # positions 13, 14: nothing to allocate or free
    run(kv, r, 1)  # position 15 reads 10..15: block 1 (4..7) is out
    assert table_of(kv, "a") == [None, None, 2, 0] and kv.num_free_blocks == 6
    run(kv, r, 1)  # position 16: block 1 again
    assert table_of(kv, "a") == [None, None, 2, 0, 1]
    kv.free(r)
    assert kv.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_long_generation_holds_about_window_over_block_size_blocks():
    windowed = KVCacheManager(64, BS, enable_caching=True, sliding_window=W)
    full = KVCacheManager(64, BS, enable_caching=True)
    a, b = make_request("a", range(3, 13)), make_request("a", range(3, 13))
    run(windowed, a, 10)
    run(full, b, 10)
    most = 0
    for _ in range(200):
        run(windowed, a, 1)
        run(full, b, 1)
        held = sum(1 for blk in windowed.block_tables["a"] if blk is not PLACEHOLDER_BLOCK)
        most = max(most, held)
    assert len(full.block_tables["a"]) == cdiv(210, BS)  # every block, without a window
    assert most <= W // BS + 2 == 3
    assert windowed.num_free_blocks >= 64 - 3
    windowed.free(a)
    assert windowed.num_free_blocks == 64


def test_prefix_hit_takes_only_the_blocks_in_the_new_window():
    kv = KVCacheManager(16, BS, enable_caching=True, sliding_window=W)
    prompt = list(range(100, 116))  # 4 full blocks
    a = make_request("a", prompt)
    run(kv, a, 16)
    assert table_of(kv, "a") == [0, 1, 2, 3]
    kv.free(a)  # all back in the pool, still cached

    b = make_request("b", prompt + [1, 2, 3, 4, 5])
    hits, num_cached = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1, 2, 3] and num_cached == 16
    free_before = kv.num_free_blocks
    need = kv.num_blocks_to_allocate(b, 5, hits)
    assert kv.allocate_slots(b, 5, hits) is not None
    # b's queries start at 16 and read 11.. : blocks 0 and 1 (0..7) are out of its window, so the
    # hits on them are not taken (not referenced, left in the free queue); 2 and 3 are revived
    assert table_of(kv, "b") == [None, None, 2, 3, 4, 5]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(6)] == [0, 0, 1, 1, 1, 1]
    assert free_before - kv.num_free_blocks == need == 4
    assert kv.get_block_ids("b") == [0, 0, 2, 3, 4, 5]  # what the runner gets: block 0 stands in
    # the freed hits keep their hashes (their contents are intact): a third request hits them too
    c = make_request("c", prompt + [9])
    hits_c, cached_c = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in hits_c] == [0, 1, 2, 3] and cached_c == 16
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_global_manager_is_unchanged():
    kv = KVCacheManager(8, BS, enable_caching=False)
    r = make_request("a", range(10, 20))
    run(kv, r, 10)
    for _ in range(12):
        run(kv, r, 1)
    assert table_of(kv, "a") == [0, 1, 2, 3, 4, 5]
