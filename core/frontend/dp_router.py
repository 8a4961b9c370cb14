"""Which engine core serves a request, when ``paged serve`` runs several (data parallelism).

The front-end routes every core request (each child of an n > 1 request on its own) when it is
added, and remembers the choice until the request ends, so that an abort or a stop reaches the
core that holds it. The rule, in order:

1. **Load** of a core = the front-end's unfinished requests sent to it (its waiting + running as
   far as the front-end knows). ``min_load`` = the smallest load.
2. **Prefix affinity**: the prompt's full blocks are hashed with the prefix cache's own function
   (``extend_block_hashes``: same block size, same cache salt and LoRA adapter, so the same keys as in
   the cores).
   A bounded LRU map remembers, for each block hash, the core it was last sent to. A core's
   known match = the longest prefix of the prompt's blocks whose last block was last sent to it
   (hashes are chained: block i's hash stands for blocks 0..i). The core with the longest known
   match wins if its load is at most ``min_load + slack``; ties go to the lower load, then the
   lower rank.
3. Otherwise the least-loaded core; ties rotate (round robin), so that light sequential traffic
   spreads over the cores instead of piling onto core 0.

``slack`` (default ``DEFAULT_SLACK = 2`` requests): a prefix hit saves the matched tokens'
prefill, while one extra request on a core slows each of that core's steps a little; two
requests of imbalance is the price paid for a hit, more is not. It is absolute, not relative, so
the rule is the same at any load. The map holds at most ``max_hashes`` entries (the front-end
uses the cores' total KV blocks: a hash older than that many newer ones has most likely been
evicted from its core's cache anyway); entries are touched from the prompt's last block to its
first, so the first blocks of a prefix, which every longer prompt needs, are evicted last.

A core that is lost while the others keep serving (``parallel.data_parallel_on_core_loss:
continue``) is dropped (``drop_core``: its requests and remembered prefixes are forgotten, and
nothing is routed to it) until it rejoins (``restore_core``).

Invariants: ``loads[c]`` = the number of ids in ``core_of`` mapped to ``c``; ``len(block_owner)
<= max_hashes``; no id or hash maps to a core in ``lost``. The router never talks to a core; the
caller sends what it says.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from paged.core.engine.kv_cache_manager import extend_block_hashes

DEFAULT_SLACK = 2


class DataParallelRouter:
    def __init__(self, num_cores: int, block_size: int, max_hashes: int, slack: int = DEFAULT_SLACK,
                 prefix_affinity: bool = True) -> None:
        if num_cores < 1:
            raise ValueError(f"num_cores must be >= 1, got {num_cores}")
        if max_hashes < 1 or slack < 0:
            raise ValueError(f"max_hashes must be >= 1 and slack >= 0, got {max_hashes} and {slack}")
        self.num_cores = num_cores
        self.block_size = block_size
        self.max_hashes = max_hashes
        self.slack = slack
        self.prefix_affinity = prefix_affinity  # off when the cores do not cache prefixes
        self.loads = [0] * num_cores
        self.core_of: dict[str, int] = {}  # unfinished request id -> its core
        self.block_owner: OrderedDict[bytes, int] = OrderedDict()  # block hash -> core last sent to; LRU first
        self._next_tie = 0  # round-robin start among equally loaded cores
        self.lost: set[int] = set()  # cores nothing is routed to (see drop_core)

    # --- routing ------------------------------------------------------------------------------
    def route(self, request_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None = None,
              lora_int_id: int = 0) -> int:
        """Choose the core for a new request and count it there (``lora_int_id``: its LoRA
        adapter's, part of its prefix-cache keys)."""
        if request_id in self.core_of:
            raise ValueError(f"request {request_id!r} is already routed to core {self.core_of[request_id]}")
        hashes = (extend_block_hashes([], list(prompt_token_ids), self.block_size, cache_salt, lora_int_id)
                  if self.prefix_affinity and self.num_cores > 1 else [])
        core = self._choose(hashes)
        self.core_of[request_id] = core
        self.loads[core] += 1
        self._remember(hashes, core)
        return core

    def known_match(self, hashes: Sequence[bytes]) -> dict[int, int]:
        """Core -> number of leading blocks of ``hashes`` last sent to it (cores without a match
        are left out)."""
        matched: dict[int, int] = {}
        owner = self.block_owner
        for i, block_hash in enumerate(hashes):
            core = owner.get(block_hash)
            if core is None:
                break  # evicted or never sent: the chain ends here for every core
            matched[core] = i + 1
        return matched

    def _choose(self, hashes: Sequence[bytes]) -> int:
        loads, lost = self.loads, self.lost
        if len(lost) == self.num_cores:
            raise ValueError("every engine core is lost: nothing to route to")
        min_load = min(load for c, load in enumerate(loads) if c not in lost) if lost else min(loads)
        if hashes:
            matched = self.known_match(hashes)  # (a lost core's hashes were forgotten)
            eligible = [c for c in matched if loads[c] <= min_load + self.slack]
            if eligible:
                return max(eligible, key=lambda c: (matched[c], -loads[c], -c))
        n = self.num_cores
        start = self._next_tie
        for k in range(n):
            core = (start + k) % n
            if loads[core] == min_load and core not in lost:
                self._next_tie = (core + 1) % n
                return core
        raise AssertionError("unreachable: some core has the minimum load")

    def _remember(self, hashes: Sequence[bytes], core: int) -> None:
        owner = self.block_owner
        for block_hash in reversed(hashes):  # the prefix's head ends most recent: evicted last
            owner[block_hash] = core
            owner.move_to_end(block_hash)
        while len(owner) > self.max_hashes:
            owner.popitem(last=False)

    # --- bookkeeping --------------------------------------------------------------------------
    def finish(self, request_id: str) -> int | None:
        """The request ended (finished, stopped, aborted, failed): uncount it. Returns its core,
        or None if it was not routed or has ended already (a second finish changes nothing)."""
        core = self.core_of.pop(request_id, None)
        if core is not None:
            self.loads[core] -= 1
        return core

    def group_by_core(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """The unfinished ones among ``request_ids``, by the core that holds them (to send an
        abort to the right cores); unknown ids are left out."""
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            core = self.core_of.get(request_id)
            if core is not None:
                groups.setdefault(core, []).append(request_id)
        return groups

    def drop_core(self, core: int) -> list[str]:
        """The core is lost: route nothing to it, forget its prefixes; returns its unfinished
        requests' ids (forgotten too: the caller fails them)."""
        self.lost.add(core)
        ids = [request_id for request_id, c in self.core_of.items() if c == core]
        for request_id in ids:
            del self.core_of[request_id]
        self.loads[core] = 0
        for block_hash in [h for h, c in self.block_owner.items() if c == core]:
            del self.block_owner[block_hash]
        return ids

    def restore_core(self, core: int) -> None:
        """A lost core rejoined (empty: no request, no cached prefix)."""
        self.lost.discard(core)

    def forget_prefixes(self) -> None:
        """The cores' prefix caches were reset: every remembered hash is stale."""
        self.block_owner.clear()

    def reset(self) -> None:
        """Forget every request and prefix (the engine died)."""
        self.lost.clear()
        self.loads = [0] * self.num_cores
        self.core_of.clear()
        self.block_owner.clear()
