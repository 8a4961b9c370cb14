"""The llguidance structured-output backend: an Earley parser over a lazily built lexer, with
token masks computed per step from a token trie (no precompilation of masks)."""

from __future__ import annotations

import json
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from paged.core.structured_output import (GrammarMatcher, StructuredOutputBackend, StructuredOutputParams,
                                          allowed_token_ids)


class LLGuidanceOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    whitespace_flexible: bool = Field(
        False, description="JSON may hold any whitespace (off: compact JSON, which small models cannot pad forever)"
    )


def _grammar_of(params: StructuredOutputParams, options: LLGuidanceOptions) -> str:
    """The constraint as an llguidance grammar definition (not yet checked)."""
    from llguidance import LLMatcher, grammar_from

    # The separators json.dumps writes (what models mostly saw).
    overrides = {"whitespace_flexible": options.whitespace_flexible, "item_separator": ", ", "key_separator": ": "}
    kind = params.kind
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(json.dumps(params.json_schema), overrides=overrides)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=overrides)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return grammar_from("choice", json.dumps(params.choice))
    return grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark


def _check(params: StructuredOutputParams, options: LLGuidanceOptions, tokenizer=None) -> str:
    from llguidance import LLMatcher

    try:
        grammar = _grammar_of(params, options)
    except Exception as e:
        raise ValueError(f"structured_output.{params.kind}: llguidance cannot use it: {e}") from None
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"structured_output.{params.kind}: llguidance cannot use it: {error.splitlines()[0][:500]}")
    return grammar


def validate(params: StructuredOutputParams, options: LLGuidanceOptions | None = None) -> None:
    _check(params, options or LLGuidanceOptions())


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher, stop_token_ids=()) -> None:
        from llguidance.torch import fill_next_token_bitmask

        self._m = matcher
        self._fill = fill_next_token_bitmask
        self._stops = frozenset(stop_token_ids)
        self._ended = False  # a stop token was accepted: the grammar constrains nothing more
        # ... after the grammar had stopped: llguidance took it without counting it, so a
        # rollback must not count it either
        self._uncounted_stop = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._fill(self._m, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self._m.is_stopped():  # the grammar is complete: only a stop token is left
            # consume_token of any other token would put the matcher in its error state, which
            # no rollback leaves (speculative drafts do run past a grammar's end)
            if self._stops and token_id not in self._stops:
                return False
            if self._m.consume_token(token_id):
                self._ended = self._uncounted_stop = True
                return True
            return False
        # consume_token leaves the matcher in its error state on a refused token: check first.
        if self._m.validate_tokens([token_id]) == 1 and self._m.consume_token(token_id):
            self._ended = token_id in self._stops
            return True
        return False

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._ended:
            self._ended = False
            if self._uncounted_stop:
                self._uncounted_stop = False
                num_tokens -= 1
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def reset(self) -> None:
        self._ended = self._uncounted_stop = False
        self._m.reset()

    def is_terminated(self) -> bool:
        return self._ended


class LLGuidanceBackend(StructuredOutputBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], options: LLGuidanceOptions | None) -> None:
        from llguidance import LLMatcher
        from llguidance.hf import from_tokenizer

        self._LLMatcher = LLMatcher
        self.options = options or LLGuidanceOptions()
        self._stop_token_ids = tuple(eos_token_ids)
        self.tokenizer = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)

    def compile(self, params: StructuredOutputParams) -> Any:
        return _check(params, self.options, self.tokenizer)

    def check_compiled(self, compiled: Any, vocab_size: int, stop_token_ids: list[int],
                       max_tokens: int = 4) -> str | None:
        """llguidance stops with an error where no token can follow (an empty language stops at
        once) or where one of its limits is hit (lexer size, parser items), which it finds only
        when masks are computed: this follows the lowest allowed token for a few steps. (Its
        stopped matcher still accepts a stop token, so the default search cannot tell.)"""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        m = self._LLMatcher(self.tokenizer, compiled, log_level=0)
        bitmask = allocate_token_bitmask(1, vocab_size)
        stops = set(stop_token_ids)
        for step in range(max_tokens + 1):
            if step:
                tokens = [t for t in allowed_token_ids(bitmask[0], vocab_size).tolist() if t not in stops]
                if not tokens:
                    return None  # only a stop token is left: it can end
                m.consume_token(tokens[0])
            if not m.is_error():
                fill_next_token_bitmask(m, bitmask, 0)
            if m.is_error():
                error = m.get_error().splitlines()[0][:500]
                if step == 0 and error.startswith("NoExtensionBias"):
                    return "no output satisfies it (no token can start it)"
                return f"llguidance fails on it after {step} token(s): {error}"
            if m.is_stopped():
                return None
        return None

    def matcher(self, compiled: Any) -> GrammarMatcher:
        m = self._LLMatcher(self.tokenizer, compiled, log_level=0)
        if m.is_error():
            raise ValueError(f"structured_output: llguidance cannot use it: {m.get_error().splitlines()[0][:500]}")
        return LLGuidanceMatcher(m, self._stop_token_ids)
