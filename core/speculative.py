"""The speculative-proposer contract: who guesses the next tokens of a request.

A proposer only *proposes*; the engine owns the mechanism and every guarantee:

1. After each step the engine core asks the proposer once for draft tokens of the requests that
   are decoding (every known token computed but the last one), at most ``num_speculative_tokens``
   each: ``propose(requests, num_tokens) -> list[list[int]]``, one list per request, in order
   (an empty list: no guess for that request). Requests under structured output, and every
   request while the batch is larger than ``speculative.disable_by_batch_size``, are not asked.
2. The scheduler budgets 1 + len(drafts) tokens for the request (fewer when the token budget,
   ``max_tokens`` or ``max_model_len`` leave less; drafts past that are dropped), the KV manager
   gives the lookahead slots, and the runner computes the logits at every position.
3. Verification is exact: row j is sampled with the request's own parameters as if drafts
   0..j-1 had been generated (penalties, ``min_tokens``, bad words and logprobs see them), and
   the drafts are accepted while each equals the token sampled at its row; the first token that
   differs (or the bonus token after the last draft) is kept too. Drafts are deterministic
   guesses (the distribution they come from is a point mass), for which this is exactly
   rejection sampling (accept with min(1, p/q), resample from the normalised residual): greedy
   outputs are token-identical with and without speculation, sampled outputs follow the model's
   own distribution. ``num_computed_tokens`` is rolled back past the rejected drafts, whose KV
   slots are rewritten before anything reads them and are never hashed into the prefix cache.
4. ``forget(request_ids)``: the requests ended (finished, aborted); drop per-request state.

A proposer sees a request as a ``DraftRequest``: ``request_id``, ``token_ids`` (prompt and
output so far, a read-only ``Sequence[int]`` over the engine's list: ``len`` and indexing are
O(1), a slice copies only what it covers; keep an index of what you have seen, keyed by
``request_id``, and look at the new tail each step, rather than rescanning the whole list),
``num_prompt_tokens`` and ``num_output_tokens``. Drafts must be token ids below the model's
vocabulary size; anything else ends the proposer's part in that request's step (the engine
drops the drafts; a proposer that raises stops the engine, naming the plugin).

Registered through ``register_speculative_proposers`` (``paged.core.hookspecs``) as a
``SpeculativeProposerSpec``; ``factory(options, context) -> SpeculativeProposer`` where
``options`` is the validated pydantic model of the spec (``speculative.options``, or the extra
keys of ``--speculative-config``) and ``context`` a ``ProposerContext``. The bundled ``ngram``
proposer (``paged.plugins.ngram``) is the reference implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Iterable, Protocol, overload, runtime_checkable


class TokenIds(Sequence[int]):
    """A read-only sequence over a token list the engine keeps growing (no copy is made)."""

    __slots__ = ("_ids",)

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index):
        return self._ids[index]  # a slice of a list is a copy: the caller cannot write through it

    def __iter__(self):
        return iter(self._ids)

    def __repr__(self) -> str:
        return f"TokenIds(len={len(self._ids)})"


class DraftRequest:
    """What a proposer sees of one request (one per request, made once)."""

    __slots__ = ("_request", "token_ids")

    def __init__(self, request) -> None:
        self._request = request
        self.token_ids = TokenIds(request.all_token_ids)

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._request.output_token_ids)

    def __repr__(self) -> str:
        return f"DraftRequest({self._request.request_id!r}, {len(self.token_ids)} tokens)"


@dataclass(frozen=True)
class ProposerContext:
    """What the engine tells a proposer when it builds one."""

    vocab_size: int
    num_speculative_tokens: int
    model_dir: str
    device: str = "cpu"  # the engine's ("cpu", "cuda", "cuda:0"): where a proposer with a model of its own runs it
    tensor_parallel_size: int = 1


@runtime_checkable
class SpeculativeProposer(Protocol):
    def propose(self, requests: Sequence[DraftRequest], num_tokens: int) -> list[list[int]]:
        """Up to ``num_tokens`` draft tokens per request (the next ones, in order)."""
        ...

    def forget(self, request_ids: Iterable[str]) -> None:
        """The requests ended: drop what is kept for them."""
        ...
