"""Speculative decoding in the engine: asking the proposer, and verifying its drafts.

The contract a proposer meets, and what the engine guarantees, is in ``paged.core.speculative``.
This module holds the engine's side, in the order of a step:

1. ``Speculator.propose(running)`` (the engine core, after each step): the requests that decode
   next get ``request.spec_token_ids``, at most ``num_speculative_tokens``, and never more than
   the request may still output (``max_tokens``, ``max_model_len``) minus the one token every
   step produces anyway. A constrained request's drafts are cut before the first token its
   grammar refuses (each is tried on the matcher, which is rolled back after).
2. The scheduler schedules ``1 + len(drafts)`` tokens (``ScheduledRequest.spec_token_ids``); the
   runner feeds ``[last token] + drafts`` and samples every row with ``draft_rows``: row j sees
   the request as if drafts 0..j-1 were already its output, its grammar included (the row's
   mask is the matcher's after those drafts).
3. ``accepted_tokens(drafts, sampled)``: the sampled tokens up to and including the first that
   differs from its draft (all of them when every draft matched: the last is the bonus token).
   The scheduler appends them one at a time (each advances the grammar; stop conditions apply
   after each) and rolls ``num_computed_tokens`` back by the number of rejected drafts.

Why this is exact (the output distribution is the model's own): a draft is a deterministic
guess, a point mass q at token d. Rejection sampling accepts d with probability min(1, p(d)/q(d))
= p(d) and otherwise samples from the residual max(0, p - q) normalised, which is p without d,
renormalised. Drawing x ~ p at the row and accepting when x == d does exactly that: P(accept) =
p(d), and x given x != d is p restricted to the other tokens. Greedy rows draw the argmax, so
greedy output is token-identical with and without speculation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

from paged.core.engine.plugin_faults import PluginCode, describe, log_fault
from paged.core.engine.request import Request
from paged.core.errors import EngineError

logger = logging.getLogger("paged")


@dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's ``spec_decode`` metrics)."""

    num_drafts: int = 0  # (request, step) pairs verified with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # draft tokens accepted (bonus tokens not counted)
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified request advanced per step: 1 + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per = self.accepted_per_position
        if len(per) < num_drafts:
            per.extend([0] * (num_drafts - len(per)))
        for i in range(num_accepted):
            per[i] += 1

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 4),
                "accepted_per_position": list(self.accepted_per_position)}


# A request's acceptance is judged over this many of its draft tokens; below the minimum rate it
# is not asked for PAUSE_STEPS steps (then it is tried again).
ACCEPTANCE_WINDOW = 16
PAUSE_STEPS = 32


