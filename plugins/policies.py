"""Bundled scheduling policies: ``fcfs`` (default) and ``priority`` here; the research policies
``srpt``, ``fair``, ``cache-aware`` and ``slo`` in their own modules, registered here."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from paged.core.hookspecs import PolicySpec, hookimpl
from paged.core.policy import BasePolicy, RequestView
from paged.plugins.cache_aware import CacheAwareOptions, CacheAwarePolicy
from paged.plugins.fair import FairOptions, FairPolicy
from paged.plugins.slo import SLOOptions, SLOPolicy
from paged.plugins.srpt import SRPTOptions, SRPTPolicy


class FCFSPolicy(BasePolicy):
    """First come, first served; the victim is the request that arrived last."""

    name = "fcfs"

    def sort_key(self, request: RequestView) -> tuple:
        return (request.arrival_time,)


class PriorityOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    aging_s: float = Field(
        0.0,
        ge=0.0,
        description="seconds of waiting that lower a request's priority value by 1 (0 = no aging)",
    )


class PriorityPolicy(BasePolicy):
    """Lower ``priority`` value first, ties by arrival. The victim is the highest (priority,
    arrival). A waiting request with a better key displaces the worst running one when the
    batch is full.

    Aging: the effective priority at time t is ``priority - (t - arrival) / aging_s``. Every
    request ages at the same rate, so ordering by it equals ordering by the static key
    ``priority + arrival / aging_s``: nothing starves, and the queue needs no re-sorting.
    """

    name = "priority"
    displaces_running = True

    def __init__(self, options: PriorityOptions | None = None) -> None:
        super().__init__(options or PriorityOptions())

    def sort_key(self, request: RequestView) -> tuple:
        aging = self.options.aging_s
        effective = request.priority + request.arrival_time / aging if aging > 0 else request.priority
        return (effective, request.arrival_time)


@hookimpl
def register_policies():
    return [
        PolicySpec("fcfs", FCFSPolicy, None, "first come, first served"),
        PolicySpec("priority", PriorityPolicy, PriorityOptions, "lower priority value first; optional aging"),
        PolicySpec("srpt", SRPTPolicy, SRPTOptions, "shortest remaining processing time first, with aging"),
        PolicySpec("fair", FairPolicy, FairOptions, "per-tenant fairness by virtual token counters (VTC)"),
        PolicySpec("cache-aware", CacheAwarePolicy, CacheAwareOptions, "longest cached prefix first, bounded window"),
        PolicySpec("slo", SLOPolicy, SLOOptions, "earliest deadline first with admission control"),
    ]
