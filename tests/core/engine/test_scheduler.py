"""Scheduler scenarios: budget, chunking, continuous batching, preemption, priority displacement,
aging, abort, admission checks and stop conditions. No model: each step samples a fixed or given
token for every scheduled request whose prefill completes (``ScheduledRequest.is_sampled``)."""

from __future__ import annotations

import random

import pytest

from paged.core.errors import ConfigError, InvalidRequestError
from paged.core.engine.kv_cache_manager import KVCacheManager
from paged.core.utils import cdiv
from paged.core.engine.request import Request, RequestStatus
from paged.core.sampling_params import SamplingParams
from paged.core.engine.scheduler import Scheduler
from paged.plugins.policies import FCFSPolicy, PriorityOptions, PriorityPolicy

TOKEN = 7  # a token that stops nothing
EOS = 2


def make_sched(
    policy=None,
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=256,
    threshold=0,
    caching=True,
    chunked=True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(
        policy or FCFSPolicy(),
        kv,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=threshold,
        enable_chunked_prefill=chunked,
    )


_ids = iter(range(10**9))


def req(rid=None, n=8, max_tokens=4, arrival=None, priority=0, tokens=None, base=None, **params) -> Request:
    """A request with ``n`` unique prompt tokens (or ``tokens``)."""
    k = next(_ids)
    rid = rid or f"r{k}"
    if tokens is None:
        base = 1000 * (k + 1) if base is None else base
        tokens = list(range(base, base + n))
    params.setdefault("max_tokens", max_tokens)
    return Request(
        rid,
        tokens,
        SamplingParams(**params),
        arrival_time=float(k) if arrival is None else arrival,
        priority=priority,
        eos_token_id=EOS,
        max_tokens=params["max_tokens"],
    )


def step(s: Scheduler, token=TOKEN):
    """One engine step; returns the SchedulerOutput. ``token`` may be a dict rid -> token."""
    out = s.schedule()
    sampled = {}
    for x in out.scheduled:
        if x.is_sampled:
            sampled[x.request.request_id] = token.get(x.request.request_id, TOKEN) if isinstance(token, dict) else token
    s.update_from_output(out, sampled)
    return out


def sched_map(out) -> dict[str, int]:
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


def run_to_completion(s: Scheduler, max_steps=10_000, check=None):
    outs = []
    while s.has_unfinished_requests():
        assert len(outs) < max_steps, "no progress"
        out = step(s)
        if check:
            check(s, out)
        outs.append(out)
    return outs


def assert_all_free(s: Scheduler):
    kv = s.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert not any(kv.block_tables.values())


# --- budget and seats --------------------------------------------------------------------


@pytest.mark.parametrize("policy", [FCFSPolicy(), PriorityPolicy(), PriorityPolicy(PriorityOptions(aging_s=5.0))])
@pytest.mark.parametrize("caching", [True, False])
def test_budget_and_max_num_seqs_respected_every_step(policy, caching):
    rng = random.Random(1)
    s = make_sched(policy, num_blocks=40, block_size=4, max_num_seqs=5, max_num_batched_tokens=24, threshold=10, caching=caching)
    requests = []
    for k in range(60):
        n = rng.randint(1, 40)
        tokens = [rng.randint(0, 3) for _ in range(n)] if k % 2 else None  # shared prefixes
        r = req(n=n, tokens=tokens, max_tokens=rng.randint(1, 12), priority=rng.randint(0, 3), ignore_eos=True)
        requests.append(r)
        s.add_request(r)

    def check(s, out):
        assert 0 < out.num_scheduled_tokens <= 24
        assert len(out.scheduled) <= 5 and len(s.running) <= 5
        assert all(1 <= x.num_new_tokens <= 10 for x in out.scheduled)
        for x in out.scheduled:
            assert len(s.kv.block_tables.get(x.request.request_id, ())) in (0, cdiv(x.num_computed_tokens + x.num_new_tokens, 4))

    run_to_completion(s, check=check)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens for r in requests)
    assert_all_free(s)


def test_max_num_seqs_limits_admission():
    s = make_sched(max_num_seqs=2)
    rs = [req(n=4, max_tokens=3) for _ in range(4)]
    for r in rs:
        s.add_request(r)
    out = step(s)
    assert sched_map(out) == {rs[0].request_id: 4, rs[1].request_id: 4}
    assert len(s.waiting) == 2


# --- chunked prefill ---------------------------------------------------------------------


