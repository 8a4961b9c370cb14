"""Per-request block tables on top of the block pool: prefix lookup, allocation, free.

A request's ``block_table`` covers its computed tokens plus the tokens scheduled this step. Full
blocks are registered in the prefix cache as soon as their tokens are known and scheduled: the
step writes their K/V before any attention reads them (every layer writes the whole batch's K/V
first), so a request admitted later in the same step may already share them (n > 1 samples,
identical prompts).

Sliding window (``sliding_window`` set: every layer of the model attends over at most the last
``sliding_window`` positions; the engine passes the largest window, and None as soon as one layer
is global). A query at position ``p`` reads keys ``> p - W`` only, and a request's later queries
are at positions ``>= num_computed_tokens``, so a block whose positions all lie at or below
``num_computed_tokens - W`` is never read again: when a request next needs a new block (or is
admitted), such blocks are returned to the pool and their table entries become
``PLACEHOLDER_BLOCK`` (block id 0, no reference held; the attention backends never read positions
out of a window, so what block 0 holds does not matter and nothing is ever written through a
placeholder). A long generation then holds about ``W / block_size + 2`` blocks. Prefix caching
stays correct: a freed block keeps its hash while its contents are intact (until the pool
reallocates it, which evicts the hash), so a hit is always real data; a hit on a block that is
already out of the new request's window is not taken (a placeholder stands in its place, and the
block is neither referenced nor revived).
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.core.engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from paged.core.engine.request import Request
from paged.core.utils import cdiv

# Stands for a block that fell out of the window (see the module docstring): not in the pool.
PLACEHOLDER_BLOCK = KVCacheBlock(0)



def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int,
                        cache_salt: str | None = None, lora_int_id: int = 0) -> list[bytes]:
    """Extend ``hashes`` (the chained hashes of the first ``len(hashes)`` full blocks of
    ``token_ids``) to every full block, and return it. The one definition of a prefix-cache key:
    block i's hash chains block i-1's; the cache salt and the LoRA adapter's id (the KV of a prompt
    depends on the adapter) go into block 0's only. The data-parallel router
    (paged.core.frontend.dp_router) uses it too, so that its keys are the cores' keys."""
    first = tuple(key for key in (cache_salt, f"lora:{lora_int_id}" if lora_int_id else None) if key)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else None
        extra = first if i == 0 else ()
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
    return hashes


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of which found in the cache
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        """``sliding_window``: the largest window when every layer of the model has one (blocks
        out of it are freed), None when any layer attends over everything."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # how many leading entries of each request's table are placeholders (window only)
        self.num_freed_blocks: dict[str, int] = {}
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the cache already.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # --- queries -----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, ())]

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of its known tokens."""
        if self.enable_caching:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt,
                                request.lora_int_id)

    def get_computed_blocks(self, request: Request, record_stats: bool = True) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a waiting request: (blocks, number of tokens).

        Never the whole sequence: at least its last token is computed again, to get logits. None
        for a request that must compute every prompt position (``computes_every_prompt_token``)."""
        if not self.enable_caching or request.computes_every_prompt_token:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        if record_stats:
            self.record_prefix_lookup(request.num_tokens, num_tokens)
        return blocks, num_tokens

    def record_prefix_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Count one admission's lookup: ``num_tokens`` queried, ``num_cached`` found."""
        if self.enable_caching:
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += num_tokens
            stats.hits += num_cached

    def num_blocks_to_allocate(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] = ()
    ) -> int:
        """Free blocks that ``allocate_slots`` would consume (hits on free blocks count too)."""
        held = len(self.block_tables.get(request.request_id, ())) + len(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        needed = max(cdiv(num_computed + num_new_tokens, self.block_size) - held, 0)
        if new_computed_blocks:
            first = self._num_dead_blocks(num_computed) - len(self.block_tables.get(request.request_id, ()))
            # revived hits (those out of the window are not taken)
            needed += sum(1 for b in new_computed_blocks[max(first, 0):] if b.ref_cnt == 0)
        if self.sliding_window is not None:  # what allocate_slots frees first
            needed -= self._num_freeable(request.request_id, request.num_computed_tokens)
        return needed

    def _num_dead_blocks(self, first_query_position: int) -> int:
        """Leading blocks no query at ``first_query_position`` or later reads (window only)."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query_position - self.sliding_window + 1) // self.block_size

    def _num_freeable(self, request_id: str, first_query_position: int) -> int:
        """Blocks that ``_free_out_of_window`` would return to the free queue now."""
        table = self.block_tables.get(request_id)
        if not table:
            return 0
        dead = min(self._num_dead_blocks(first_query_position), len(table))
        return sum(1 for b in table[self.num_freed_blocks.get(request_id, 0) : dead]
                   if b is not PLACEHOLDER_BLOCK and b.ref_cnt == 1)

    def _free_out_of_window(self, request_id: str, table: list[KVCacheBlock], first_query_position: int) -> None:
        """Return the table's blocks out of every later query's window to the pool (oldest
        first), leaving placeholders in their entries."""
        start = self.num_freed_blocks.get(request_id, 0)
        dead = min(self._num_dead_blocks(first_query_position), len(table))
        if dead <= start:
            return
        freed = [b for b in table[start:dead] if b is not PLACEHOLDER_BLOCK]
        table[start:dead] = [PLACEHOLDER_BLOCK] * (dead - start)
        self.num_freed_blocks[request_id] = dead
        self.block_pool.free_blocks(freed)

    # --- mutations ---------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens (after its computed tokens
        and any prefix-cache hits in ``new_computed_blocks``). All or nothing: returns the newly
        allocated blocks, or None (and changes nothing) if the free blocks do not suffice.
        ``request.num_computed_tokens`` must not count the hits yet: they are added here."""
        table = self.block_tables.get(request.request_id)
        if table and not new_computed_blocks:
            # Fast path (most decodes): the table ends with the block of the last computed token;
            # the new tokens fit in it without filling it, so there is nothing to allocate and no
            # block becomes full to cache.
            if request.num_computed_tokens + num_new_tokens < len(table) * self.block_size:
                return []
        if self.num_blocks_to_allocate(request, num_new_tokens, new_computed_blocks) > self.num_free_blocks:
            return None
        table = self.block_tables.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        if self.sliding_window is not None:
            self._free_out_of_window(request.request_id, table, request.num_computed_tokens)
        if new_computed_blocks:
            # hits out of the window are not taken: placeholders stand in their entries
            skip = min(max(self._num_dead_blocks(num_computed) - len(table), 0), len(new_computed_blocks))
            taken = list(new_computed_blocks[skip:])
            self.block_pool.touch(taken)
            table.extend([PLACEHOLDER_BLOCK] * skip + taken)
            if skip:
                self.num_freed_blocks[request.request_id] = len(table) - len(taken)
            self.num_cached_blocks[request.request_id] = len(table)
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(table)
        new_blocks = self.block_pool.get_new_blocks(needed) if needed > 0 else []
        table.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, table, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, table: list[KVCacheBlock], num_tokens: int) -> None:
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens, request.num_tokens) // self.block_size
        if end <= start:
            return
        self.update_block_hashes(request)
        for i in range(start, end):
            if table[i] is not PLACEHOLDER_BLOCK:  # (a block is cached before it can fall out of the window)
                self.block_pool.cache_block(table[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (so its last blocks are evicted first)."""
        table = self.block_tables.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if self.num_freed_blocks.pop(request.request_id, 0):
            table = [b for b in table if b is not PLACEHOLDER_BLOCK]
        if table:
            self.block_pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only allowed when no request holds blocks."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.block_pool.reset_prefix_cache()
        return True
