"""Unit tests of the block pool and the KV-cache manager, one rule at a time.

The expectations are computed by hand from the documented rules (core/engine/block_pool.py and
core/engine/kv_cache_manager.py docstrings).
"""

from __future__ import annotations

import itertools
import random
import sys

import pytest

from paged.core.engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens
from paged.core.engine.kv_cache_manager import KVCacheManager
from paged.core.engine.request import Request
from paged.core.sampling_params import SamplingParams

BS = 4  # block size of most tests


def make_request(rid: str, tokens, cache_salt=None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), arrival_time=0.0, cache_salt=cache_salt)


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None):
    """Admit a waiting request the way the scheduler does: look up the cached prefix, allocate
    the rest; advance num_computed_tokens. Returns (hit blocks, num cached tokens, new blocks)."""
    hits, num_cached = kv.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_cached
    new = kv.allocate_slots(request, num_new, hits)
    assert new is not None
    request.num_computed_tokens = num_cached + num_new
    return hits, num_cached, new


def queue_ids(pool: BlockPool) -> list[int]:
    """The free queue's order, without creating the blocks never used yet."""
    return list(pool.free_block_queue.block_ids())


# --- the free queue ----------------------------------------------------------------------


def test_free_queue_initial_order_and_popleft():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and [b.block_id for b in q] == [0, 1, 2, 3, 4]
    assert q.popleft().block_id == 0
    assert q.popleft().block_id == 1
    assert [b.block_id for b in q] == [2, 3, 4] and len(q) == 3


def test_free_queue_remove_from_middle_and_append_to_tail():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    q.remove(blocks[0])  # the head
    q.remove(blocks[4])  # the tail
    assert [b.block_id for b in q] == [1, 3]
    q.append(blocks[4])
    q.append(blocks[0])
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 0, 2] and len(q) == 5
    # links are consistent both ways
    assert [b.block_id for b in q] == [b.block_id for b in reversed(list(q))][::-1]
    for b in q:
        assert b.prev_free.next_free is b and b.next_free.prev_free is b


def test_free_queue_empty_popleft_raises():
    q = FreeBlockQueue([KVCacheBlock(0)])
    q.popleft()
    assert len(q) == 0 and list(q) == []
    with pytest.raises(ValueError):
        q.popleft()


def _lines_per_op(n: int, ops: int) -> int:
    """Python lines the queue's own code executes for ``ops`` rounds of remove-from-the-middle,
    append and popleft on a queue of ``n`` blocks: an operation count, not a clock."""
    blocks = [KVCacheBlock(i) for i in range(n)]
    q = FreeBlockQueue(blocks)
    queue_file = FreeBlockQueue.remove.__code__.co_filename
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != queue_file:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        for k in range(ops):
            b = blocks[(k * 7919) % n]
            q.remove(b)
            q.append(b)
            q.append(q.popleft())
    finally:
        sys.settrace(None)
    return count


def test_free_queue_operations_are_constant_time():
    """remove-from-the-middle, append and popleft run the same number of lines on a 100x longer
    queue (a scan would run 100x more)."""
    small = _lines_per_op(100, 200)
    large = _lines_per_op(10_000, 200)
    assert small > 0 and large == small, (small, large)


def test_blocks_never_used_are_created_in_queue_order_as_popleft_reaches_them():
    """Random pops, frees to the front and to the tail and removals from the middle, on a queue
    of 5 blocks followed by 300 not created yet, give the order a plain list gives (popleft takes
    index 0); the queue creates a block only when popleft reaches it, in id order."""
    with pytest.raises(ValueError, match="born"):  # new ids would repeat 0, 1, ...
        FreeBlockQueue([KVCacheBlock(3)], num_unborn=2)
    rng = random.Random(7)
    born = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(list(born), num_unborn=300, born=born)
    model = list(range(305))  # ids in queue order
    taken: list[KVCacheBlock] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.45 and model:
            block = q.popleft()
            assert block.block_id == model.pop(0)
            taken.append(block)
        elif op < 0.85 and taken:
            block = taken.pop(rng.randrange(len(taken)))
            to_front = rng.random() < 0.5
            (q.appendleft if to_front else q.append)(block)
            model.insert(0, block.block_id) if to_front else model.append(block.block_id)
        elif free_created := [i for i in model if i < len(born)]:  # a cache hit on a free block
            block_id = rng.choice(free_created)
            q.remove(born[block_id])
            model.remove(block_id)
            taken.append(born[block_id])
        assert len(q) == len(model) and list(q.block_ids()) == model  # the walk creates nothing
        assert [b.block_id for b in born] == list(range(len(born)))  # created in id order, once each
        assert q.num_unborn == 305 - len(born) == sum(1 for i in model if i >= len(born))
    assert 5 < len(born) < 305  # popleft reached the range, and some of it is still not created
    assert [b.block_id for b in q] == model and q.num_unborn == 0 and len(born) == 305


