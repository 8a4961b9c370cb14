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


# JSON-schema keywords that xgrammar (0.2) drops without an error, so that its output can break
# the schema: measured (a violating instance is accepted) and as its docs' "Supported JSON
# Schema" says. Where it also warns, the front-end's check refuses the warning too.
_IGNORED = {"not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
            "minContains", "maxContains", "$dynamicRef", "$recursiveRef"}
# A node with one of these is that keyword alone to xgrammar: the node's other keywords are dropped.
_EXCLUSIVE = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
# Type-specific keywords, by the type they apply to.
_TYPED = {"string": {"minLength", "maxLength", "pattern", "format"},
          "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
          "object": {"properties", "required", "additionalProperties", "unevaluatedProperties", "minProperties",
                     "maxProperties", "patternProperties", "propertyNames"},
          "array": {"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems"}}
_TYPE_OF = {k: t for t, keys in _TYPED.items() for k in keys}
# Without "type", xgrammar infers object or array from these; other type-specific keywords are dropped.
_INFERS_TYPE = {"properties", "additionalProperties", "unevaluatedProperties", "items", "prefixItems",
                "unevaluatedItems"}
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "null": (type(None),), "object": (dict,), "array": (list,)}
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SUBSCHEMAS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _has_type(value: Any, type_: Any) -> bool:
    types = type_ if isinstance(type_, list) else [type_]
    return any(isinstance(value, _JSON_TYPES.get(t, ())) and not (t != "boolean" and isinstance(value, bool))
               for t in types if isinstance(t, str))


def _ignored_keyword(node: dict) -> str | None:
    """Why xgrammar would drop part of this schema node (not its subschemas), or None."""
    ignored = sorted(_IGNORED & node.keys()) or (["uniqueItems"] if node.get("uniqueItems") is True else [])
    if ignored:
        return f"{ignored[0]!r} is not supported by xgrammar (it would be ignored); remove it"
    ref = node.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/"))):
        return f"'$ref' {ref!r}: only local references ('#' or '#/$defs/...') are supported"
    if "multipleOf" in node and node.get("type") != "integer":
        return "'multipleOf' is supported by xgrammar only with \"type\": \"integer\""
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' with more than one subschema is not supported by xgrammar; merge them into one"
    exclusive = [k for k in _EXCLUSIVE if k in node]
    if exclusive:
        first = exclusive[0]
        for key in exclusive[1:] + sorted((node.keys() & _TYPE_OF.keys()) | ({"type"} & node.keys())):
            if key == "type" and first in ("enum", "const"):
                values = node[first] if first == "enum" and isinstance(node[first], list) else [node[first]]
                if all(_has_type(v, node["type"]) for v in values):
                    continue  # e.g. {"enum": ["a", "b"], "type": "string"}: the type adds nothing
            return (f"{key!r} next to {first!r} would be ignored (xgrammar uses only {first!r} there); drop it "
                    f"or move it inside")
    elif "type" not in node and not node.keys() & _INFERS_TYPE:
        untyped = sorted(node.keys() & _TYPE_OF.keys())
        if untyped:
            key = untyped[0]
            return f"{key!r} without a \"type\" would be ignored by xgrammar; add \"type\": \"{_TYPE_OF[key]}\""
    return None


def unsupported_keyword(schema: dict) -> str | None:
    """The first place where xgrammar would silently ignore part of ``schema``, as
    ``"<where>: <why>"``, or None. Walks every subschema once (iteratively)."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        problem = _ignored_keyword(node)
        if problem:
            return f"{'at ' + path if path else 'at the top'}: {problem}"
        children = [(k, node.get(k)) for k in _SUBSCHEMA]
        children += [(f"{k}[{i}]", v) for k in _SUBSCHEMAS if isinstance(node.get(k), list)
                     for i, v in enumerate(node[k])]
        children += [(f"{k}.{name}", v) for k in _SUBSCHEMA_MAPS if isinstance(node.get(k), dict)
                     for name, v in node[k].items()]
        stack += [(f"{path}.{k}" if path else k, v) for k, v in reversed(children) if isinstance(v, dict)]
    return None


def _grammar_of(params: StructuredOutputParams, options: XGrammarOptions):
    """The constraint as an uncompiled xgrammar Grammar (raises on a bad constraint)."""
    import xgrammar as xgr

    kind = params.kind
    # The separators json.dumps writes (what models mostly saw); any_whitespace ignores them.
    json_format = {"any_whitespace": options.any_whitespace, "separators": (", ", ": ")}
    if kind == "json_schema":
        problem = unsupported_keyword(params.json_schema)
        if problem:
            raise ValueError(problem)
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