def test_long_prefill_token_threshold_caps_chunks():
    s = make_sched(threshold=8)
    r = req(n=20, max_tokens=3)
    s.add_request(r)
    chunks = []
    samples = []
    for _ in range(5):
        out = step(s)
        chunks.append(out.scheduled[0].num_new_tokens)
        samples.append(out.scheduled[0].is_sampled)
    assert chunks == [8, 8, 4, 1, 1]
    assert samples == [False, False, True, True, True]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [TOKEN] * 3


def test_budget_is_split_and_prefill_chunks_mix_with_decodes():
    s = make_sched(max_num_batched_tokens=10)
    a, b, c = req(n=8, max_tokens=5), req(n=8, max_tokens=5), req(n=30, max_tokens=2)
    for r in (a, b, c):
        s.add_request(r)
    out = step(s)
    assert sched_map(out) == {a.request_id: 8, b.request_id: 2}  # b gets what a leaves
    assert [x.is_sampled for x in out.scheduled] == [True, False]
    out = step(s)
    # a decodes (1), b finishes its prefill (6), c starts with the 3 tokens left
    assert sched_map(out) == {a.request_id: 1, b.request_id: 6, c.request_id: 3}
    assert [x.is_sampled for x in out.scheduled] == [True, True, False]
    out = step(s)
    assert sched_map(out) == {a.request_id: 1, b.request_id: 1, c.request_id: 8}
    assert out.num_scheduled_tokens == 10


def test_without_chunked_prefill_a_prompt_is_admitted_whole():
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make_sched(chunked=False, max_num_batched_tokens=16, max_model_len=64)
    s = make_sched(chunked=False, max_num_batched_tokens=64, max_model_len=64)
    a, b = req(n=40, max_tokens=2), req(n=30, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert sched_map(out) == {a.request_id: 40}  # b does not fit in the 24 left, and is not split
    out = step(s)
    assert sched_map(out) == {a.request_id: 1, b.request_id: 30}


def test_prefix_hit_skips_cached_tokens():
    s = make_sched(block_size=4)
    a = req(n=10, max_tokens=1, base=500)
    s.add_request(a)
    step(s)
    b = req(tokens=list(range(500, 510)) + [1, 2], max_tokens=1)
    s.add_request(b)
    out = s.schedule()
    x = out.scheduled[0]
    assert x.num_computed_tokens == 8 and x.num_new_tokens == 4 and x.is_sampled
    assert b.num_cached_tokens == 8
    # the block ids sent to the runner are the whole table: the 2 hits, then 1 new block
    assert x.new_block_ids == s.kv.get_block_ids(b.request_id) and len(x.new_block_ids) == 3
    assert x.new_block_ids[:2] == [0, 1]  # a's first two blocks, kept cached after a finished
    stats = s.kv.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 22, 8)


# --- continuous batching -----------------------------------------------------------------


def test_finished_request_seat_and_blocks_are_reused_next_step():
    s = make_sched(num_blocks=4, block_size=4, max_num_seqs=2)
    a = req(n=4, max_tokens=1)  # block 0
    b = req(n=7, max_tokens=4)  # blocks 1, 2 (room for one more token)
    c = req(n=8, max_tokens=2)
    for r in (a, b, c):
        s.add_request(r)
    out = step(s)
    assert sched_map(out) == {a.request_id: 4, b.request_id: 7}
    assert a.status == RequestStatus.FINISHED_LENGTH  # done after one token
    assert s.kv.num_free_blocks == 2  # a's block came back at once
    out = step(s)
    assert out.finished_request_ids == [a.request_id]
    assert sched_map(out) == {b.request_id: 1, c.request_id: 8}
    # c got the unused block 3, then a's freed block 0 (its cached hash is evicted)
    assert s.kv.get_block_ids(c.request_id) == [3, 0]
    assert s.kv.block_pool.num_evictions == 1


# --- preemption --------------------------------------------------------------------------


