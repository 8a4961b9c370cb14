"""``srpt``: shortest remaining processing time first, with aging.

SRPT minimizes mean response time on a single server (Schrage 1968); for LLM serving the
processing a request still needs is its prefill not yet computed plus the output it has not yet
generated, which is not known in advance: the expected output is ``max_tokens`` (or the
``expected_output_tokens`` option, when the deployment knows its typical length better than the
clients' limits). Pure SRPT starves long requests under load; aging takes ``aging_tokens_per_s``
tokens off a request's remaining work for every second since its arrival, so every request
eventually sorts first. The key changes as a request runs: a dynamic key. Aging is uniform, so
``work - rate * (now - arrival)`` orders like ``work + rate * arrival``: waiting requests keep
their relative order while they wait and only the running ones are re-keyed each step
(``dynamic_waiting = False``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from paged.core.policy import BasePolicy, RequestView


class SRPTOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expected_output_tokens: int | None = Field(
        None, ge=1, description="expected output length (capped by max_tokens); default: max_tokens"
    )
    aging_tokens_per_s: float = Field(
        0.0, ge=0.0, description="tokens of remaining work forgiven per second since arrival (0 = no aging)"
    )
    preemptive: bool = Field(False, description="a shorter waiting request may preempt a longer running one")


class SRPTPolicy(BasePolicy):
    """Lower remaining work first (prefill left + expected output left - aging), ties by arrival."""

    name = "srpt"
    dynamic = True
    dynamic_waiting = False

    def __init__(self, options: SRPTOptions | None = None) -> None:
        super().__init__(options or SRPTOptions())
        self.displaces_running = self.options.preemptive

    def remaining_tokens(self, request: RequestView) -> int:
        expected = request.max_tokens
        if self.options.expected_output_tokens is not None:
            expected = min(expected, self.options.expected_output_tokens)
        prefill_left = max(request.num_prompt_tokens - request.num_computed_tokens, 0)
        return prefill_left + max(expected - request.num_output_tokens, 0)

    def sort_key(self, request: RequestView, now: float) -> tuple:
        # work - rate * (now - arrival), without the "- rate * now" every key of a step shares.
        work = self.remaining_tokens(request) + self.options.aging_tokens_per_s * request.arrival_time
        return (work, request.arrival_time)