class Speculator:
    """Asks the proposer for drafts once per step and keeps them within what may run.

    Adaptive, per request: a request whose last ``ACCEPTANCE_WINDOW`` draft tokens were accepted
    at a rate below ``min_acceptance_rate`` is not asked for the next ``PAUSE_STEPS`` steps
    (each verified draft costs about 0.2-0.3 of a one-token step on the CPU, so a draft accepted
    less than ~20-30% of the time loses; ``benchmarks/speculative.py``). For the whole batch: no
    speculation in a step where more than ``disable_by_batch_size`` requests decode.
    """

    def __init__(self, proposer, code: PluginCode, method: str, num_speculative_tokens: int, vocab_size: int,
                 max_model_len: int, disable_by_batch_size: int | None = None,
                 min_acceptance_rate: float = 0.0) -> None:
        self.proposer = proposer
        self._forgotten: set[str] = set()  # ended in a step and forgotten then; in the next step's finished ids too
        self.code = code
        self.method = method
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.disable_by_batch_size = disable_by_batch_size
        self.min_acceptance_rate = min_acceptance_rate
        self.stats = SpecDecodeStats()
        self.num_steps = 0
        self._warned_bad_draft = False
        self.grammar_code: PluginCode | None = None  # the structured-output backend, to name it in failures
        self.speculate_constrained = True  # off once a grammar backend failed to check or roll back drafts

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """One verification of ``request`` (the scheduler calls it): the global counters, and the
        request's window for the adaptive pause."""
        self.stats.record(num_drafts, num_accepted)
        request.spec_window_drafted += num_drafts
        request.spec_window_accepted += num_accepted
        if request.spec_window_drafted >= ACCEPTANCE_WINDOW:
            if request.spec_window_accepted < self.min_acceptance_rate * request.spec_window_drafted:
                request.spec_paused_until = self.num_steps + PAUSE_STEPS
            request.spec_window_drafted = request.spec_window_accepted = 0

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of the running requests that decode next (one proposer call)."""
        self.num_steps += 1
        k = self.num_speculative_tokens
        asked: list[Request] = []
        limits: list[int] = []
        for request in running:
            if request.num_computed_tokens != request.num_tokens - 1:
                continue  # still in prefill
            if request.grammar is not None and not self.speculate_constrained:
                continue
            if request.spec_paused_until > self.num_steps:
                continue  # its drafts were rejected too often lately
            limit = min(k, request.max_tokens - request.num_output_tokens - 1,
                        self.max_model_len - request.num_tokens - 1)
            if limit > 0:
                asked.append(request)
                limits.append(limit)
        if not asked or (self.disable_by_batch_size is not None and len(asked) > self.disable_by_batch_size):
            return
        try:
            drafts = self.proposer.propose([r.draft_view for r in asked], k)
        except Exception as e:  # a proposer fault stops the engine, naming the plugin
            message = describe(e, [self.code], self.code, "propose")
            log_fault(message, e)
            raise EngineError(message) from None
        if not isinstance(drafts, list) or len(drafts) != len(asked):
            raise EngineError(f"{self.code.label}: propose returned {type(drafts).__name__} of "
                              f"{len(drafts) if hasattr(drafts, '__len__') else '?'} entries for {len(asked)} "
                              "requests; it must return one list of token ids per request")
        vocab = self.vocab_size
        for request, draft, limit in zip(asked, drafts, limits):
            if not draft:
                continue
            draft = list(draft[:limit])
            if not all(type(t) is int and 0 <= t < vocab for t in draft):
                if not self._warned_bad_draft:
                    logger.warning("%s proposed %r for request %s: not token ids below %d; drafts like it are "
                                   "dropped", self.code.label, draft, request.request_id, vocab)
                    self._warned_bad_draft = True
                continue
            if request.grammar is not None:
                draft = self._grammar_prefix(request, draft)
            request.spec_token_ids = draft

    def _grammar_prefix(self, request: Request, draft: list[int]) -> list[int]:
        """The drafts before the first one ``request``'s grammar refuses (after a stop token
        ends the grammar it constrains nothing, as in ``Scheduler._grammar_accepts``); the
        matcher is rolled back to where it was. A backend that fails here ends the request with
        the error, and constrained requests speculate no more."""
        grammar = request.grammar
        accepted = 0  # tokens the matcher took (and gives back)
        keep = len(draft)
        try:
            try:
                for n, token in enumerate(draft):
                    if grammar.is_terminated():
                        break
                    if not grammar.accept_token(token):
                        keep = n
                        break
                    accepted += 1
            finally:
                if accepted:
                    grammar.rollback(accepted)
        except Exception as e:
            request.error = describe(e, [self.grammar_code], self.grammar_code, "checking drafts (accept_token, "
                                     "rollback)")
            log_fault(request.error, e, request_id=request.request_id)
            self.speculate_constrained = False
            return []
        return draft[:keep]

    def forget(self, request_ids: Iterable[str]) -> None:
        forget = getattr(self.proposer, "forget", None)
        if forget is not None:
            forget(request_ids)

    def forget_finished(self, since_last_step: list[str], in_this_step: list[str]) -> None:
        """After a step: the proposer forgets the requests that ended in it at once (a draft
        model's KV blocks go now, not when the next step comes, which an idle engine never runs),
        and those that ended since the last step otherwise (aborts); each request once."""
        late = [r for r in since_last_step if r not in self._forgotten] if self._forgotten else since_last_step
        self._forgotten.difference_update(since_last_step)
        if late or in_this_step:
            self.forget(late + in_this_step)
        self._forgotten.update(in_this_step)


class GrammarAfterDrafts:
    """A request's matcher as row j of its verification sees it: after drafts 0..j-1. Each call
    accepts them, asks, and rolls them back (the drafts were checked against this grammar
    when they were proposed), so the matcher itself never moves here."""

    __slots__ = ("matcher", "drafts")

    def __init__(self, matcher, drafts: list[int]) -> None:
        self.matcher = matcher
        self.drafts = drafts

    def _advance(self) -> int:
        """Accept the drafts (those up to the end of the grammar); how many were accepted. On a
        refusal or a backend error the matcher is rolled back before the error goes up."""
        matcher = self.matcher
        n = 0
        try:
            for token in self.drafts:
                if matcher.is_terminated():  # past a stop token the grammar takes no more tokens
                    return n
                if not matcher.accept_token(token):
                    raise RuntimeError(f"the grammar refused draft token {token}, which it accepted when it was "
                                       "proposed")
                n += 1
        except BaseException:
            self._back(n)
            raise
        return n

    def _back(self, num_accepted: int) -> None:
        if num_accepted:
            self.matcher.rollback(num_accepted)

    def fill_bitmask(self, bitmask, row: int) -> None:
        num_accepted = self._advance()
        try:
            self.matcher.fill_bitmask(bitmask, row)
        finally:
            self._back(num_accepted)

    def is_terminated(self) -> bool:
        # The sampler asks before it masks: a failure here is left to fill_bitmask to raise,
        # where the sampler names the backend and ends the request.
        try:
            num_accepted = self._advance()
        except Exception:
            return False
        try:
            return self.matcher.is_terminated()
        finally:
            self._back(num_accepted)


class DraftRow:
    """The request as row j of its verification sees it: drafts 0..j-1 already output. It has
    what the sampler reads of a request (``paged.core.engine.sampler``)."""

    __slots__ = ("request", "drafts", "grammar", "_output", "_all")

    def __init__(self, request: Request, drafts: list[int]) -> None:
        self.request = request
        self.drafts = drafts
        self.grammar = None if request.grammar is None else GrammarAfterDrafts(request.grammar, drafts)
        self._output: list[int] | None = None
        self._all: list[int] | None = None

    @property
    def error(self) -> str:
        return self.request.error

    @error.setter
    def error(self, message: str) -> None:  # the sampler's: a grammar that failed at this row ends the request
        self.request.error = message

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling_params(self):
        return self.request.sampling_params

    @property
    def output_token_ids(self) -> list[int]:
        if self._output is None:  # made on first read: only penalties, min_tokens and bad words read it
            self._output = self.request.output_token_ids + self.drafts
        return self._output

    @property
    def all_token_ids(self) -> list[int]:
        if self._all is None:
            self._all = self.request.all_token_ids + self.drafts
        return self._all

    def stop_token_ids(self) -> set[int]:
        return self.request.stop_token_ids()


def draft_rows(request: Request, drafts: list[int]) -> list:
    """The k + 1 rows a request with k drafts is sampled at (row 0 is the request itself)."""
    return [request] + [DraftRow(request, drafts[:j]) for j in range(1, len(drafts) + 1)]


def accepted_tokens(drafts: list[int], sampled: list[int]) -> list[int]:
    """``sampled`` (one token per row, ``len(drafts) + 1`` rows) up to and including the first
    token that differs from its draft."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return sampled[: j + 1]
    return sampled