def _three_full(policy, priorities=(0, 0, 0), arrivals=(1.0, 2.0, 3.0)):
    s = make_sched(policy, num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    rs = [req(n=8, max_tokens=6, priority=p, arrival=t) for p, t in zip(priorities, arrivals)]
    for r in rs:
        s.add_request(r)
    out = step(s)  # each prefills 8 tokens into 2 blocks: the pool is full
    assert len(out.scheduled) == 3 and s.kv.num_free_blocks == 0
    return s, rs


def test_fcfs_preempts_the_last_to_arrive():
    # Added out of arrival order: the order is the arrival time, not the call order.
    s, (a, b, c) = _three_full(FCFSPolicy(), arrivals=(3.0, 1.0, 2.0))
    out = step(s)  # each needs a third block for its 9th token
    assert out.preempted_request_ids == [a.request_id]
    assert sched_map(out) == {b.request_id: 1, c.request_id: 1}
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert a.output_token_ids == [TOKEN] and a.num_preemptions == 1
    assert s.kv.get_block_ids(a.request_id) == []
    assert list(s.waiting) == [a] and s.num_preemptions == 1


def test_priority_preempts_highest_priority_value_then_latest_arrival():
    s, (a, b, c) = _three_full(PriorityPolicy(), priorities=(0, 2, 1))
    out = step(s)
    assert out.preempted_request_ids == [b.request_id]  # priority 2, although c arrived last
    s2, (a2, b2, c2) = _three_full(PriorityPolicy(), priorities=(1, 1, 0), arrivals=(1.0, 2.0, 3.0))
    out = step(s2)
    assert out.preempted_request_ids == [b2.request_id]  # ties by arrival: the later one


def test_preempted_request_restarts_from_zero_keeps_output_and_finishes():
    s, (a, b, c) = _three_full(FCFSPolicy())
    later = req(n=4, max_tokens=1, arrival=10.0)
    s.add_request(later)
    out = step(s)
    assert out.preempted_request_ids == [c.request_id]
    # c waits ahead of the later arrival: back at its policy place
    assert list(s.waiting) == [c, later]
    readmitted = None
    outs = run_to_completion(s)
    for o in outs:
        for x in o.scheduled:
            if x.request is c and readmitted is None:
                readmitted = x
    # Recompute of prompt + the kept output token; the prompt's cached blocks may be reused.
    assert readmitted.num_computed_tokens + readmitted.num_new_tokens == 9
    assert readmitted.is_sampled
    assert c.status == RequestStatus.FINISHED_LENGTH
    assert c.output_token_ids == [TOKEN] * 6 and c.num_tokens == 14
    assert c.num_cached_tokens == 0  # the hit at first admission
    assert_all_free(s)


def test_preempted_request_rejoins_waiting_at_its_priority_place():
    s, (a, b, c) = _three_full(PriorityPolicy(), priorities=(0, 2, 1))
    worse = req(n=4, max_tokens=1, priority=3, arrival=0.5)
    better = req(n=4, max_tokens=1, priority=1, arrival=9.0)
    s.add_request(worse)
    s.add_request(better)
    out = step(s)
    assert b.request_id in out.preempted_request_ids
    waiting = list(s.waiting)
    assert waiting.index(better) < waiting.index(b) < waiting.index(worse)


def test_running_request_that_cannot_grow_preempts_itself_when_it_is_the_worst():
    # The pool is full; a (first) has room in its last block, b (later) needs a new block and,
    # being the last to arrive, is its own victim.
    s = make_sched(num_blocks=5, block_size=4)
    a = req(n=10, max_tokens=8, arrival=1.0)  # 3 blocks, 2 free slots
    b = req(n=8, max_tokens=8, arrival=2.0)  # 2 full blocks
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert s.kv.num_free_blocks == 0
    out = step(s)
    assert out.preempted_request_ids == [b.request_id]
    assert sched_map(out) == {a.request_id: 1}
    assert b.status == RequestStatus.PREEMPTED and b.output_token_ids == [TOKEN]
    run_to_completion(s)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert_all_free(s)


def test_no_waiting_admission_steals_a_preempted_victims_place():
    """After a preemption the victim is the head of the waiting queue (FCFS), so a later arrival
    that would fit is not admitted before it."""
    s, (a, b, c) = _three_full(FCFSPolicy())
    tiny = req(n=1, max_tokens=1, arrival=99.0)
    s.add_request(tiny)
    out = step(s)
    assert out.preempted_request_ids == [c.request_id]
    assert tiny.request_id not in sched_map(out)


# --- priority displacement and aging -----------------------------------------------------


def test_priority_arrival_displaces_worst_running_when_seats_are_full():
    s = make_sched(PriorityPolicy(), max_num_seqs=2)
    a = req(n=4, max_tokens=10, priority=1, arrival=1.0)
    b = req(n=4, max_tokens=10, priority=1, arrival=2.0)
    s.add_request(a)
    s.add_request(b)
    step(s)
    h = req(n=4, max_tokens=2, priority=0, arrival=3.0)
    s.add_request(h)
    out = step(s)
    assert out.preempted_request_ids == [b.request_id]
    assert sched_map(out) == {a.request_id: 1, h.request_id: 4}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in s.running] == [h.request_id, a.request_id]
    # b comes back when h is done
    run_to_completion(s)
    assert b.num_output_tokens == 10 and b.status == RequestStatus.FINISHED_LENGTH
    assert_all_free(s)


