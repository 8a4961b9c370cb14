"""Structured outputs in the OpenAI API: ``response_format`` (chat) and vLLM's extras
(``structured_outputs``, ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, both endpoints) become one ``StructuredOutputParams``; errors name the
field the client sent."""

from __future__ import annotations

from typing import Any, Callable

from paged.core.errors import InvalidRequestError
from paged.core.server.errors import invalid
from paged.core.structured_output import StructuredOutputParams

# vLLM's structured_outputs keys -> StructuredOutputParams fields
_VLLM_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
              "grammar": "grammar"}
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _from_response_format(rf: Any) -> dict[str, Any] | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("response_format: must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"json_object": True}
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise invalid("response_format.json_schema: must be {'name': ..., 'schema': {...}, 'strict': ...}")
    return {"json_schema": spec.get("schema", {})}


def structured_output_of(req: Any, response_format: Any = None,
                         validate: Callable[[StructuredOutputParams], None] | None = None) -> StructuredOutputParams | None:
    """The request's constraint (at most one source), checked by ``validate`` (the front-end's
    bounded check) when given; raises a 400 naming the field the client used."""
    found = _source(req, response_format)
    if found is None:
        return None
    name, fields = found
    try:
        params = StructuredOutputParams(**fields)
        if validate is not None:
            validate(params)
    except InvalidRequestError as e:
        raise invalid(f"{name}: {e}", name) from None
    return params


def constraint_field(req: Any, response_format: Any = None) -> str | None:
    """The request field that carries its constraint (for errors), if any."""
    found = _source(req, response_format)
    return found[0] if found else None


async def check_compiles(llm: Any, params: StructuredOutputParams, field: str) -> None:
    """The engine's full check of a constraint (compiled for the model in a worker process,
    within a time limit; paged.core.constraint_check), off the event loop; raises a 400 naming
    ``field``."""
    try:
        await llm.input_processor.validate_structured_output.check_async(params, llm.model_info)
    except InvalidRequestError as e:
        raise invalid(f"{field}: {e}", field) from None


def _source(req: Any, response_format: Any) -> tuple[str, dict[str, Any]] | None:
    """(field name, StructuredOutputParams fields) of the request's one constraint, or None."""
    sources: dict[str, dict[str, Any]] = {}
    if response_format is not None:
        found = _from_response_format(response_format)
        if found:
            sources["response_format"] = found
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict) or set(so) - set(_VLLM_KEYS):
            raise invalid(f"structured_outputs: must be an object with one of {sorted(_VLLM_KEYS)}, got {so!r}")
        sources["structured_outputs"] = {_VLLM_KEYS[k]: v for k, v in so.items() if v is not None}
    for name, field in _GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            sources[name] = {field: value}
    if not sources:
        return None
    if len(sources) > 1:
        raise invalid(f"{sorted(sources)[1]}: only one structured-output constraint per request (also got "
                      f"{sorted(sources)[0]})")
    return next(iter(sources.items()))
