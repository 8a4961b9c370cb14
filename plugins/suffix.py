"""The ``suffix`` proposer (suffix decoding): the longest earlier match of the request's end, in
its own tokens or in recent requests' outputs, of any length.

Where ``ngram`` looks up the last 2-8 tokens, this finds the longest suffix of the request's
tokens that occurred before, however long, in two places: earlier in the request itself (prompt
and output), and in the outputs of the last ``suffix_decoding_max_cached_requests`` requests
(agent loops and repeated tasks produce the same answers again). The tokens that followed the
longer of the two matches are proposed, at most ``suffix_decoding_max_spec_factor`` x the match
length of them (a one-token match guesses one token; a 20-token match guesses up to k), as
vLLM's suffix decoding does. vLLM's per-token probability threshold
(``suffix_decoding_min_token_prob``) needs frequency counts this proposer does not keep.

Both places are suffix automata (``SuffixAutomaton``): appending a token is O(1) amortised,
and the state reached by the whole sequence links to the state of its longest suffix that
also ends earlier. Per request: its own automaton, extended by the tokens that arrived since
the previous step, and a matching state in the shared automaton of cached outputs, advanced
by the same tokens. Nothing is rescanned; the shared automaton is rebuilt from the newest half
of the cache when the cache is full, in requests or in ``MAX_CACHED_TOKENS`` (amortised O(1)
per cached token); a request's match in it is found again, from its last ``REMATCH_TOKENS``
tokens, the next time the request is asked after the cache changed.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from paged.core.speculative import DraftRequest, ProposerContext

RECENT_DEPTH = 8  # suffix-link steps per token that refresh "latest occurrence" (below: an older one)
REMATCH_TOKENS = 64  # how much of a request's end is matched again when the shared automaton changes
MAX_CACHED_TOKENS = 65_536  # the cache's bound in tokens too (~2 states of a dict each: tens of MB)


class SuffixOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    suffix_decoding_max_spec_factor: float = Field(
        1.0, gt=0, le=64, description="draft at most this many tokens per matched token (then at most k)")
    suffix_decoding_max_cached_requests: int = Field(
        64, ge=0, le=100_000, description="finished requests whose outputs are matched too (0: only the request itself)")


class SuffixAutomaton:
    """The suffix automaton of one token sequence (or of several, each ended by a separator of
    its own, so that no match crosses from one into the next).

    State 0 is the empty string. ``length[s]`` is the longest string of state ``s``, ``link[s]``
    the state of its longest suffix that ends at more positions, ``moves[s]`` its transitions.
    ``end[s]`` is a position where the strings of ``s`` end: the latest one for states on the
    first ``RECENT_DEPTH`` suffix links of each position, an earlier one otherwise (always a
    true end position). Invariant after ``extend``: ``last`` is the state of the whole sequence,
    and ``link[last]`` the state of the longest suffix that also ends before the last token.
    """

    __slots__ = ("moves", "link", "length", "end", "last", "size")

    def __init__(self) -> None:
        self.moves: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.end = [-1]
        self.last = 0
        self.size = 0  # tokens appended

    def extend(self, token: int) -> None:
        moves, link, length, end = self.moves, self.link, self.length, self.end
        position = self.size
        # The previous position, ended by the previous `last`, becomes the latest end of the
        # states of its suffixes (done now, not then: a match must end before the last token).
        s, depth = link[self.last], 0
        while s > 0 and depth < RECENT_DEPTH:
            end[s] = position - 1
            s, depth = link[s], depth + 1
        cur = len(length)
        moves.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        end.append(position)
        p = self.last
        while p != -1 and token not in moves[p]:
            moves[p][token] = cur
            p = link[p]
        if p != -1:
            q = moves[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: a clone takes the shorter strings (and an end of q's)
                clone = len(length)
                moves.append(dict(moves[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                end.append(end[q])
                while p != -1 and moves[p].get(token) == q:
                    moves[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        self.size += 1

    def earlier_match(self) -> tuple[int, int]:
        """(length, end position) of the longest suffix that also ends before the last token."""
        s = self.link[self.last] if self.last else -1
        if s <= 0:
            return 0, -1
        return self.length[s], self.end[s]

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Advance a match of some other sequence's suffix (``matched`` tokens, in ``state``) by
        ``token``: the longest suffix of it followed by ``token`` that occurs here."""
        moves, link, length = self.moves, self.link, self.length
        while state > 0 and token not in moves[state]:
            state = link[state]
            matched = min(matched, length[state])
        if token in moves[state]:
            return moves[state][token], matched + 1
        return 0, 0


