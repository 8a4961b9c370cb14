"""Structured outputs: the constraint a request carries and the contract of a grammar backend.

A request's ``SamplingParams.structured_output`` is a ``StructuredOutputParams``: exactly one of
a JSON schema, "any JSON object", a regex, a choice among strings or a grammar. It is plain data
(it crosses the ZeroMQ/msgspec boundary as is) and is compiled in the engine core process.

A backend (registered with ``register_structured_output_backends``, see paged.core.hookspecs)
provides, through its ``StructuredOutputBackendSpec``:

- ``validate(params)``: a cheap check without a tokenizer, run by the front-end before the
  request is queued; raises ``ValueError`` with a message naming the problem;
- ``factory(tokenizer, vocab_size, eos_token_ids, options) -> StructuredOutputBackend``: built
  in the core on the first constrained request, off the step (in the compile thread pool).

The backend compiles a constraint once (the core caches the result by ``params.cache_key()``)
and makes a fresh ``GrammarMatcher`` per request from it. (Before a request is queued, the
front-end compiles a new constraint once in a worker process, within a time limit, and asks
``check_compiled`` whether it can be used at all: paged.core.constraint_check.) Per step, the
sampler asks each constrained request's matcher to fill its row of an int32 bitmask (bit
``t % 32`` of word ``t // 32`` set = token ``t`` allowed) and masks the whole batch in one op;
the core then advances each matcher with the accepted token.

Invariant: a matcher has accepted exactly the request's ``output_token_ids`` (so preemption by
recompute, which keeps the output tokens, keeps the matcher valid; ``reset`` + ``accept_token``
of the outputs rebuilds it from scratch).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from paged.core.errors import InvalidRequestError

if TYPE_CHECKING:  # numpy and torch are imported where they are used: `import paged` loads neither
    import numpy as np
    import torch

_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputParams:
    """Exactly one field is set. ``json_schema``: a JSON schema object (a dict, or its JSON text);
    ``json_object``: any JSON object; ``regex``: the whole output matches it; ``choice``: the
    output is one of these strings; ``grammar``: a grammar in the backend's syntax (xgrammar:
    GBNF-style EBNF; llguidance: Lark or GBNF)."""

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"structured_output.json_schema: not valid JSON ({e})") from None
            except RecursionError:
                raise InvalidRequestError("structured_output.json_schema: nested too deeply to parse") from None
        self.validate()

    def validate(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError(
                f"structured_output: exactly one of {', '.join(_KINDS)} must be set, got "
                f"{set_kinds or 'none'}"
            )
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise InvalidRequestError(
                f"structured_output.json_schema: must be a JSON object (a schema), got {type(self.json_schema).__name__}"
            )
        if self.json_object not in (True, False):
            raise InvalidRequestError(f"structured_output.json_object: must be true or false, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured_output.{name}: must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError(
                f"structured_output.choice: must be a non-empty list of non-empty strings, got {self.choice!r}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    def cache_key(self) -> str:
        """Same constraint, same key (dict key order does not matter)."""
        return json.dumps([self.kind, self.value], sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict) -> "StructuredOutputParams":
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - names:
            extra = sorted(set(data) - names) if isinstance(data, dict) else data
            raise InvalidRequestError(f"structured_output: unknown field(s) {extra}; accepted: {list(_KINDS)}")
        return cls(**data)


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (for backends without a native choice)."""
    specials = set("\\.^$|?*+()[]{}")
    escaped = ["".join("\\" + c if c in specials else c for c in choice) for choice in choices]
    return "(" + "|".join(escaped) + ")"


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, CPU, contiguous)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar does not allow it (state unchanged)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): it constrains nothing more."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer. ``compile`` runs in a thread pool."""

    @abstractmethod
    def compile(self, params: StructuredOutputParams) -> Any:
        """The compiled constraint (shared by every request with the same cache key); raises
        ``ValueError`` naming the problem when the constraint cannot be compiled."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""

    def check_compiled(self, compiled: Any, vocab_size: int, stop_token_ids: list[int]) -> str | None:
        """Why ``compiled`` cannot be used although it compiled (e.g. no output satisfies it), or
        None when nothing was found. Bounded; the default is ``dead_end`` on a fresh matcher."""
        return dead_end(self.matcher(compiled), vocab_size, stop_token_ids)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """The token ids whose bit is set in one int32 bitmask row."""
    import numpy as np

    words = bitmask_row.numpy()
    nonzero = np.flatnonzero(words)  # only these words are unpacked: cheap for a narrow mask
    bits = np.unpackbits(words[nonzero].astype("<i4").view(np.uint8), bitorder="little").reshape(-1, 32)
    ids = (nonzero[:, None] * 32 + np.arange(32))[bits.astype(bool)]
    return ids[ids < vocab_size]


def dead_end(matcher: GrammarMatcher, vocab_size: int, stop_token_ids: list[int], max_tokens: int = 64,
             max_width: int = 64) -> str | None:
    """Why no output satisfies ``matcher``'s grammar, proven by a search from its start, or None
    (an output was found, or the search could not tell). The search follows every allowed token
    while at most ``max_width`` are allowed and gives up on a wider state or after ``max_tokens``
    tokens in all: it proves emptiness only where the grammar dies within a narrow stretch
    (``[^\\s\\S]``, ``root ::= root``, a required property whose pattern matches nothing). The
    matcher is left somewhere in its grammar: use a fresh one."""
    import torch

    bitmask = torch.zeros(1, bitmask_words(vocab_size), dtype=torch.int32)
    stops = set(stop_token_ids)
    budget = max_tokens

    def search() -> bool | None:  # True: an output ends here or later; False: none does; None: unknown
        nonlocal budget
        bitmask.zero_()
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_token_ids(bitmask[0], vocab_size)
        if len(allowed) > max_width + len(stops):
            return None
        allowed = allowed.tolist()
        if any(t in stops and matcher.accept_token(t) for t in allowed):
            return True
        tokens = [t for t in allowed if t not in stops]
        if len(tokens) > max_width:
            return None
        result: bool | None = False
        for t in tokens:
            if budget == 0:
                return None
            budget -= 1
            if not matcher.accept_token(t):
                continue
            found = search()
            matcher.rollback(1)
            if found:
                return True
            if found is None:
                result = None
        return result

    if search() is False:
        if budget == max_tokens:
            return "no output satisfies it (no token can start it)"
        return f"no output satisfies it (every continuation comes to a dead end; searched {max_tokens - budget} tokens)"
    return None
