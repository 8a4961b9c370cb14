"""The ``suffix`` proposer against brute-force searches: its suffix automaton's longest earlier
match, the match of a request's end in the cached outputs (never across two of them), the
draft-length rule and the cache's bound. The engine's exactness with it is in
``tests/core/engine/test_spec_decode.py``."""

from __future__ import annotations

import random

import pytest

from paged.core.speculative import DraftRequest
from paged.plugins.suffix import SuffixAutomaton, SuffixOptions, SuffixProposer


class _Req:
    def __init__(self, request_id: str, prompt: list[int], output: list[int] | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids, self.output_token_ids = prompt, output if output is not None else []
        self.all_token_ids = prompt + self.output_token_ids

    def append(self, *tokens: int) -> None:
        self.output_token_ids.extend(tokens)
        self.all_token_ids.extend(tokens)


def brute_longest_earlier(ids: list[int]) -> int:
    """The longest suffix of ``ids`` that also ends at a position before the last."""
    n = len(ids)
    for length in range(n - 1, 0, -1):
        suffix = ids[n - length:]
        if any(ids[end - length + 1:end + 1] == suffix for end in range(length - 1, n - 1)):
            return length
    return 0


def brute_longest_in(corpus: list[list[int]], ids: list[int]) -> int:
    """The longest suffix of ``ids`` found inside one of the ``corpus`` sequences."""
    for length in range(len(ids), 0, -1):
        suffix = ids[len(ids) - length:]
        for seq in corpus:
            if any(seq[i:i + length] == suffix for i in range(len(seq) - length + 1)):
                return length
    return 0


@pytest.mark.parametrize("alphabet", [1, 2, 3, 8])
def test_the_automaton_finds_the_longest_earlier_match_at_a_true_position(alphabet):
    rng = random.Random(alphabet)
    sam, ids = SuffixAutomaton(), []
    for _ in range(300):
        ids.append(rng.randrange(alphabet))
        sam.extend(ids[-1])
        length, end = sam.earlier_match()
        assert length == brute_longest_earlier(ids), ids
        if length:
            assert end < len(ids) - 1 and ids[end - length + 1:end + 1] == ids[len(ids) - length:]


def test_the_match_is_the_latest_occurrence_when_there_are_few_repeats():
    sam = SuffixAutomaton()
    ids = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]  # 5 6 7 ended at 2 and at 6: the latest is 6
    for token in ids:
        sam.extend(token)
    assert sam.earlier_match() == (3, 6)


@pytest.mark.parametrize("alphabet", [2, 3, 6])
def test_a_match_in_another_automaton_is_the_longest_and_never_crosses_a_separator(alphabet):
    rng = random.Random(10 + alphabet)
    corpus = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    sam = SuffixAutomaton()
    for i, seq in enumerate(corpus):
        for token in seq:
            sam.extend(token)
        sam.extend(-1 - i)
    flat = [t for i, seq in enumerate(corpus) for t in seq + [-1 - i]]
    state = matched = 0
    query: list[int] = []
    for _ in range(200):
        query.append(rng.randrange(alphabet))
        state, matched = sam.step(state, matched, query[-1])
        assert matched == brute_longest_in(corpus, query)
        if matched:
            end = sam.end[state]
            assert flat[end - matched + 1:end + 1] == query[len(query) - matched:]


def test_drafts_follow_the_match_up_to_the_factor_times_its_length():
    proposer = SuffixProposer(SuffixOptions(suffix_decoding_max_spec_factor=1.0))
    request = _Req("a", [1, 2, 3, 4, 5, 6, 9, 2, 3])  # 2 3 matched (2 tokens) -> 2 tokens of what followed
    view = DraftRequest(request)
    assert proposer.propose([view], 8) == [[4, 5]]
    request.append(4, 5)  # 2 3 4 5 matched -> 4 tokens: 6 9 2 3
    assert proposer.propose([view], 8) == [[6, 9, 2, 3]]
    assert proposer.propose([view], 3) == [[6, 9, 2]]  # at most k
    request.append(8)  # 8 never occurred
    assert proposer.propose([view], 8) == [[]]
    wide = SuffixProposer(SuffixOptions(suffix_decoding_max_spec_factor=3.0))
    assert wide.propose([DraftRequest(_Req("b", [1, 2, 3, 4, 5, 6, 7, 1]))], 8) == [[2, 3, 4]]


