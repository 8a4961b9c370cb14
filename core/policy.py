"""The scheduling-policy contract.

The scheduler (paged.core.engine.scheduler) owns the mechanism: token budget, chunked prefill, block
allocation, preemption. A policy decides only

- the *order*: ``sort_key(request)``, lower first. It is computed once when the request enters the
  waiting queue and kept while it runs, so it must not depend on the current time (aging can be
  expressed statically: see the priority policy). The waiting queue and the running list are both
  kept in this order.
- the *victim*: ``select_victim(candidates)`` when blocks run out (default: the largest key).
- whether a better waiting request may *displace* a running one when the batch is full
  (``displaces_running``).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from paged.core.engine.request import Request


@runtime_checkable
class SchedulingPolicy(Protocol):
    name: str
    displaces_running: bool

    def sort_key(self, request: Request) -> tuple: ...

    def select_victim(self, candidates: Sequence[Request]) -> Request: ...


class BasePolicy:
    """Convenience base: subclasses define ``sort_key``."""

    name = "base"
    displaces_running = False

    def __init__(self, options=None) -> None:
        self.options = options

    def sort_key(self, request: Request) -> tuple:
        raise NotImplementedError

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        # Among equal keys the last one (candidates are in running order): a request never
        # preempts itself while an equal one behind it keeps running.
        return max(reversed(candidates), key=lambda r: r.sort_key)