def test_a_pool_creates_only_the_blocks_it_hands_out():
    pool = BlockPool(10_000_000)
    assert pool.get_num_free_blocks() == 10_000_000 and pool.free_block_queue.num_unborn == 10_000_000
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert pool.free_block_queue.num_unborn == 10_000_000 - 3 and pool.get_num_free_blocks() == 10_000_000 - 3
    assert [b.block_id for b in pool.created_blocks] == [0, 1, 2]
    assert list(itertools.islice(pool.free_block_queue.block_ids(), 2)) == [3, 4]
    with pytest.raises(ValueError):
        pool.get_new_blocks(10_000_000)


# --- allocation order, free order, LRU ---------------------------------------------------


def test_allocation_pops_from_the_front():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 4]
    assert queue_ids(pool) == [5]
    assert all(b.ref_cnt == 1 for b in pool.blocks[:5])
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert queue_ids(pool) == [5]  # a failed allocation changes nothing


def test_freed_request_returns_blocks_reversed_to_the_tail():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(100, 110))  # 10 tokens -> blocks 0, 1 (full, cached), 2 (partial)
    admit(kv, a)
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert queue_ids(kv.block_pool) == [3, 4, 5, 6, 7]
    kv.free(a)
    # Hand-computed: a's partial block (no hash: nothing to hit) at the front, then the untouched
    # blocks, then a's cached blocks tail-first.
    assert queue_ids(kv.block_pool) == [2, 3, 4, 5, 6, 7, 1, 0]
    # Allocation takes the partial block, then the never-used ones; the cached blocks stay.
    b = make_request("b", range(200, 224))  # 24 tokens -> 6 blocks
    admit(kv, b)
    assert kv.get_block_ids("b") == [2, 3, 4, 5, 6, 7]
    assert queue_ids(kv.block_pool) == [1, 0]


def test_without_prefix_caching_freed_blocks_are_reused_before_untouched_ones():
    """No block is hashed, so each freed block goes to the front: the next request gets the
    blocks just freed (memory already touched), not the never-used ones."""
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", range(100, 110))  # blocks 0, 1, 2
    admit(kv, a)
    kv.free(a)
    # Hand-computed: freed tail-first (2, 1, 0), each to the front.
    assert queue_ids(kv.block_pool) == [0, 1, 2, 3, 4, 5, 6, 7]
    b = make_request("b", range(200, 208))  # 2 blocks
    admit(kv, b)
    assert kv.get_block_ids("b") == [0, 1]
    kv.free(b)
    assert queue_ids(kv.block_pool) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_eviction_is_lru_across_requests():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", range(100, 108))  # blocks 0, 1
    b = make_request("b", range(200, 208))  # blocks 2, 3
    c = make_request("c", range(300, 308))  # blocks 4, 5
    for r in (a, b, c):
        admit(kv, r)
    kv.free(b)
    kv.free(a)
    kv.free(c)
    assert queue_ids(kv.block_pool) == [3, 2, 1, 0, 5, 4]
    d = make_request("d", range(400, 412))  # 3 blocks: b's (freed first), then a's last block
    admit(kv, d)
    assert kv.get_block_ids("d") == [3, 2, 1]
    # b's blocks and a's second block were evicted; a's first block and c's are still cached.
    assert kv.block_pool.num_evictions == 3
    assert kv.get_computed_blocks(make_request("a2", range(100, 108)))[1] == BS
    assert kv.get_computed_blocks(make_request("b2", range(200, 208)))[1] == 0
    assert kv.get_computed_blocks(make_request("c2", range(300, 308)))[1] == BS


# --- ref counts and sharing ----------------------------------------------------------------


def test_ref_counts_and_sharing():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_request("a", prompt)
    admit(kv, a)
    b = make_request("b", prompt)
    hits, num_cached, new = admit(kv, b)
    assert num_cached == 8 and [h.block_id for h in hits] == [0, 1]
    assert [x.block_id for x in new] == [3]  # the partial last block is never shared
    assert kv.get_block_ids("b") == [0, 1, 3]
    pool = kv.block_pool
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    # shared blocks stay out of the queue; a's partial block (no hash) goes to the front
    assert queue_ids(pool) == [2] + list(range(4, 10))
    kv.free(b)
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [0, 0, 0, 0]
    assert queue_ids(pool) == [3, 2] + list(range(4, 10)) + [1, 0]
    assert pool.get_num_free_blocks() == 10


