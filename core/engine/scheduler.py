"""The step mechanism: who runs this step, with how many tokens, in which blocks.

One ``schedule()`` per engine step:

0. *Policy state* (paged.core.policy): a dynamic policy's keys are recomputed (the running list
   re-sorted; the waiting queue re-keyed when admission or displacement may happen: all of it,
   or with ``waiting_group`` only each group's first ``waiting_window``), and the policy's
   budget split for the step is read.
1. *Displacement* (policies with ``displaces_running``): while the best waiting request sorts
   before the policy's victim among the running ones and cannot be admitted (batch full at
   ``max_num_seqs``, or too few free blocks), preempt that victim.
2. *Running requests*, in policy order: each gets ``min(remaining, budget left, chunk cap)``
   tokens (1 for a decode); prefill chunks together take at most the split's prefill share.
   When its blocks cannot be allocated, the policy picks a victim among the requests not yet
   scheduled this step (itself included) and that victim is preempted, until the allocation succeeds or the request preempted itself.
3. *Waiting requests*, in policy order, while budget, ``max_num_seqs`` and blocks allow; a
   prefix-cache hit skips the cached tokens. A request's first admission asks the policy's
   ``admit``: a deferred request waits (the next one tries), a rejected one finishes as
   "rejected". Admission stops at the first that does not fit, or at one displaced in step 1 (it
   would recompute from zero what it had just computed). With LoRA (``max_loras``), a request
   whose adapter would make the running requests use more than ``max_loras`` adapters is passed
   over (it waits; the requests behind it may run), so that a step fits the layers' slots.
4. The policy's ``on_step`` gets the step's stats.

A policy that raises for one request (``sort_key``, ``admit``) ends that request with finish
reason "error" and a message naming the policy, its method and the exception; the others go on
(``paged.core.engine.plugin_faults``). What it raises elsewhere leaves ``schedule`` (the engine
core stops with the message).

Preemption is by recompute: the victim frees its blocks, goes back to zero computed tokens and
returns to the waiting queue at its policy position (prefix caching makes the recompute cheap).
``num_computed_tokens`` is advanced when a request is scheduled; ``update_from_output`` appends the
sampled tokens, applies stop conditions and frees finished requests' blocks at once.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

from paged.core.errors import ConfigError, EngineError, InvalidRequestError, RequestRejectedError
from paged.core.engine.kv_cache_manager import KVCacheManager
from paged.core.engine.outputs import EngineCoreOutput, TokenLogprobs
from paged.core.engine.plugin_faults import PluginCode, describe, log_fault, plugin_code
from paged.core.engine.policy_inputs import budget_split, step_stats
from paged.core.engine.request import Request, RequestStatus
from paged.core.engine.waiting_queue import GroupedWaitingQueue, WaitingQueue
from paged.core.policy import MAX_DEFERRALS_PER_STEP, Admission, SchedulingPolicy, overrides
from paged.core.utils import cdiv

logger = logging.getLogger("paged")

MAX_LORA_SKIPS_PER_STEP = 64  # waiting requests passed over for their adapter in one step, at most


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    new_block_ids: list[int]
    # Speculative decoding: the draft tokens verified this step, fed after the request's last
    # known token (num_new_tokens counts them too).
    spec_token_ids: list[int]
    # Whether this step completes the request's known tokens, so a token is sampled. Fixed when
    # scheduled: update_from_output appends the sampled token, which would change the answer.
    is_sampled: bool = field(init=False)

    def __init__(self, request: Request, num_computed_tokens: int, num_new_tokens: int, new_block_ids: list[int],
                 spec_token_ids: list[int] = ()):
        # Written out (the dataclass keeps it) rather than __post_init__: one call less, made
        # for every scheduled request at every step.
        self.request = request
        self.num_computed_tokens = num_computed_tokens
        self.num_new_tokens = num_new_tokens
        self.new_block_ids = new_block_ids
        self.spec_token_ids = spec_token_ids
        self.is_sampled = num_computed_tokens + num_new_tokens - len(spec_token_ids) == request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)  # turned away by the policy this step
    failed: list[Request] = field(default_factory=list)  # ended this step by a plugin's failure (``error``)
    finished_request_ids: list[str] = field(default_factory=list)  # since the previous step

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled




class Scheduler:
    def __init__(
        self,
        policy: SchedulingPolicy,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
        enable_chunked_prefill: bool = True,
        clock=time.monotonic,
    ) -> None:
        self.policy = policy
        # Names the policy in failure messages (the engine core sets the plugin that registered it).
        self.policy_code: PluginCode = plugin_code("policy", getattr(policy, "name", type(policy).__name__), None, policy)
        self._failed: list[Request] = []  # requests a policy call failed on, to end at the next safe point
        self.grammar_code: PluginCode | None = None  # the structured-output backend (set by the engine core)
        # Every timestamp the scheduler takes and every ``now`` a policy gets (the lab's simulator
        # sets its virtual clock here).
        self.clock = clock
        self._dynamic = bool(getattr(policy, "dynamic", False))
        self._dynamic_waiting = self._dynamic and bool(getattr(policy, "dynamic_waiting", True))
        self._uses_prefix_hits = bool(getattr(policy, "uses_prefix_hits", False))
        self._admit = policy.admit if overrides(policy, "admit") else None
        self._split_budget = policy.split_budget if overrides(policy, "split_budget") else None
        self._on_step = policy.on_step if overrides(policy, "on_step") else None
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.enable_chunked_prefill = enable_chunked_prefill
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"scheduler.max_num_batched_tokens: {max_num_batched_tokens} is below max_model_len "
                f"({max_model_len}); without chunked prefill it must be >= max_model_len"
            )
        if not enable_chunked_prefill and long_prefill_token_threshold:
            # A capped prompt could never be admitted whole: it would wait forever.
            raise ConfigError(
                f"scheduler.long_prefill_token_threshold: {long_prefill_token_threshold} caps prefill chunks; "
                f"it needs enable_chunked_prefill (or 0)"
            )
        self.requests: dict[str, Request] = {}
        if self._dynamic_waiting and overrides(policy, "waiting_group"):
            group_of = policy.waiting_group
            self.waiting = GroupedWaitingQueue(lambda r: group_of(r.view), getattr(policy, "waiting_window", 1))
        else:
            self.waiting = WaitingQueue()
        self.running: list[Request] = []  # in policy order (sorted by sort_key)
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.speculator = None  # speculative decoding (spec_decode.Speculator), set by the engine core
        # LoRA (lora.max_loras, set by the engine core when adapters are enabled): the running
        # requests use at most this many distinct adapters, so that one step fits the layers' slots
        self.max_loras: int | None = None

    # --- requests in and out -----------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject what could never run. Raises InvalidRequestError naming the limit."""
        check_request_fits(num_prompt_tokens, max_tokens, self.max_model_len, self.kv.num_blocks, self.block_size,
                           self.kv.sliding_window, self.max_num_batched_tokens)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request_id: {request.request_id!r} is already in use")
        self.check_request(request.num_prompt_tokens, request.max_tokens)
        request.status = RequestStatus.WAITING
        now = self.clock()
        method = "admit"
        try:
            if self._admit is not None:
                decision = self._admit(request.view, now)
                if isinstance(decision, Admission) and decision.decision == "reject":
                    raise RequestRejectedError(decision.reason or "rejected by the scheduling policy", decision.http_status)
            method = "sort_key"
            request.sort_key = self._key(request, now)
        except (RequestRejectedError, EngineError):
            raise
        except Exception as e:  # the policy failed on this request: it is refused, the others go on
            message = describe(e, [self.policy_code], self.policy_code, method)
            log_fault(message, e, request_id=request.request_id)
            raise EngineError(message) from None
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string): frees their blocks now."""
        assert status.finished
        out = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            out.append(request)
        return out

    def _policy_failed(self, request: Request, error: Exception, method: str) -> None:
        """Record that the policy raised for ``request``; it ends at the next safe point."""
        request.error = describe(error, [self.policy_code], self.policy_code, method)
        log_fault(request.error, error, request_id=request.request_id)
        self._failed.append(request)

    def _end_failed(self, output: SchedulerOutput) -> None:
        """End the requests a policy call failed on (finish reason "error"), freeing their blocks."""
        for request in self._failed:
            if request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ERROR
            self._free(request)
            output.failed.append(request)
        self._failed = []

    def _key(self, request: Request, now: float) -> tuple:
        if self._dynamic:
            return self.policy.sort_key(request.view, now)
        return self.policy.sort_key(request.view)

    def _victim(self, candidates: list[Request]) -> Request:
        """The policy's victim among ``candidates``; the largest key if it names another."""
        chosen = self.policy.select_victim([r.view for r in candidates])
        for request in candidates:  # each request has one view: found by identity
            if request.view is chosen or request is chosen:
                return request
        return max(reversed(candidates), key=_sort_key)

    def _stop_running(self, request: Request, now: float) -> None:
        if request.running_since is not None:
            request.running_s += now - request.running_since
            request.running_since = None

    def _free(self, request: Request) -> None:
        request.finished_time = now = self.clock()
        self._stop_running(request, now)
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _grammar_accepts(self, request: Request, token: int) -> bool:
        """Advance ``request``'s matcher by ``token``; False (``request.error`` says why) when
        the grammar refuses it or raises. A terminated grammar accepts anything (EOS ends it)."""
        grammar, code = request.grammar, self.grammar_code
        try:
            if grammar.is_terminated() or grammar.accept_token(token):
                return True
            request.error = (
                f"structured output: the constraint allows no continuation after {request.num_output_tokens} "
                f"tokens (the grammar refused token {token}, which its own mask let through); a constraint "
                f"that no string satisfies, or a fault of {code.label if code else 'the grammar backend'}"
            )
            logger.error("request %s: %s", request.request_id, request.error)
        except Exception as e:
            request.error = describe(e, [code], code, "accept_token")
            log_fault(request.error, e, request_id=request.request_id)
        return False

    # --- the step ----------------------------------------------------------------------
    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        now = self.clock()
        self._stop_running(request, now)
        if self._dynamic and not self._dynamic_waiting:
            request.sort_key = self._key(request, now)  # its place in the queue from now on
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)  # same sort_key: back at its place in the order
        output.preempted_request_ids.append(request.request_id)

    def _chunk(self, request: Request, budget: int, num_computed: int, cap: int | None = None) -> int:
        """Tokens to schedule for ``request`` after its first ``num_computed`` tokens."""
        n = min(request.num_tokens - num_computed, budget)
        cap = self.long_prefill_token_threshold if cap is None else cap
        if cap:
            n = min(n, cap)
        return n

    def _reject(self, request: Request, decision: Admission, output: SchedulerOutput) -> None:
        request.status = RequestStatus.FINISHED_REJECTED
        request.reject_reason = decision.reason or "rejected by the scheduling policy"
        self._free(request)
        output.rejected.append(request)

    def _rekey_waiting(self, now: float) -> None:
        key = self.policy.sort_key
        lookup = self.kv.get_computed_blocks if self._uses_prefix_hits else None

        def safe_key(request: Request) -> tuple:
            try:
                if lookup is not None:
                    request.prefix_hit_tokens = lookup(request, record_stats=False)[1]
                return key(request.view, now)
            except Exception as e:
                self._policy_failed(request, e, "sort_key")
                return request.sort_key  # keeps the queue ordered until the request is ended

        self.waiting.rekey(safe_key)

    def _displace(self, output: SchedulerOutput) -> None:
        while self.running:
            head = self.waiting.peek()
            # The running list is in policy order: a head that does not sort before its last
            # request sorts before no victim (the common case, checked in O(1)).
            if head is None or not head.sort_key < self.running[-1].sort_key:
                return
            victim = self._victim(self.running)
            if not head.sort_key < victim.sort_key:
                return
            if len(self.running) < self.max_num_seqs:
                blocks, num_cached = self.kv.get_computed_blocks(head, record_stats=False)
                chunk = self._chunk(head, self.max_num_batched_tokens, num_cached)
                if self.kv.num_blocks_to_allocate(head, chunk, blocks) <= self.kv.num_free_blocks:
                    return  # it fits without displacing anyone
            self._preempt(victim, output)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        now = self.clock()
        rekeyed = False
        if self._dynamic:
            key = self.policy.sort_key
            for request in self.running:
                try:
                    request.sort_key = key(request.view, now)
                except Exception as e:
                    self._policy_failed(request, e, "sort_key")
            if self._failed:
                self._end_failed(output)
            self.running.sort(key=_sort_key)
        if self.policy.displaces_running:
            if self._dynamic_waiting:
                self._rekey_waiting(now)
                rekeyed = True
                if self._failed:
                    self._end_failed(output)
            self._displace(output)
        num_displaced = len(output.preempted_request_ids)
        budget = self.max_num_batched_tokens
        # Without chunked prefill a prompt is admitted whole: the policy's split does not apply.
        split_budget = self._split_budget if self.enable_chunked_prefill else None
        prefill_left, threshold = budget_split(
            split_budget, now, self.running, len(self.waiting), self.kv, self.max_num_batched_tokens,
            self.long_prefill_token_threshold,
        )

        # Running requests, in order; victims come from those not yet scheduled (index >= i).
        scheduled = output.scheduled
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # _chunk, inlined: this loop runs for every running request at every step.
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = ()
            if num_new > 1:  # a prefill chunk: capped by the chunk size and the prefill share
                if threshold and num_new > threshold:
                    num_new = threshold
                if prefill_left is not None and num_new > prefill_left:
                    num_new = prefill_left
            elif request.spec_token_ids:  # a decode with drafts to verify (as many as the budget allows)
                drafts = request.spec_token_ids
                request.spec_token_ids = []
                if len(drafts) >= budget:
                    drafts = drafts[: budget - 1]
                num_new = 1 + len(drafts)
            if num_new <= 0:  # waiting for tokens that another step produces, or no prefill share left
                i += 1
                continue
            while True:
                new_blocks = self.kv.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                if drafts:  # too few blocks for the lookahead: decode without it before preempting anyone
                    drafts, num_new = (), 1
                    continue
                victim = self._victim(self.running[i:])
                self._preempt(victim, output)
                if victim is request:
                    break
            if new_blocks is None:
                continue  # it preempted itself; running[i] is now the next request
            new_block_ids = [b.block_id for b in new_blocks] if new_blocks else []  # mostly empty
            scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new, new_block_ids, drafts))
            request.num_computed_tokens += num_new
            request.num_service_tokens += num_new
            budget -= num_new
            if prefill_left is not None and num_new > 1:
                prefill_left -= num_new
            i += 1

        # Waiting requests, while budget, seats and blocks allow; none after a preemption in the
        # running loop (blocks are short: admitting now would only preempt again), and none from a
        # request displaced this step on (re-admitting it would throw away the tokens it had
        # computed for a chunk of the same or fewer; what sorts after it must not overtake it).
        preempted_in_running_loop = len(output.preempted_request_ids) > num_displaced
        can_admit = budget > 0 and len(self.running) < self.max_num_seqs and not preempted_in_running_loop
        if can_admit and self._dynamic_waiting and not rekeyed and len(self.waiting):
            self._rekey_waiting(now)
        if self._failed:
            self._end_failed(output)
        deferred: list[Request] = []
        # LoRA: requests whose adapter would be one too many now wait (others pass them, as in vLLM)
        lora_ids = {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else None
        passed_over: list[Request] = []
        displaced = output.preempted_request_ids[:num_displaced]
        while budget > 0 and len(self.running) < self.max_num_seqs and not preempted_in_running_loop:
            if prefill_left is not None and prefill_left <= 0:
                break
            request = self.waiting.peek()
            if request is None or (displaced and request.request_id in displaced):
                break
            if request.error:  # its key failed when it became a candidate just now
                self._end_failed(output)
                continue
            if (lora_ids is not None and request.lora_int_id and request.lora_int_id not in lora_ids
                    and len(lora_ids) >= self.max_loras):
                passed_over.append(self.waiting.pop())
                if len(passed_over) >= MAX_LORA_SKIPS_PER_STEP:
                    break
                continue
            if self._admit is not None and request.first_scheduled_time is None:
                try:
                    decision = self._admit(request.view, now)
                except Exception as e:
                    self._policy_failed(request, e, "admit")
                    self._end_failed(output)
                    continue
                if isinstance(decision, Admission) and decision.decision == "reject":
                    self.waiting.pop()
                    self._reject(request, decision, output)
                    continue
                if isinstance(decision, Admission) and decision.decision == "defer":
                    deferred.append(self.waiting.pop())
                    if len(deferred) >= MAX_DEFERRALS_PER_STEP:
                        break
                    continue
            # allocate_slots counts the hits on top of num_computed_tokens, which stays 0 until
            # the request is admitted.
            computed_blocks, num_cached = self.kv.get_computed_blocks(request, record_stats=False)
            step_budget = budget if prefill_left is None else min(budget, prefill_left)
            num_new = self._chunk(request, step_budget, num_cached, threshold)
            if not self.enable_chunked_prefill and num_new < request.num_tokens - num_cached:
                break
            new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks)
            if new_blocks is None:
                break
            self.waiting.pop()
            self.kv.record_prefix_lookup(request.num_tokens, num_cached)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            request.running_since = now
            if lora_ids is not None and request.lora_int_id:
                lora_ids.add(request.lora_int_id)
            bisect.insort(self.running, request, key=_sort_key)
            output.scheduled.append(  # its whole table: hits out of a sliding window are placeholders there
                ScheduledRequest(request, num_cached, num_new, self.kv.get_block_ids(request.request_id))
            )
            request.num_computed_tokens = num_cached + num_new
            request.num_service_tokens += num_new
            budget -= num_new
            if prefill_left is not None:
                prefill_left -= num_new
        for request in deferred + passed_over:
            self.waiting.push(request)
        if self._failed:
            self._end_failed(output)
        if self._on_step is not None:
            self._on_step(step_stats(
                output.scheduled, now=now, token_budget=self.max_num_batched_tokens, num_running=len(self.running),
                num_waiting=len(self.waiting), num_preempted=len(output.preempted_request_ids),
                num_deferred=len(deferred), num_rejected=len(output.rejected), kv_usage=self.kv.usage,
            ))
        return output

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int], logprobs: dict[str, TokenLogprobs] | None = None,
        spec_outputs: dict[str, tuple[list[int], list[TokenLogprobs] | None]] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None, pooled: dict[str, bytes] | None = None,
    ) -> list[EngineCoreOutput]:
        """Advance each constrained request's grammar by its sampled token, append the token,
        apply stop conditions, free finished requests: every finish decision of a step is here.
        Returns the step's outputs: one per request that received a token (finished ones
        included), with its ``logprobs`` entry when there is one. A request that verified drafts
        gets its accepted tokens from ``spec_outputs`` (``_append_accepted``). ``prompt_logprobs``:
        the step's new prompt-logprob entries, appended to their requests; all of a request's go
        out with its first token. ``pooled``: the pooling requests whose prompt was computed, each
        finished with its vector as its output (``pooled``)."""
        updated = []
        now = self.clock()
        running = RequestStatus.RUNNING
        if prompt_logprobs:
            for scheduled in output.scheduled:
                entries = prompt_logprobs.get(scheduled.request.request_id)
                if entries:
                    scheduled.request.prompt_logprobs.extend(entries)
        for scheduled in output.scheduled:
            if not scheduled.is_sampled:  # still in prefill: no token, whatever the runner sent
                continue
            request = scheduled.request
            if request.pooling_params is not None:
                vector = pooled.get(request.request_id) if pooled else None
                if vector is None or request.status is not running:
                    continue
                self.running.remove(request)
                request.status = RequestStatus.FINISHED_STOPPED
                request.first_token_time = request.first_token_time or now
                self._free(request)
                out = EngineCoreOutput.ended(request)
                out.pooled = vector
                updated.append(out)
                continue
            if scheduled.spec_token_ids:
                if request.status is running and spec_outputs and request.request_id in spec_outputs:
                    updated.append(self._append_accepted(scheduled, *spec_outputs[request.request_id], now))
                continue
            token = sampled_token_ids.get(request.request_id)
            # Skip one aborted since it was scheduled (a request in the output is RUNNING
            # otherwise: nothing preempts it before the next step).
            if token is None or request.status is not running:
                continue
            if request.error or request.grammar is not None and not self._grammar_accepts(request, token):
                # Its grammar refused the token or failed (now, or filling its mask): the
                # token is not appended; the request ends with the error.
                self.running.remove(request)
                request.status = RequestStatus.FINISHED_ERROR
                self._free(request)
                updated.append(EngineCoreOutput.ended(request))
                continue
            request.append_output_token(token)
            if request.first_token_time is None:
                request.first_token_time = now
            status = request.check_stop(self.max_model_len)
            if status is not None:
                self.running.remove(request)
                request.status = status
                self._free(request)
            out = EngineCoreOutput.of(request, logprobs.get(request.request_id) if logprobs else None)
            if request.prompt_logprobs is not None and len(request.output_token_ids) == 1:
                out.prompt_logprobs = request.prompt_logprobs
            updated.append(out)
        return updated


    def _append_accepted(self, scheduled: ScheduledRequest, tokens: list[int], logprobs: list[TokenLogprobs] | None,
                         now: float) -> EngineCoreOutput:
        """Roll ``num_computed_tokens`` back past the rejected drafts (their slots are rewritten
        before anything reads them; they were never hashed), then append the accepted tokens
        one at a time, each advancing the grammar and checked for a stop as a token of a plain
        step is."""
        request = scheduled.request
        num_drafts = len(scheduled.spec_token_ids)
        num_accepted = len(tokens) - 1
        request.num_computed_tokens -= num_drafts - num_accepted
        if self.speculator is not None:
            self.speculator.record(request, num_drafts, num_accepted)
        appended = 0
        status = None
        for token in tokens:
            if request.error or request.grammar is not None and not self._grammar_accepts(request, token):
                status = RequestStatus.FINISHED_ERROR  # as in a plain step: the token is not appended
                break
            request.append_output_token(token)
            appended += 1
            status = request.check_stop(self.max_model_len)
            if status is not None:
                break
        if appended and request.first_token_time is None:
            request.first_token_time = now
        if status is not None:
            self.running.remove(request)
            request.status = status
            self._free(request)
        if not appended:  # its grammar failed at the first token
            return EngineCoreOutput.ended(request)
        out = EngineCoreOutput.of(request, None)
        if request.error:
            out.error = request.error
        if appended > 1:
            out.new_token_ids = request.output_token_ids[-appended:]
        if logprobs is not None:
            out.logprobs = logprobs[:appended]
        return out


