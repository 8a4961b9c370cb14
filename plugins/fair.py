"""``fair``: per-tenant fairness with virtual token counters (VTC).

The idea of "Fairness in Serving Large Language Models" (Sheng et al., OSDI'24): each tenant has a
counter of the service it has received, counted in tokens with a weight for prefill (input) and
one for decode (output) tokens; the scheduler always serves the backlogged tenant with the
smallest counter. A tenant that arrives after being idle has its counter lifted to the smallest
counter among the active tenants, so idleness cannot be banked into a later burst. A tenant
flooding the server then only delays itself: the others keep their share.

Tenants are the requests' ``tenant`` (the OpenAI ``user`` field); requests without one share the
tenant ``""``. ``tenant_weights`` gives a tenant a larger share (service is divided by its weight).
The counters are updated from each step's ``on_step`` stats; the key is dynamic (it reads them)
for waiting requests, while a running one keeps the key it was admitted with (unless
``preemptive``), so the running order is stable and its head always progresses. The waiting
queue is grouped by tenant (``waiting_group``): a step re-keys one request per tenant.
"""

from __future__ import annotations

from collections import deque

from pydantic import BaseModel, ConfigDict, Field

from paged.core.policy import Admission, BasePolicy, RequestView, StepStats


class FairOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill_weight: float = Field(1.0, ge=0.0, description="service counted per prefill (input) token")
    decode_weight: float = Field(2.0, ge=0.0, description="service counted per decode (output) token")
    tenant_weights: dict[str, float] = Field(
        {}, description="share of a tenant relative to the default 1.0, e.g. {\"gold\": 2}"
    )
    preemptive: bool = Field(
        False, description="a less-served tenant's waiting request may preempt the most-served running one"
    )


class FairPolicy(BasePolicy):
    """The tenant with the least weighted service first, ties by arrival."""

    name = "fair"
    dynamic = True

    def __init__(self, options: FairOptions | None = None) -> None:
        super().__init__(options or FairOptions())
        self.displaces_running = self.options.preemptive
        self.counters: dict[str, float] = {}
        self._live: dict[str, deque[RequestView]] = {}  # per tenant, in arrival order
        self._seen: set[RequestView] = set()  # views in _live (by identity)
        self._served_last_step: set[str] = set()

    @staticmethod
    def tenant_of(request: RequestView) -> str:
        return request.tenant or ""

    def _has_live(self, tenant: str) -> bool:
        live = self._live.get(tenant)
        while live and live[0].is_finished:  # mostly FIFO within a tenant: amortized O(1)
            self._seen.discard(live.popleft())
        return bool(live)

    def admit(self, request: RequestView, now: float) -> Admission:
        if request in self._seen:  # asked again at the head of the queue
            return Admission.ACCEPT
        tenant = self.tenant_of(request)
        if not self._has_live(tenant):
            # Counter lift: an idle tenant re-enters at the least-served active tenant's level.
            active = [self.counters[t] for t in self._served_last_step if t in self.counters and t != tenant]
            if active:
                self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(active))
        self._live.setdefault(tenant, deque()).append(request)
        self._seen.add(request)
        return Admission.ACCEPT

    def sort_key(self, request: RequestView, now: float) -> tuple:
        if request.is_running and request.sort_key and not self.options.preemptive:
            # A running request keeps the key it was admitted with (fairness is decided at
            # admission, as in VTC). Re-sorted by the moving counters, two tenants' requests that
            # did not both fit the KV cache preempted each other in turn, each losing its computed
            # tokens, and none ever finished: a livelock the KV-cache state machine found.
            return request.sort_key
        return (self.counters.get(self.tenant_of(request), 0.0), request.arrival_time)

    def waiting_group(self, request: RequestView) -> tuple[str, tuple]:
        # One tenant's requests share its counter: arrival orders them at every step, so only
        # each tenant's oldest waiting request needs its key (exact, O(tenants) a step).
        return self.tenant_of(request), (request.arrival_time,)

    def on_step(self, stats: StepStats) -> None:
        options, counters = self.options, self.counters
        served = set()
        for view, prefill, decode in stats.scheduled:
            tenant = self.tenant_of(view)
            weight = options.tenant_weights.get(tenant, 1.0) or 1.0
            counters[tenant] = counters.get(tenant, 0.0) + (
                options.prefill_weight * prefill + options.decode_weight * decode
            ) / weight
            served.add(tenant)
        self._served_last_step = served