# --- hashing -----------------------------------------------------------------------------


def test_hash_chaining():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4])  # deterministic
    other_parent = hash_block_tokens(None, [9, 9, 9, 9])
    # Same tokens, different parent -> different hash.
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(other_parent, [5, 6, 7, 8])
    assert hash_block_tokens(None, [5, 6, 7, 8]) != hash_block_tokens(h0, [5, 6, 7, 8])
    # Token order and values matter; extra keys matter.
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [2, 1, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != h0
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != hash_block_tokens(None, [1, 2, 3, 4], ("pepper",))
    # Large token ids are fine (int64).
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])


def test_request_block_hashes_chain_and_cache_salt_only_via_extra_keys():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(13))  # 3 full blocks
    plain = make_request("p", tokens)
    salted = make_request("s", tokens, cache_salt="tenant-1")
    kv.update_block_hashes(plain)
    kv.update_block_hashes(salted)
    assert len(plain.block_hashes) == 3
    expected = []
    parent = None
    for i in range(3):
        parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS])
        expected.append(parent)
    assert plain.block_hashes == expected
    # The salt enters block 0's extra keys only; the chain carries it to every later block.
    s0 = hash_block_tokens(None, tokens[:BS], ("tenant-1",))
    s1 = hash_block_tokens(s0, tokens[BS : 2 * BS])
    assert salted.block_hashes[:2] == [s0, s1]
    assert all(x != y for x, y in zip(plain.block_hashes, salted.block_hashes))
    # Different salts never share; the same salt does.
    admit(kv, salted)
    assert kv.get_computed_blocks(make_request("p2", tokens))[1] == 0
    assert kv.get_computed_blocks(make_request("s2", tokens, cache_salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(make_request("s3", tokens, cache_salt="tenant-1"))[1] == 12


def test_block_hashes_extend_incrementally_with_output_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r = make_request("r", range(7))
    kv.update_block_hashes(r)
    assert len(r.block_hashes) == 1
    first = r.block_hashes[0]
    r.append_output_token(50)
    kv.update_block_hashes(r)
    assert len(r.block_hashes) == 2 and r.block_hashes[0] == first
    assert r.block_hashes[1] == hash_block_tokens(first, [4, 5, 6, 50])


# --- prefix cache hits, evictions ---------------------------------------------------------


def test_hit_on_cached_free_block_removes_it_from_the_middle_of_the_queue():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    pool = kv.block_pool
    a = make_request("a", range(12))  # 3 full blocks: 0, 1, 2; all cached
    admit(kv, a)
    kv.free(a)
    assert queue_ids(pool) == [3, 4, 5, 6, 7, 2, 1, 0]
    b = make_request("b", list(range(8)) + [99])  # shares a's first 2 blocks
    hits, num_cached, new = admit(kv, b)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8
    assert [x.block_id for x in new] == [3]
    assert queue_ids(pool) == [4, 5, 6, 7, 2]
    assert pool.blocks[0].ref_cnt == pool.blocks[1].ref_cnt == 1
    assert pool.num_evictions == 0  # a hit is not an eviction; block 3 had no hash
    assert pool.get_num_free_blocks() == 5


def test_eviction_drops_the_hash_and_is_counted():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    pool = kv.block_pool
    a = make_request("a", range(8))  # blocks 0, 1 cached
    admit(kv, a)
    h0, h1 = a.block_hashes
    kv.free(a)
    assert pool.get_cached_block(h0) is pool.blocks[0] and pool.get_cached_block(h1) is pool.blocks[1]
    assert queue_ids(pool) == [2, 3, 1, 0]
    b = make_request("b", range(100, 111))  # 3 blocks: 2, 3, then a's block 1 is evicted
    admit(kv, b)
    assert kv.get_block_ids("b") == [2, 3, 1]
    assert pool.num_evictions == 1
    assert pool.get_cached_block(h1) is None
    assert pool.get_cached_block(h0) is pool.blocks[0]
    assert pool.blocks[1].block_hash is None  # b's third block is partial
    assert h1 not in pool.cached_block_hash_to_block
    # a's prompt now hits block 0 only
    assert kv.get_computed_blocks(make_request("a2", range(8)))[1] == 4


def test_only_full_blocks_are_cached():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(10))  # 2 full blocks + 2 tokens
    admit(kv, a)
    pool = kv.block_pool
    assert len(pool.cached_block_hash_to_block) == 2
    assert [pool.blocks[i].block_hash is not None for i in range(3)] == [True, True, False]
    # Decode tokens fill the third block; it is cached once full and scheduled.
    for tok in (10, 11):
        a.append_output_token(tok)
        assert kv.allocate_slots(a, 1) == []
        a.num_computed_tokens += 1
    assert a.num_computed_tokens == 12
    assert pool.blocks[2].block_hash is not None and len(pool.cached_block_hash_to_block) == 3
    # The next token needs a fourth block, not cached (1 token).
    a.append_output_token(12)
    assert [b.block_id for b in kv.allocate_slots(a, 1)] == [3]
    assert pool.blocks[3].block_hash is None


def test_chunked_prefill_caches_only_the_scheduled_full_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(16))
    kv.allocate_slots(a, 6)  # a 6-token chunk: block 0 full, block 1 half
    a.num_computed_tokens = 6
    pool = kv.block_pool
    assert len(pool.cached_block_hash_to_block) == 1 and pool.blocks[0].block_hash == a.block_hashes[0]
    assert pool.blocks[1].block_hash is None
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 12
    assert len(pool.cached_block_hash_to_block) == 3