def check_request_fits(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, num_blocks: int, block_size: int,
    sliding_window: int | None = None, max_chunk_tokens: int = 0,
) -> None:
    """A request must fit max_model_len and, alone, the whole KV cache (front-ends call this
    too, to reject early). With ``sliding_window`` (every layer windowed: the KV manager frees
    what fell out of it) and ``max_chunk_tokens`` (the largest step, the token budget) a
    request needs only the blocks of its window and one chunk (``blocks_needed_alone``)."""
    if num_prompt_tokens < 1:
        raise InvalidRequestError("prompt: must have at least one token")
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"max_model_len ({max_model_len}); shorten the prompt or lower max_tokens"
        )
    needed = blocks_needed_alone(total, block_size, sliding_window, max_chunk_tokens)
    if needed > num_blocks:
        held = (f" (the {sliding_window}-token sliding window and a {max_chunk_tokens}-token chunk need "
                f"{needed} blocks)" if needed < cdiv(total, block_size) else "")
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} can never fit in "
            f"the KV cache ({num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens){held}; "
            f"raise cache.kv_cache_memory_gib or lower max_tokens"
        )


def blocks_needed_alone(num_tokens: int, block_size: int, sliding_window: int | None = None,
                        max_chunk_tokens: int = 0) -> int:
    """The most blocks a request of ``num_tokens`` ever holds at once when it runs alone. Without
    a window: all of them. With one, a step of C tokens from position p reads positions
    p - W + 1 .. p + C - 1 and the blocks before that window are freed first: W - 1 + C
    positions, which straddle at most cdiv(W - 1 + C, block_size) + 1 blocks."""
    full = cdiv(num_tokens, block_size)
    if sliding_window is None or max_chunk_tokens <= 0:
        return full
    return min(full, cdiv(sliding_window - 1 + max_chunk_tokens, block_size) + 1)


def _sort_key(request: Request) -> tuple:
    return request.sort_key
