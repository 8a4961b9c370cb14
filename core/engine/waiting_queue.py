"""The waiting queue: requests not running, in policy order."""

from __future__ import annotations

import heapq
import itertools

from paged.core.engine.request import Request


class WaitingQueue:
    """Requests waiting for admission, in policy order (a heap on ``request.sort_key``).
    Removal is lazy: aborted requests are skipped when they reach the top. Membership is by
    request object, not id: an id may be reused once its request has finished, and the stale
    heap entry must not stand for the new request."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, Request]] = []
        self._seq = itertools.count()
        self._members: set[Request] = set()  # Request hashes by identity (eq=False)

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key, next(self._seq), request))
        self._members.add(request)

    def _skip_removed(self) -> None:
        while self._heap and self._heap[0][2] not in self._members:
            heapq.heappop(self._heap)

    def peek(self) -> Request | None:
        self._skip_removed()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._skip_removed()
        request = heapq.heappop(self._heap)[2]
        self._members.discard(request)
        return request

    def remove(self, request: Request) -> bool:
        if request in self._members:
            self._members.discard(request)
            return True
        return False

    def __len__(self) -> int:
        return len(self._members)

    def rekey(self, key) -> None:
        """Set every member's ``sort_key = key(request)`` and rebuild the heap (dropping stale
        entries)."""
        heap = []
        for _, seq, request in self._heap:
            if request in self._members:
                request.sort_key = key(request)
                heap.append((request.sort_key, seq, request))
        heapq.heapify(heap)
        self._heap = heap

    def __iter__(self):
        return (r for _, _, r in sorted(self._heap) if r in self._members)
