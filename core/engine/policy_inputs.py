"""What the scheduler hands a policy once per step: the state its budget split decides on, and
the step's stats for ``on_step`` (paged.core.policy). Functions of the scheduler, kept apart so
that scheduler.py holds the mechanism."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged.core.policy import BudgetState, StepStats

if TYPE_CHECKING:
    from paged.core.engine.scheduler import Scheduler, SchedulerOutput


def budget_split(scheduler: "Scheduler", now: float) -> tuple[int | None, int]:
    """(prefill token cap or None, chunk cap or 0) for this step: the policy's split, clamped
    so that prefill always gets at least one token (liveness) and no chunk exceeds
    long_prefill_token_threshold."""
    threshold = scheduler.long_prefill_token_threshold
    if scheduler._split_budget is None or not scheduler.enable_chunked_prefill:
        return None, threshold
    num_decoding = sum(1 for r in scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens)
    state = BudgetState(now, scheduler.max_num_batched_tokens, len(scheduler.running), len(scheduler.waiting), num_decoding,
                        scheduler.kv.num_free_blocks / max(scheduler.kv.num_blocks, 1))
    split = scheduler._split_budget(state)
    if split is None:
        return None, threshold
    prefill = split.prefill_tokens
    if prefill is not None:
        prefill = max(1, min(int(prefill), scheduler.max_num_batched_tokens))
    chunk = threshold
    if split.chunk_tokens is not None:  # the operator's threshold stays an upper bound
        chunk = max(1, int(split.chunk_tokens))
        chunk = min(chunk, threshold) if threshold else chunk
    return prefill, chunk


def step_stats(scheduler: "Scheduler", output: "SchedulerOutput", now: float, num_deferred: int) -> StepStats:
    scheduled = []
    num_prefill = num_decode = 0
    for s in output.scheduled:
        request = s.request
        if s.num_new_tokens == 1 and s.num_computed_tokens >= request.num_prompt_tokens:
            scheduled.append((request.view, 0, 1))
            num_decode += 1
        else:
            scheduled.append((request.view, s.num_new_tokens, 0))
            num_prefill += s.num_new_tokens
    return StepStats(now, scheduler.max_num_batched_tokens, len(scheduler.running), len(scheduler.waiting), num_prefill, num_decode,
                     len(output.preempted_request_ids), num_deferred, len(output.rejected),
                     scheduler.kv.usage, tuple(scheduled))