def test_displacement_victim_is_the_worst_running_one():
    s = make_sched(PriorityPolicy(), max_num_seqs=3)
    best = req(n=4, max_tokens=10, priority=0, arrival=1.0)
    worst = req(n=4, max_tokens=10, priority=2, arrival=2.0)
    mid = req(n=4, max_tokens=10, priority=1, arrival=3.0)
    for r in (best, worst, mid):
        s.add_request(r)
    step(s)
    h = req(n=4, max_tokens=2, priority=1, arrival=4.0)  # better than worst only
    s.add_request(h)
    out = step(s)
    assert out.preempted_request_ids == [worst.request_id]
    assert set(sched_map(out)) == {best.request_id, mid.request_id, h.request_id}
    assert [r.request_id for r in s.running] == [best.request_id, mid.request_id, h.request_id]


def test_no_displacement_by_equal_or_worse_priority_or_under_fcfs():
    s = make_sched(PriorityPolicy(), max_num_seqs=2)
    for p in (1, 1):
        s.add_request(req(n=4, max_tokens=10, priority=p))
    step(s)
    s.add_request(req(n=4, max_tokens=2, priority=1))
    s.add_request(req(n=4, max_tokens=2, priority=5))
    out = step(s)
    assert out.preempted_request_ids == [] and len(out.scheduled) == 2

    f = make_sched(FCFSPolicy(), max_num_seqs=2)
    for _ in range(2):
        f.add_request(req(n=4, max_tokens=10))
    step(f)
    f.add_request(req(n=4, max_tokens=2, arrival=-1.0))  # "earlier" arrival, still no displacement
    out = step(f)
    assert out.preempted_request_ids == [] and len(out.scheduled) == 2


def test_priority_arrival_displaces_when_blocks_are_short():
    s = make_sched(PriorityPolicy(), num_blocks=4, block_size=4, max_num_seqs=8)
    low = req(n=12, max_tokens=4, priority=5, arrival=1.0)  # 3 of 4 blocks
    s.add_request(low)
    step(s)
    high = req(n=8, max_tokens=1, priority=0, arrival=2.0)  # needs 2 blocks, 1 free
    s.add_request(high)
    out = step(s)
    assert out.preempted_request_ids == [low.request_id]
    assert sched_map(out) == {high.request_id: 8}


def test_displaced_request_is_not_readmitted_in_the_same_step():
    """Issue 17: 3 blocks of 3 tokens, budget 5. r0 computed its 5-token prompt (2 blocks); r1
    (better priority, 4 tokens = 2 blocks) displaces it. The 1 token of budget left must not
    re-admit r0 from zero in that step: that throws away its 5 computed tokens for 1."""
    s = make_sched(PriorityPolicy(), num_blocks=3, block_size=3, max_num_seqs=4, max_num_batched_tokens=5, max_model_len=9, caching=False)
    r0 = req("r0", n=5, max_tokens=2, priority=1, arrival=0.0)
    s.add_request(r0)
    assert sched_map(step(s)) == {"r0": 5}
    r1 = req("r1", n=4, max_tokens=1, priority=0, arrival=1.0)
    s.add_request(r1)
    out = step(s)
    assert out.preempted_request_ids == ["r0"]
    assert sched_map(out) == {"r1": 4}
    assert r0.status == RequestStatus.PREEMPTED and r0.num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["r0"]
    run_to_completion(s)
    assert r0.num_output_tokens == 2 and r1.num_output_tokens == 1
    assert_all_free(s)


def test_displacement_does_not_preempt_when_the_arrival_fits():
    s = make_sched(PriorityPolicy(), max_num_seqs=4)
    low = req(n=4, max_tokens=4, priority=5)
    s.add_request(low)
    step(s)
    high = req(n=4, max_tokens=1, priority=0)
    s.add_request(high)
    out = step(s)
    assert out.preempted_request_ids == []
    assert sched_map(out) == {low.request_id: 1, high.request_id: 4}


