"""Stateful property test: random add / step / finish / abort sequences through the Scheduler and
the KVCacheManager, with every invariant of the block pool, the manager and the scheduler
checked after every operation (and between schedule() and update_from_output()).

The model is simulated by a shadow of the KV cache: ``contents[block_id][offset]`` is the token
whose K/V was last written into that slot. Each step "writes" the scheduled tokens of every
scheduled request into its block table. This checks that a prefix-cache hit really gives the
request the K/V of its own tokens, and that every cached hash is the chained hash of what its block
holds.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged.core.engine.block_pool import hash_block_tokens
from paged.core.errors import InvalidRequestError, RequestRejectedError
from paged.core.engine.kv_cache_manager import KVCacheManager, cdiv
from paged.core.engine.request import Request, RequestStatus
from paged.core.sampling_params import SamplingParams
from paged.core.engine.scheduler import Scheduler
from paged.plugins.cache_aware import CacheAwarePolicy
from paged.plugins.fair import FairOptions, FairPolicy
from paged.plugins.policies import FCFSPolicy, PriorityOptions, PriorityPolicy
from paged.plugins.slo import SLOOptions, SLOPolicy
from paged.plugins.srpt import SRPTOptions, SRPTPolicy
from adversarial_policy import AdversarialPolicy

# Every bundled policy, some with options that exercise more of the contract, and a policy whose
# every decision is random: none may break an invariant.
POLICIES = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
    "priority-aging": lambda: PriorityPolicy(PriorityOptions(aging_s=3.0)),
    "srpt": lambda: SRPTPolicy(SRPTOptions(aging_tokens_per_s=0.5, preemptive=True)),
    "fair": lambda: FairPolicy(FairOptions(decode_weight=3.0)),
    "cache-aware": CacheAwarePolicy,
    "slo": lambda: SLOPolicy(SLOOptions(initial_step_time_s=0.3)),
    "slo-defer": lambda: SLOPolicy(SLOOptions(initial_step_time_s=0.3, action="defer")),
}

ALPHABET = st.integers(0, 2)  # small, so prompts share prefixes
EOS = 0
MAX_DRAIN_STEPS = 2000


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 14),
        block_size=st.integers(2, 4),
        caching=st.booleans(),
        policy=st.sampled_from([*POLICIES, "adversarial", "adversarial"]),
        seed=st.integers(0, 2**16),
        max_num_seqs=st.integers(1, 4),
        max_num_batched_tokens=st.integers(1, 12),
        threshold=st.sampled_from([0, 0, 2, 3]),
        max_model_len=st.integers(4, 24),
        chunked=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks, block_size, caching, policy, seed, max_num_seqs, max_num_batched_tokens, threshold, max_model_len, chunked):
        if not chunked:  # whole prompts only: the budget must hold the longest sequence
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
            threshold = 0
        pol = AdversarialPolicy(seed) if policy == "adversarial" else POLICIES[policy]()
        self.policy = pol
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        self.bs = block_size
        self.sched = Scheduler(
            pol,
            self.kv,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=threshold,
            enable_chunked_prefill=chunked,
            clock=lambda: self.clock,
        )
        self.contents: dict[int, dict[int, int]] = {}  # block id -> offset -> token
        self.clock = 0.0
        self.ended: set[str] = set()
        # block id -> (hash, contents) when last checked while a request held it
        self.verified: dict[int, tuple[bytes, dict[int, int]]] = {}
        self.last_output = None

    # --- rules ----------------------------------------------------------------------------
    @rule(
        rid=st.sampled_from([f"r{k}" for k in range(8)]),  # ids are reused once finished
        prompt=st.lists(ALPHABET, min_size=1, max_size=14),
        max_tokens=st.integers(1, 6),
        min_tokens=st.integers(0, 2),
        priority=st.integers(0, 2),
        salt=st.sampled_from([None, None, "s"]),
        ignore_eos=st.booleans(),
        stop_token=st.sampled_from([None, 2]),
        tenant=st.sampled_from([None, "a", "b"]),
        deadline=st.sampled_from([None, 0.5, 3.0, 50.0]),
    )
    def add(self, rid, prompt, max_tokens, min_tokens, priority, salt, ignore_eos, stop_token, tenant, deadline):
        self.clock += 1.0
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=ignore_eos,
            stop_token_ids=[stop_token] if stop_token is not None else [],
        )
        request = Request(
            rid,
            prompt,
            params,
            arrival_time=self.clock,
            priority=priority,
            cache_salt=salt,
            eos_token_id=EOS,
            max_tokens=max_tokens,
            tenant=tenant,
            deadline=None if deadline is None else self.clock + deadline,
        )
        total = len(prompt) + max_tokens
        too_long = total > self.sched.max_model_len
        too_big = cdiv(total, self.bs) > self.kv.num_blocks
        in_use = rid in self.sched.requests
        try:
            self.sched.add_request(request)
        except InvalidRequestError as e:
            assert in_use or too_long or too_big, str(e)
            assert rid in str(e) if in_use else str(total) in str(e)
            return
        except RequestRejectedError as e:
            # Only admission control turns requests away, with a reason and 429/503.
            assert isinstance(self.policy, (AdversarialPolicy, SLOPolicy)) and str(e) and e.http_status in (429, 503)
            assert rid not in self.sched.requests or in_use
            return
        assert not (in_use or too_long or too_big)
        self.ended.discard(rid)
        assert request.status == RequestStatus.WAITING

    @rule(data=st.data())
    def step(self, data):
        self.clock += 0.25
        output = self.sched.schedule()
        self._check_output(output)
        # The model writes the K/V of every scheduled token.
        for s in output.scheduled:
            table = self.kv.block_tables[s.request.request_id]
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                block = table[pos // self.bs]
                self.contents.setdefault(block.block_id, {})[pos % self.bs] = s.request.all_token_ids[pos]
        self.check_all()
        # The model may give a token to every scheduled request: only those that sample take it.
        sampled = {s.request.request_id: data.draw(ALPHABET, label="token") for s in output.scheduled}
        takes = {s.request.request_id for s in output.scheduled if s.samples}
        if output.scheduled and data.draw(st.integers(0, 7), label="abort mid-step") == 0:
            # Aborted after schedule(), before the model's output comes back.
            victim = data.draw(st.sampled_from(output.scheduled), label="aborted").request
            self.sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
            self.ended.add(victim.request_id)
            takes.discard(victim.request_id)
            self.check_all()
        before = {s.request.request_id: s.request.num_output_tokens for s in output.scheduled}
        updated = self.sched.update_from_output(output, sampled)
        assert {r.request_id for r in updated} == takes
        for s in output.scheduled:
            r = s.request
            assert r.num_output_tokens == before[r.request_id] + (r.request_id in takes)
            if r.is_finished:
                self.ended.add(r.request_id)
                if r.status != RequestStatus.FINISHED_ABORTED:
                    self._check_stop_reason(r)
        self.last_output = output

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data(), aborted=st.booleans())
    def finish(self, data, aborted):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)), label="request")
        request = self.sched.requests[rid]
        status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
        out = self.sched.finish_requests([rid], status)
        assert out == [request] and request.status == status
        assert rid not in self.sched.requests and rid not in self.kv.block_tables
        assert request not in self.sched.running and request not in list(self.sched.waiting)
        self.ended.add(rid)
        # finishing again, or an unknown id, is a no-op
        assert self.sched.finish_requests([rid, "nope"], status) == []

    # --- invariants -----------------------------------------------------------------------
    def _check_output(self, output):
        sched = self.sched
        assert output.num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(output.scheduled) <= sched.max_num_seqs
        assert len(sched.running) <= sched.max_num_seqs
        ids = [s.request.request_id for s in output.scheduled]
        assert len(ids) == len(set(ids))
        assert not set(ids) & set(output.preempted_request_ids), "preempted and scheduled in one step"
        for r in output.rejected:
            assert r.status == RequestStatus.FINISHED_REJECTED and r.reject_reason
            assert r.request_id not in sched.requests and not self.kv.block_tables.get(r.request_id)
            assert r.first_scheduled_time is None, "a request is only rejected before it first runs"
            self.ended.add(r.request_id)
        for s in output.scheduled:
            r = s.request
            assert r.status == RequestStatus.RUNNING and r in sched.running
            assert s.num_new_tokens >= 1
            if sched.long_prefill_token_threshold:
                assert s.num_new_tokens <= sched.long_prefill_token_threshold
            assert s.num_computed_tokens + s.num_new_tokens == r.num_computed_tokens <= r.num_tokens
            assert r.num_computed_tokens <= sched.max_model_len
        if self.sched.requests and not output.scheduled:
            # Nothing scheduled while work is pending only when nothing can run at all.
            assert not sched.running or all(r.num_computed_tokens == r.num_tokens for r in sched.running)

    def _check_stop_reason(self, r):
        p = r.sampling_params
        last = r.output_token_ids[-1]
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens or r.num_tokens >= self.sched.max_model_len
        else:
            assert r.status == RequestStatus.FINISHED_STOPPED
            assert r.num_output_tokens >= p.min_tokens
            assert last in p.stop_token_ids or (last == EOS and not p.ignore_eos)
        # nothing stopped it earlier
        for k, tok in enumerate(r.output_token_ids[:-1], start=1):
            if k >= p.min_tokens:
                assert tok not in p.stop_token_ids and (p.ignore_eos or tok != EOS)

    def _chain_hashes(self, request, table, upto):
        """Chained hashes of the first ``upto`` blocks of ``table`` from the shadow contents."""
        out, parent = [], None
        for j in range(upto):
            content = self.contents.get(table[j].block_id, {})
            tokens = [content.get(o) for o in range(self.bs)]
            if None in tokens:
                break
            extra = (request.cache_salt,) if j == 0 and request.cache_salt else ()
            parent = hash_block_tokens(parent, tokens, extra)
            out.append(parent)
        return out

    @invariant()
    def check_all(self):
        if not hasattr(self, "kv"):
            return
        kv, pool, sched, bs = self.kv, self.kv.block_pool, self.sched, self.bs

        # Free queue: no duplicates, length = number of ref-0 blocks, free iff ref 0.
        queue = list(pool.free_block_queue)
        queue_ids = [b.block_id for b in queue]
        assert len(queue_ids) == len(set(queue_ids))
        assert len(queue) == pool.free_block_queue.num_free_blocks == pool.get_num_free_blocks()
        assert sum(1 for b in pool.blocks if b.ref_cnt == 0) == len(queue)
        in_queue = set(queue_ids)
        for b in pool.blocks:
            assert b.ref_cnt >= 0
            assert (b.block_id in in_queue) == (b.ref_cnt == 0), b
            if b.ref_cnt:
                assert b.prev_free is None and b.next_free is None

        # Ref counts = number of block tables holding the block (each table holds it once).
        holders: dict[int, int] = {}
        for rid, table in kv.block_tables.items():
            ids = [b.block_id for b in table]
            assert len(ids) == len(set(ids)), f"{rid} holds a block twice"
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0), b

        # The hash map and the blocks agree.
        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h
        for b in pool.blocks:
            if b.block_hash is not None:
                assert pool.cached_block_hash_to_block[b.block_hash] is b
        if not kv.enable_caching:
            assert not pool.cached_block_hash_to_block

        # Requests: running / waiting / tables agree.
        running_ids = {r.request_id for r in sched.running}
        waiting = list(sched.waiting)
        waiting_ids = {r.request_id for r in waiting}
        assert len(running_ids) == len(sched.running) and len(waiting_ids) == len(waiting) == len(sched.waiting)
        assert not running_ids & waiting_ids
        assert running_ids | waiting_ids == set(sched.requests)
        assert not set(sched.requests) & self.ended
        assert set(kv.block_tables) <= running_ids | {rid for rid, t in kv.block_tables.items() if not t}
        keys = [r.sort_key for r in sched.running]
        assert keys == sorted(keys), "running list out of policy order"
        assert len(sched.running) <= sched.max_num_seqs
        held_slots: set[tuple[int, int]] = set()  # (block id, offset) of every computed token
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
            table = kv.block_tables.get(r.request_id, [])
            assert len(table) == cdiv(r.num_computed_tokens, bs), (r.request_id, len(table), r.num_computed_tokens)
            held_slots.update((table[p // bs].block_id, p % bs) for p in range(r.num_computed_tokens))
            # Every computed slot holds this request's token (prefix hits included).
            for pos in range(r.num_computed_tokens):
                got = self.contents.get(table[pos // bs].block_id, {}).get(pos % bs)
                assert got == r.all_token_ids[pos], f"{r.request_id} pos {pos}: {got} != {r.all_token_ids[pos]}"
            # Only full, computed blocks are cached, and each under the chained hash of its contents.
            chain = self._chain_hashes(r, table, len(table))
            for j, b in enumerate(table):
                if b.block_hash is not None:
                    assert (j + 1) * bs <= r.num_computed_tokens, "a block cached before it is computed"
                    assert j < len(chain) and b.block_hash == chain[j], f"{r.request_id} block {j} hash mismatch"
                    assert b.block_hash == r.block_hashes[j]
                    self.verified[b.block_id] = (b.block_hash, dict(self.contents[b.block_id]))
        # A free block keeps its hash only as long as its contents are what was checked.
        for b in pool.blocks:
            if b.block_hash is not None and b.ref_cnt == 0:
                assert self.verified.get(b.block_id) == (b.block_hash, self.contents.get(b.block_id)), b
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0
            assert not kv.block_tables.get(r.request_id)
        # Tokens held (shared prefix slots once) never exceed the capacity.
        assert len(held_slots) <= kv.num_blocks * bs
        assert len({b.block_id for t in kv.block_tables.values() for b in t}) <= kv.num_blocks
        if not sched.requests:
            assert pool.get_num_free_blocks() == pool.num_blocks
        if isinstance(self.policy, AdversarialPolicy):  # the views it was given are read-only
            assert self.policy.mutation_errors == self.policy.mutation_attempts

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        # Liveness: everything admitted runs to completion (the model keeps producing tokens).
        if isinstance(self.policy, AdversarialPolicy):
            self.policy.calm = True  # a policy that defers forever starves by its own choice
        steps = 0
        while self.sched.has_unfinished_requests():
            steps += 1
            assert steps <= MAX_DRAIN_STEPS, "scheduler made no progress"
            self.clock += 0.25
            output = self.sched.schedule()
            self._check_output(output)
            for s in output.scheduled:
                table = self.kv.block_tables[s.request.request_id]
                for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                    self.contents.setdefault(table[pos // self.bs].block_id, {})[pos % self.bs] = s.request.all_token_ids[pos]
            self.check_all()
            self.sched.update_from_output(output, {s.request.request_id: 1 for s in output.scheduled if s.samples})
        self.check_all()
        pool = self.kv.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert self.kv.block_tables == {} or all(not t for t in self.kv.block_tables.values())


KVCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheStateful = KVCacheMachine.TestCase
