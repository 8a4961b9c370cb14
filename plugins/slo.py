"""``slo``: earliest deadline first, with admission control.

Earliest deadline first (Liu & Layland 1973) is optimal for meeting deadlines while the system is
not overloaded; under overload it degrades badly, every request missing by a little. Admission
control fixes that (the approach of deadline-aware LLM serving such as SLOs-Serve or "Andes",
2024): a request that cannot meet its deadline even if it ran now is turned away (or, with
``action = "defer"``, served only when the engine has nothing else to run), so capacity goes to requests that can
still make it: goodput, the requests that meet their deadline per second, rises.

The estimate of the time a request needs if it runs now: its prefill in
``ceil(prompt / token_budget)`` steps plus one step per output token still to generate
(``max_tokens``), at a step time learned from the steps seen (an exponential average of the time
between consecutive busy steps; ``initial_step_time_s`` before any), times ``slack``. Requests
without a deadline sort last and are never turned away. The key is static: a deadline is absolute.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from paged.core.policy import Admission, BasePolicy, RequestView, StepStats


class SLOOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: Literal["reject", "defer"] = Field("reject", description="what happens to a request that cannot make it")
    slack: float = Field(1.0, gt=0.0, description="multiplies the time estimate (> 1: reject earlier)")
    initial_step_time_s: float = Field(0.02, gt=0.0, description="step time assumed before any step is seen")
    smoothing: float = Field(0.1, gt=0.0, le=1.0, description="weight of each new step time in the average")


class SLOPolicy(BasePolicy):
    """Earlier deadline first (none: last), ties by arrival; rejects what cannot meet its deadline."""

    name = "slo"
    displaces_running = False

    def __init__(self, options: SLOOptions | None = None) -> None:
        super().__init__(options or SLOOptions())
        self.step_time_s = self.options.initial_step_time_s
        self.token_budget = 0  # learned from the first step
        self._last_step: float | None = None
        self._busy = False  # whether the last step scheduled anything

    def sort_key(self, request: RequestView) -> tuple:
        deadline = request.deadline
        return (math.inf if deadline is None else deadline, request.arrival_time)

    def time_needed(self, request: RequestView) -> float:
        budget = self.token_budget or request.num_prompt_tokens
        prefill_steps = math.ceil(max(request.num_prompt_tokens - request.prefix_hit_tokens, 1) / budget)
        steps = prefill_steps + max(request.max_tokens - request.num_output_tokens - 1, 0)
        return steps * self.step_time_s * self.options.slack

    def admit(self, request: RequestView, now: float) -> Admission:
        if request.deadline is None:
            return Admission.ACCEPT
        needed = self.time_needed(request)
        left = request.deadline - now
        if needed <= left:
            return Admission.ACCEPT
        reason = f"cannot meet its deadline: needs about {needed:.3f} s, {max(left, 0.0):.3f} s left"
        if self.options.action == "defer" and self._busy:
            return Admission.defer(reason)
        if self.options.action == "defer":
            # The last step had nothing else to run (only requests deferred like this one wait): serve
            # it late rather than not at all. Deferring on "others wait" instead could defer every
            # late request forever once all the waiting ones are late.
            return Admission.ACCEPT
        return Admission.reject(reason, http_status=503)

    def on_step(self, stats: StepStats) -> None:
        self.token_budget = stats.token_budget
        self._busy = bool(stats.scheduled)
        if self._last_step is not None and stats.scheduled:
            gap = stats.now - self._last_step
            if gap > 0:
                a = self.options.smoothing
                self.step_time_s = (1 - a) * self.step_time_s + a * gap
        self._last_step = stats.now if stats.scheduled else None
