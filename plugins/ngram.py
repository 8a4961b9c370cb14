"""The ``ngram`` proposer (prompt lookup): the request's own tokens as its draft.

When the last ``n`` tokens of a request (``prompt_lookup_min <= n <= prompt_lookup_max``, the
longest such ``n`` that matches) occurred earlier in its prompt or output, the tokens that
followed their most recent earlier occurrence are proposed. Code edits, summaries that quote,
JSON rewrites and RAG answers copy long runs of their input, and this finds them for free.

Per request an index maps each n-gram (as a tuple, for each ``n``) to the last position it ended
at. Each step indexes only the tokens that arrived since the previous step and looks up the
current suffix: O(new tokens x (max - min + 1)) per step, O(1) amortised per generated token, and
never a scan of the sequence. The position is stored only after the lookup at that position, so
a suffix never matches itself.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from paged.core.speculative import DraftRequest, ProposerContext


class NgramOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_lookup_min: int = Field(2, ge=1, le=64, description="shortest suffix that may match")
    prompt_lookup_max: int = Field(8, ge=1, le=64, description="longest suffix tried (the longest match wins)")

    @model_validator(mode="after")
    def _ordered(self) -> "NgramOptions":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


class _Index:
    """One request's n-gram tables: ``tables[i]`` maps each (min + i)-gram to the position of
    its last token, for every position below ``indexed``."""

    __slots__ = ("tables", "indexed")

    def __init__(self, num_sizes: int) -> None:
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_sizes)]
        self.indexed = 0


class NgramProposer:
    def __init__(self, options: NgramOptions | None, context: ProposerContext | None = None) -> None:
        options = options or NgramOptions()
        self.min_n = options.prompt_lookup_min
        self.max_n = options.prompt_lookup_max
        self._indexes: dict[str, _Index] = {}

    def propose(self, requests: Sequence[DraftRequest], num_tokens: int) -> list[list[int]]:
        return [self._propose_one(r, num_tokens) for r in requests]

    def _propose_one(self, request: DraftRequest, num_tokens: int) -> list[int]:
        ids = request.token_ids
        length = len(ids)
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _Index(self.max_n - self.min_n + 1)
        min_n, max_n, tables = self.min_n, self.max_n, index.tables
        # Index the n-grams ending at positions indexed .. length - 2 (the last position is
        # indexed next time, after its own lookup).
        if index.indexed < length - 1:
            base = max(0, index.indexed - max_n + 1)
            window = ids[base:length - 1]  # one copy of the new tail (plus max_n - 1 tokens of context)
            for p in range(index.indexed - base, len(window)):
                for i, table in enumerate(tables):
                    n = min_n + i
                    if p + 1 >= n:
                        table[tuple(window[p - n + 1:p + 1])] = base + p
                    else:
                        break
            index.indexed = length - 1
        if length < min_n + 1:
            return []
        tail = ids[max(0, length - max_n):length]
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            end = tables[n - min_n].get(tuple(tail[len(tail) - n:]))
            if end is not None:  # end <= length - 2: the continuation has at least one token
                return ids[end + 1:min(end + 1 + num_tokens, length)]
        return []

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._indexes.pop(request_id, None)
