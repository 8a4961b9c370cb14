"""What the scheduler hands a policy once per step: the state its budget split decides on, and
the step's stats for ``on_step`` (paged.core.policy). Kept apart so that scheduler.py holds the
mechanism; the scheduler passes in every value these read (nothing here imports it or reads its
fields)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from paged.core.policy import BudgetSplit, BudgetState, StepStats

if TYPE_CHECKING:
    from paged.core.engine.kv_cache_manager import KVCacheManager
    from paged.core.engine.request import Request


class ScheduledTokens(Protocol):
    """One request's share of a step (the scheduler's ``ScheduledRequest``)."""

    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int


def budget_split(
    split_budget: Callable[[BudgetState], BudgetSplit | None] | None,
    now: float,
    running: Sequence[Request],
    num_waiting: int,
    kv: KVCacheManager,
    token_budget: int,
    threshold: int,
) -> tuple[int | None, int]:
    """(prefill token cap or None, chunk cap or 0) for this step: ``split_budget``'s answer
    (the policy's method; None when it has none or the split does not apply), clamped so that
    prefill always gets at least one token (liveness) and no chunk exceeds ``threshold``
    (long_prefill_token_threshold, 0 = none)."""
    if split_budget is None:
        return None, threshold
    num_decoding = sum(1 for r in running if r.num_computed_tokens >= r.num_prompt_tokens)
    state = BudgetState(now, token_budget, len(running), num_waiting, num_decoding, kv.num_free_blocks / max(kv.num_blocks, 1))
    split = split_budget(state)
    if split is None:
        return None, threshold
    prefill = split.prefill_tokens
    if prefill is not None:
        prefill = max(1, min(int(prefill), token_budget))
    chunk = threshold
    if split.chunk_tokens is not None:  # the operator's threshold stays an upper bound
        chunk = max(1, int(split.chunk_tokens))
        chunk = min(chunk, threshold) if threshold else chunk
    return prefill, chunk


def step_stats(
    scheduled: Sequence[ScheduledTokens],
    *,
    now: float,
    token_budget: int,
    num_running: int,
    num_waiting: int,
    num_preempted: int,
    num_deferred: int,
    num_rejected: int,
    kv_usage: float,
) -> StepStats:
    """``StepStats`` for the step that scheduled ``scheduled``: each request as (view, prefill
    tokens, decode tokens); a decode is one new token past the prompt."""
    views = []
    num_prefill = num_decode = 0
    for s in scheduled:
        request = s.request
        if s.num_new_tokens == 1 and s.num_computed_tokens >= request.num_prompt_tokens:
            views.append((request.view, 0, 1))
            num_decode += 1
        else:
            views.append((request.view, s.num_new_tokens, 0))
            num_prefill += s.num_new_tokens
    return StepStats(now, token_budget, num_running, num_waiting, num_prefill, num_decode, num_preempted, num_deferred,
                     num_rejected, kv_usage, tuple(views))
