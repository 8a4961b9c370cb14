"""``cache-aware``: the longest cached prefix first, within a bounded window.

SGLang's "longest prefix match" (lpm) order (Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", 2024) admits first the waiting requests whose prompt has the
longest prefix already in the KV cache: requests sharing a prefix run while it is cached instead of
being interleaved with others that evict it, which raises the prefix-cache hit rate when the cache
cannot hold every prefix at once. Pure lpm starves requests whose prefix is not cached. Here a
request may move ahead of its first-come-first-served place by at most ``window_s`` seconds of
arrival, in proportion to the cached share of its prompt: the key is ``arrival_time - window_s *
cached / prompt``. So a request is only ever overtaken by requests that arrived less than
``window_s`` after it: no starvation, and ``window_s = 0`` is FCFS.

The cached length is the scheduler's prefix lookup, refreshed before each re-key
(``uses_prefix_hits``) for the ``window_requests`` oldest waiting requests only (one group in
arrival order, ``waiting_window``): a long queue costs that many lookups a step, not one per
waiting request, and the requests behind them wait their FCFS turn (SGLang likewise drops lpm
for FCFS past 128 waiting requests).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from paged.core.policy import BasePolicy, RequestView


class CacheAwareOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    window_s: float = Field(
        5.0, ge=0.0, description="seconds of arrival a fully cached request may move ahead (0 = FCFS)"
    )
    window_requests: int = Field(
        128, ge=1, description="oldest waiting requests whose cached prefix is looked up each step"
    )


class CacheAwarePolicy(BasePolicy):
    """Arrival time minus a bonus for the cached share of the prompt, ties by arrival."""

    name = "cache-aware"
    dynamic = True
    uses_prefix_hits = True

    def __init__(self, options: CacheAwareOptions | None = None) -> None:
        super().__init__(options or CacheAwareOptions())
        self.waiting_window = self.options.window_requests

    def sort_key(self, request: RequestView, now: float) -> tuple:
        cached_share = min(request.prefix_hit_tokens / request.num_prompt_tokens, 1.0)
        return (request.arrival_time - self.options.window_s * cached_share, request.arrival_time)

    def waiting_group(self, request: RequestView) -> tuple[None, tuple]:
        return None, (request.arrival_time,)