class _RequestState:
    __slots__ = ("view", "own", "seen", "shared_state", "shared_matched", "shared_version")

    def __init__(self, view: DraftRequest) -> None:
        self.view = view
        self.own = SuffixAutomaton()
        self.seen = 0  # tokens of the request fed to both automata
        self.shared_state = 0
        self.shared_matched = 0
        self.shared_version = 0  # the shared automaton's version the match was made in


class SuffixProposer:
    def __init__(self, options: SuffixOptions | None, context: ProposerContext | None = None) -> None:
        options = options or SuffixOptions()
        self.spec_factor = options.suffix_decoding_max_spec_factor
        self.max_cached = options.suffix_decoding_max_cached_requests
        self._requests: dict[str, _RequestState] = {}
        self._cached: deque[list[int]] = deque()  # finished outputs, oldest first
        self._shared = SuffixAutomaton()
        self._corpus: list[int] = []  # the cached outputs, each ended by its own negative separator
        self._separator = 0
        self._cached_tokens = 0
        self._version = 0  # changes whenever the shared automaton does

    def propose(self, requests: Sequence[DraftRequest], num_tokens: int) -> list[list[int]]:
        return [self._propose_one(r, num_tokens) for r in requests]

    def _propose_one(self, request: DraftRequest, num_tokens: int) -> list[int]:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
        ids = request.token_ids
        length = len(ids)
        if state.shared_version != self._version:
            s = matched = 0
            for token in ids[max(0, state.seen - REMATCH_TOKENS):state.seen]:
                s, matched = self._shared.step(s, matched, token)
            state.shared_state, state.shared_matched, state.shared_version = s, matched, self._version
        if state.seen < length:
            own, shared = state.own, self._shared
            s, matched = state.shared_state, state.shared_matched
            for token in ids[state.seen:length]:
                own.extend(token)
                s, matched = shared.step(s, matched, token)
            state.seen, state.shared_state, state.shared_matched = length, s, matched
        own_len, own_end = state.own.earlier_match()
        if state.shared_matched > own_len:
            match_len, source, start = state.shared_matched, self._corpus, self._shared.end[state.shared_state] + 1
        elif own_len > 0:
            match_len, source, start = own_len, ids, own_end + 1
        else:
            return []
        count = min(num_tokens, max(1, int(self.spec_factor * match_len)))
        draft = source[start:start + count]  # a slice: it stops at the sequence's end
        if source is self._corpus:  # up to the end of that cached output
            for i, token in enumerate(draft):
                if token < 0:
                    return draft[:i]
        return draft

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is None or self.max_cached == 0:
                continue
            output = list(state.view.token_ids[state.view.num_prompt_tokens:])
            if output:
                self._cached.append(output)
                self._cached_tokens += len(output)
                self._add_to_shared(output)
                self._version += 1
        if len(self._cached) > self.max_cached or self._cached_tokens > MAX_CACHED_TOKENS:
            while self._cached and (len(self._cached) > max(1, self.max_cached // 2)
                                    or self._cached_tokens > MAX_CACHED_TOKENS // 2):
                self._cached_tokens -= len(self._cached.popleft())
            self._shared, self._corpus = SuffixAutomaton(), []
            for output in self._cached:
                self._add_to_shared(output)
            self._version += 1

    def _add_to_shared(self, output: list[int]) -> None:
        self._separator -= 1
        for token in output:
            self._shared.extend(token)
        self._shared.extend(self._separator)
        self._corpus.extend(output)
        self._corpus.append(self._separator)