def test_finished_outputs_are_matched_by_later_requests_and_the_cache_is_bounded():
    proposer = SuffixProposer(SuffixOptions(suffix_decoding_max_cached_requests=2))
    first = _Req("first", [100, 101], [7, 8, 9, 10, 11, 12])
    proposer.propose([DraftRequest(first)], 4)
    proposer.forget(["first"])
    second = _Req("second", [200, 201, 7, 8, 9])  # its end (7 8 9) is in first's output
    view = DraftRequest(second)
    assert proposer.propose([view], 4) == [[10, 11, 12]]  # up to the end of that output, not into the next
    # Two more finished requests: the cache held at most 2, so it drops to the newest 1; "first" is gone.
    for name, output in (("x", [40, 41, 42]), ("y", [50, 51, 52])):
        proposer.propose([DraftRequest(_Req(name, [1], list(output)))], 4)
        proposer.forget([name])
    assert list(proposer._cached) == [[50, 51, 52]]
    second.append(10)  # 7 8 9 10 no longer in the cache, nor earlier in the request
    assert proposer.propose([view], 4) == [[]]
    third = DraftRequest(_Req("third", [50, 51]))
    assert proposer.propose([third], 4) == [[52]]


def test_a_match_never_runs_from_one_cached_output_into_the_next():
    proposer = SuffixProposer(SuffixOptions())
    for name, output in (("a", [7, 8, 9]), ("b", [10, 11, 12])):
        proposer.propose([DraftRequest(_Req(name, [1], list(output)))], 4)
        proposer.forget([name])
    # "9 10" spans the two outputs: the longest match inside one is "10" (one token, one draft)
    assert proposer.propose([DraftRequest(_Req("c", [300, 9, 10]))], 4) == [[11]]


def test_a_cache_of_one_keeps_the_newest_output():
    proposer = SuffixProposer(SuffixOptions(suffix_decoding_max_cached_requests=1))
    for name, output in (("a", [7, 8, 9]), ("b", [10, 11, 12])):
        proposer.propose([DraftRequest(_Req(name, [1], list(output)))], 4)
        proposer.forget([name])
    assert list(proposer._cached) == [[10, 11, 12]]
    assert proposer.propose([DraftRequest(_Req("c", [300, 10]))], 4) == [[11]]


def test_without_a_cache_only_the_request_itself_is_matched():
    proposer = SuffixProposer(SuffixOptions(suffix_decoding_max_cached_requests=0))
    proposer.propose([DraftRequest(_Req("a", [1], [7, 8, 9, 10]))], 4)
    proposer.forget(["a"])
    assert proposer.propose([DraftRequest(_Req("b", [7, 8]))], 4) == [[]]
    assert not proposer._cached and proposer._requests.keys() == {"b"}


def test_the_cache_is_bounded_in_tokens_too(monkeypatch):
    import paged.plugins.suffix as suffix_module

    monkeypatch.setattr(suffix_module, "MAX_CACHED_TOKENS", 10)
    proposer = SuffixProposer(SuffixOptions())
    for i in range(3):  # 12 tokens > 10: the cache drops to at most 5, the newest output
        proposer.propose([DraftRequest(_Req(f"r{i}", [1], [10 * i + t for t in range(4)]))], 4)
        proposer.forget([f"r{i}"])
    assert list(proposer._cached) == [[20, 21, 22, 23]] and proposer._cached_tokens == 4
    assert proposer.propose([DraftRequest(_Req("q", [99, 20, 21]))], 4) == [[22, 23]]
    assert proposer.propose([DraftRequest(_Req("p", [99, 0, 1]))], 4) == [[]]