def test_displacement_accounts_for_the_arrivals_prefix_hits():
    """The arrival's cached prefix costs no new blocks: no preemption when the rest fits."""
    s = make_sched(PriorityPolicy(), num_blocks=5, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    shared = req(n=13, max_tokens=1, priority=0, base=300)  # 4 blocks, 3 full ones cached
    s.add_request(shared)
    step(s)
    low = req(n=2, max_tokens=2, priority=5)  # takes block 4 (the front of the queue)
    s.add_request(low)
    step(s)
    assert s.kv.num_free_blocks == 4  # blocks 3, 2, 1, 0; 0-2 still cached
    # 3 cached blocks revived + 1 new one = the 4 free blocks: no need to displace low.
    high = req(tokens=list(range(300, 313)), max_tokens=1, priority=0)
    s.add_request(high)
    out = step(s)
    assert out.preempted_request_ids == []
    assert sched_map(out)[high.request_id] == 1
    assert out.scheduled[-1].num_computed_tokens == 12


def _starvation_run(aging_s: float, steps: int) -> int | None:
    """One low-priority request, then a fresh high-priority one every step; returns the step at
    which the old one is first scheduled (None: never)."""
    s = make_sched(PriorityPolicy(PriorityOptions(aging_s=aging_s)), max_num_seqs=1)
    old = req(n=4, max_tokens=2, priority=10, arrival=0.0)
    s.add_request(old)
    s.add_request(req(n=4, max_tokens=2, priority=0, arrival=0.0))
    for t in range(1, steps + 1):
        s.add_request(req(n=4, max_tokens=2, priority=0, arrival=float(t)))
        out = step(s)
        if old.request_id in sched_map(out):
            return t
    return None


def test_no_starvation_with_aging():
    # aging_s=1: one second of waiting is worth one priority level, so after ~10 s the old
    # request sorts ahead of the newest arrivals.
    t = _starvation_run(aging_s=1.0, steps=200)
    assert t is not None and t <= 40
    assert _starvation_run(aging_s=0.0, steps=200) is None


def test_aging_key_is_static_and_orders_by_effective_priority():
    pol = PriorityPolicy(PriorityOptions(aging_s=2.0))
    old = req(priority=3, arrival=0.0)
    new = req(priority=0, arrival=10.0)
    assert pol.sort_key(old) < pol.sort_key(new)  # 3 + 0 < 0 + 5
    newer = req(priority=0, arrival=4.0)
    assert pol.sort_key(newer) < pol.sort_key(old)  # 0 + 2 < 3
    with pytest.raises(ValueError):
        PriorityOptions(aging_s=-1)


# --- abort -------------------------------------------------------------------------------


def test_abort_waiting_running_mid_prefill_and_preempted():
    s = make_sched(num_blocks=16, block_size=4, max_num_seqs=2, threshold=4)
    a = req(n=12, max_tokens=4)  # mid-prefill after one step
    b = req(n=4, max_tokens=4)  # decoding after one step
    c = req(n=4, max_tokens=4)  # waiting (seats full)
    for r in (a, b, c):
        s.add_request(r)
    out = step(s)
    assert sched_map(out) == {a.request_id: 4, b.request_id: 4}
    assert a.num_computed_tokens == 4 and s.kv.num_free_blocks == 14
    # abort mid-prefill: its block comes back, c takes the seat
    assert s.finish_requests([a.request_id], RequestStatus.FINISHED_ABORTED) == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED and s.kv.num_free_blocks == 15
    out = step(s)
    assert out.finished_request_ids == [a.request_id]
    assert sched_map(out) == {b.request_id: 1, c.request_id: 4}
    # abort a waiting request: nothing held, it just leaves
    d = req(n=4, max_tokens=4)
    s.add_request(d)
    s.finish_requests([d.request_id], RequestStatus.FINISHED_ABORTED)
    assert len(s.waiting) == 0 and d.request_id not in s.requests
    # abort a decoding request between schedule() and update_from_output()
    out = s.schedule()
    assert out.finished_request_ids == [d.request_id]
    s.finish_requests([b.request_id], RequestStatus.FINISHED_ABORTED)
    updated = s.update_from_output(out, {x.request.request_id: TOKEN for x in out.scheduled})
    assert b.request_id not in {o.request_id for o in updated} and b.status == RequestStatus.FINISHED_ABORTED
    s.finish_requests([c.request_id], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert_all_free(s)
    assert s.schedule().finished_request_ids == [b.request_id, c.request_id]
    # unknown and repeated ids are ignored
    assert s.finish_requests(["nope", a.request_id], RequestStatus.FINISHED_ABORTED) == []


def test_abort_preempted_request():
    s, (a, b, c) = _three_full(FCFSPolicy())
    step(s)
    assert c.status == RequestStatus.PREEMPTED
    s.finish_requests([c.request_id], RequestStatus.FINISHED_ABORTED)
    assert c.request_id not in s.requests and len(s.waiting) == 0
    run_to_completion(s)
    assert_all_free(s)


def test_request_id_can_be_reused_after_abort():
    s = make_sched(max_num_seqs=1)
    s.add_request(req(n=4, max_tokens=4))
    old = req("same", n=4, max_tokens=4)
    s.add_request(old)
    s.finish_requests(["same"], RequestStatus.FINISHED_ABORTED)
    new = req("same", n=6, max_tokens=2)
    s.add_request(new)
    run_to_completion(s)
    assert old.num_output_tokens == 0 and old.status == RequestStatus.FINISHED_ABORTED
    assert new.num_output_tokens == 2 and new.status == RequestStatus.FINISHED_LENGTH
    assert_all_free(s)


# --- admission checks --------------------------------------------------------------------


def test_rejects_prompt_plus_max_tokens_over_max_model_len():
    s = make_sched(max_model_len=32)
    ok = req(n=8, max_tokens=4)
    s.add_request(ok)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(req(n=30, max_tokens=5))
    msg = str(e.value)
    assert "max_model_len (32)" in msg and "30" in msg and "35" in msg and "max_tokens (5)" in msg
    s.add_request(req(n=28, max_tokens=4))  # exactly max_model_len is fine
    run_to_completion(s)
    assert ok.status == RequestStatus.FINISHED_LENGTH
    assert_all_free(s)


def test_rejects_a_request_that_could_never_fit_in_the_cache():
    s = make_sched(num_blocks=4, block_size=4, max_model_len=1024)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(req(n=14, max_tokens=4))
    msg = str(e.value)
    assert "4 blocks" in msg and "16 tokens" in msg and "18" in msg and "KV cache" in msg
    ok = req(n=12, max_tokens=4)  # 16 tokens: fits exactly
    s.add_request(ok)
    run_to_completion(s)
    assert ok.num_output_tokens == 4
    assert_all_free(s)


def test_rejects_empty_prompt_and_duplicate_id():
    s = make_sched()
    with pytest.raises(InvalidRequestError, match="prompt"):
        s.add_request(req(tokens=[]))
    r = req("dup", n=4)
    s.add_request(r)
    with pytest.raises(InvalidRequestError, match="dup"):
        s.add_request(req("dup", n=4))
    assert s.requests == {"dup": r}


# --- stop conditions ---------------------------------------------------------------------


def _generate(tokens, **params):
    s = make_sched()
    r = req(n=4, **params)
    s.add_request(r)
    it = iter(tokens)
    while s.has_unfinished_requests():
        step(s, next(it))
    assert_all_free(s)
    return r


def test_stop_at_max_tokens():
    r = _generate([TOKEN] * 10, max_tokens=3)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.status.finish_reason == "length"
    assert r.output_token_ids == [TOKEN] * 3


def test_stop_at_eos_unless_ignore_eos():
    r = _generate([5, EOS, 5, 5], max_tokens=4)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5, EOS]
    r = _generate([5, EOS, 5, 5], max_tokens=4, ignore_eos=True)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [5, EOS, 5, 5]


def test_stop_token_ids_even_with_ignore_eos():
    r = _generate([5, 9, 5], max_tokens=8, stop_token_ids=[9], ignore_eos=True)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5, 9]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    r = _generate([EOS, 9, EOS, 5], max_tokens=8, min_tokens=3, stop_token_ids=[9])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [EOS, 9, EOS]
    r = _generate([EOS, EOS, 5], max_tokens=3, min_tokens=3)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [EOS, EOS, 5]


def test_stop_at_max_model_len():
    s = make_sched(max_model_len=8)
    r = req(n=5, max_tokens=3)  # exactly max_model_len
    s.add_request(r)
    r.max_tokens = 10  # as if resolved past the limit: max_model_len still stops it
    run_to_completion(s)
    assert r.num_tokens == 8 and r.num_output_tokens == 3 and r.status == RequestStatus.FINISHED_LENGTH


def test_token_for_a_request_still_in_prefill_is_ignored():
    s = make_sched(threshold=4)
    r = req(n=10, max_tokens=2)
    s.add_request(r)
    out = s.schedule()
    assert not out.scheduled[0].is_sampled
    assert s.update_from_output(out, {r.request_id: TOKEN}) == []
    assert r.output_token_ids == [] and r.num_tokens == 10
