"""The waiting queue: requests not running, in policy order."""

from __future__ import annotations

import bisect
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


class GroupedWaitingQueue:
    """Waiting requests for a policy with ``waiting_group`` (paged.core.policy): one list per
    group in the policy's static in-group order, and a heap of *candidates* on ``sort_key``: the
    first ``window`` requests of every group. Only candidates are re-keyed, so a step costs
    O(groups x window) key calls however long the queue is.

    Invariants: every member has exactly one live entry, in its group's list (sorted by
    ``(order, seq)``); after each push, pop, remove or rekey, the first ``window`` live entries of
    every group are in the candidate heap with a key from the last ``rekey`` (the key the request
    entered with before the first one); ``_candidate_seqs`` holds the seqs of live candidates only
    (pop and remove take theirs out). Entries are identified by their ``seq``: a stale heap or
    list entry (removed, popped, re-pushed) is skipped and dropped when met."""

    def __init__(self, group_of, window: int = 1) -> None:
        self._group_of = group_of  # Request -> (group, order); the policy's waiting_group on the view
        self._window = max(1, int(window))
        self._groups: dict[object, list[tuple[tuple, int, Request]]] = {}
        self._live: dict[Request, tuple[object, int]] = {}  # member -> (group, seq of its entry)
        self._candidates: list[tuple[tuple, int, Request]] = []  # heap on (sort_key, seq)
        self._candidate_seqs: set[int] = set()  # seqs of the heap's valid entries
        self._seq = itertools.count()
        self._key = None  # the last rekey's key function (None: keep the key a request came with)

    def _is_live(self, seq: int, request: Request) -> bool:
        entry = self._live.get(request)
        return entry is not None and entry[1] == seq

    def _fill(self, group) -> None:
        """Drop dead entries met at the front; make the first ``window`` live ones candidates."""
        entries = self._groups.get(group)
        if entries is None:
            return
        i = seen = 0
        while i < len(entries) and seen < self._window:
            _, seq, request = entries[i]
            if not self._is_live(seq, request):
                del entries[i]
                continue
            if seq not in self._candidate_seqs:
                if self._key is not None:
                    request.sort_key = self._key(request)
                heapq.heappush(self._candidates, (request.sort_key, seq, request))
                self._candidate_seqs.add(seq)
            seen += 1
            i += 1
        if not entries:
            del self._groups[group]

    def push(self, request: Request) -> None:
        group, order = self._group_of(request)
        seq = next(self._seq)
        entries = self._groups.setdefault(group, [])
        entry = (tuple(order), seq, request)
        if not entries or entries[-1] < entry:
            entries.append(entry)  # the common case: arrivals come in order
        else:
            bisect.insort(entries, entry)  # a preempted request goes back to its place
        self._live[request] = (group, seq)
        self._fill(group)

    def peek(self) -> Request | None:
        heap = self._candidates
        while heap:
            _, seq, request = heap[0]
            if seq in self._candidate_seqs:
                return request
            heapq.heappop(heap)  # removed, or left from before the last rekey
        return None

    def pop(self) -> Request:
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty waiting queue")
        _, seq, _ = heapq.heappop(self._candidates)
        self._candidate_seqs.discard(seq)
        group, _ = self._live.pop(request)
        entries = self._groups[group]
        for i, entry in enumerate(entries):  # among the first window (+ dead) entries
            if entry[1] == seq:
                del entries[i]
                break
        self._fill(group)
        return request

    def remove(self, request: Request) -> bool:
        entry = self._live.pop(request, None)
        if entry is None:
            return False
        group, seq = entry
        if seq in self._candidate_seqs:  # the next one of its group takes its place
            self._candidate_seqs.discard(seq)
            self._fill(group)
        return True

    def __len__(self) -> int:
        return len(self._live)

    def rekey(self, key) -> None:
        """Set ``sort_key = key(request)`` on the candidates (the first ``window`` of each group)
        and rebuild their heap; ``key`` also keys requests that become candidates until the next
        rekey."""
        self._key = key
        self._candidates = []
        self._candidate_seqs = set()
        for group in list(self._groups):
            self._fill(group)

    def __iter__(self):
        """Members: the candidates in key order, then the others in their groups' order."""
        candidates = sorted(e for e in self._candidates if e[1] in self._candidate_seqs)
        rest = sorted(
            e for entries in self._groups.values() for e in entries
            if e[1] not in self._candidate_seqs and self._is_live(e[1], e[2])
        )
        return (r for _, _, r in candidates + rest)