def test_lookup_never_covers_the_whole_prompt():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(8))  # exactly 2 full blocks, both cached
    admit(kv, a)
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    blocks, n = kv.get_computed_blocks(make_request("b", range(8)))
    assert n == 4 and len(blocks) == 1  # at most 1 of 2 blocks: the last token is recomputed
    blocks, n = kv.get_computed_blocks(make_request("c", range(9)))
    assert n == 8 and len(blocks) == 2
    blocks, n = kv.get_computed_blocks(make_request("d", range(4)))  # one full block
    assert n == 0 and blocks == []


def test_admission_with_whole_prompt_cached_recomputes_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(8))
    admit(kv, a)
    b = make_request("b", range(8))
    hits, num_cached, new = admit(kv, b)
    assert num_cached == 4 and len(new) == 1  # block 1 again: recomputed into a fresh block
    assert kv.get_block_ids("b") == [0, 2]
    # The duplicate content does not replace the cached copy.
    assert kv.block_pool.get_cached_block(b.block_hashes[1]) is kv.block_pool.blocks[1]
    assert kv.block_pool.blocks[2].block_hash is None


def test_prefix_caching_off_gives_no_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", range(12))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", range(12))
    hits, num_cached, _ = admit(kv, b)
    assert hits == [] and num_cached == 0
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert all(blk.block_hash is None for blk in kv.block_pool.blocks)
    assert b.block_hashes == []
    assert kv.prefix_cache_stats.hits == 0


def test_allocate_slots_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", range(8))
    admit(kv, a)
    kv.free(a)  # blocks 0, 1 cached and free
    before = queue_ids(kv.block_pool)
    b = make_request("b", list(range(8)) + list(range(50, 60)))  # hits 2 blocks, needs 3 more
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    # 2 revived hits + 3 new blocks = 5 > 4 free
    assert kv.num_blocks_to_allocate(b, 10, hits) == 5
    assert kv.allocate_slots(b, 10, hits) is None
    assert queue_ids(kv.block_pool) == before
    assert all(blk.ref_cnt == 0 for blk in kv.block_pool.blocks)
    assert "b" not in kv.block_tables or kv.block_tables["b"] == []
    assert kv.num_blocks_to_allocate(b, 8, hits) == 4
    assert [x.block_id for x in kv.allocate_slots(b, 8, hits)] == [2, 3]


def test_num_blocks_to_allocate_does_not_count_hits_on_held_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(9))
    admit(kv, a)  # a holds blocks 0, 1, 2
    b = make_request("b", range(9))
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    assert kv.num_blocks_to_allocate(b, 1, hits) == 1  # only the last block is new


# --- counters ----------------------------------------------------------------------------


def test_counters_usage_queries_hits_evictions():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    assert kv.usage == 0.0 and kv.num_free_blocks == 4
    a = make_request("a", range(9))  # 3 blocks
    admit(kv, a)
    assert kv.usage == pytest.approx(0.75) and kv.num_free_blocks == 1
    stats = kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 9, 0)
    b = make_request("b", range(9))
    kv.get_computed_blocks(b)
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    kv.get_computed_blocks(b, record_stats=False)
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    kv.free(a)
    assert kv.usage == 0.0
    c = make_request("c", range(100, 116))  # 4 blocks: evicts a's 2 cached blocks
    admit(kv, c)
    assert kv.block_pool.num_evictions == 2
    assert kv.usage == 1.0


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", range(8))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False  # blocks are held
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert kv.get_computed_blocks(make_request("b", range(9)))[1] == 0


def test_block_pool_rejects_empty():
    with pytest.raises(ValueError):
        BlockPool(0)
