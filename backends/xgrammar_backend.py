"""The xgrammar structured-output backend: compiled grammars with precomputed token masks
(a pushdown automaton per request), cached by the core per constraint."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from paged.core.structured_output import GrammarMatcher, StructuredOutputBackend, StructuredOutputParams, choice_regex


class XGrammarOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    any_whitespace: bool = Field(
        False, description="JSON may hold any whitespace (off: compact JSON, which small models cannot pad forever)"
    )
    compile_threads: int = Field(2, gt=0, description="threads xgrammar uses inside one compilation")


def _grammar_of(params: StructuredOutputParams, options: XGrammarOptions):
    """The constraint as an uncompiled xgrammar Grammar (raises on a bad constraint)."""
    import xgrammar as xgr

    kind = params.kind
    # The separators json.dumps writes (what models mostly saw); any_whitespace ignores them.
    json_format = {"any_whitespace": options.any_whitespace, "separators": (", ", ": ")}
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(json.dumps(params.json_schema), **json_format)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **json_format)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_regex(choice_regex(params.choice))
    return xgr.Grammar.from_ebnf(params.grammar)


def validate(params: StructuredOutputParams, options: XGrammarOptions | None = None) -> None:
    try:
        _grammar_of(params, options or XGrammarOptions())
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise ValueError(f"structured_output.{params.kind}: xgrammar cannot use it: {_first_line(e)}") from None


def _first_line(error: BaseException) -> str:
    """The parser's message without xgrammar's "[time] source.cc:line:" prefix."""
    text = str(error).strip() or type(error).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text.splitlines()[0])[:500]


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def reset(self) -> None:
        self._m.reset()

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class XGrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], options: XGrammarOptions | None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.options = options or XGrammarOptions()
        self.eos_token_ids = list(eos_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.eos_token_ids or None)
        # The core caches per constraint already; xgrammar's own cache would hold a second copy.
        self.compiler = xgr.GrammarCompiler(info, max_threads=self.options.compile_threads, cache_enabled=False)

    def compile(self, params: StructuredOutputParams) -> Any:
        try:
            return self.compiler.compile_grammar(_grammar_of(params, self.options))
        except Exception as e:
            raise ValueError(f"structured_output.{params.kind}: xgrammar cannot compile it: {_first_line(e)}") from None

    def matcher(self, compiled: Any) -> GrammarMatcher:
        stop = self.eos_token_ids or None
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled, override_stop_tokens=stop))
