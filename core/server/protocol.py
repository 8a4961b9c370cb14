"""Request bodies of the OpenAI API (strict pydantic models, as strict as OpenAI's own parser:
no coercion, so ``"stream": "yes"`` and ``"prompt": [true]`` are errors), the server's request
limits, and the translation to SamplingParams."""

from __future__ import annotations

import reprlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from paged.core.config import ServerConfig
from paged.core.frontend.processor import MAX_TENANT_LEN
from paged.core.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from paged.core.server.errors import invalid

STRICT_MODEL = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT_MODEL
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CommonRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = STRICT_MODEL
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extras (as vLLM accepts them)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # top-k logprobs of each prompt token (vLLM's extra)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    deadline_s: float | None = None  # seconds after arrival by which it should finish (policies)
    user: str | None = None  # the tenant, for fairness policies (else the X-Paged-Tenant header)
    # structured outputs, as vLLM accepts them (see paged.core.server.structured)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI fields accepted and ignored (they change nothing here)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    """One message. ``developer`` is OpenAI's newer name for ``system`` and is rendered as one.
    The fields a client echoes back from an assistant message are accepted and not rendered."""

    model_config = STRICT_MODEL
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = None
    refusal: str | None = None


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    # vLLM's extra: variables for the chat template, e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None


_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother, _short.maxlong = 3, 60, 60, 40


def short_repr(value: Any) -> str:
    """A bounded repr for error messages (the value may be huge or deeply nested)."""
    return _short.repr(value)


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; the first pydantic error becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise invalid("request body: must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        # Drop the union-member tags pydantic puts in the location ("prompt.list[int].0").
        loc = [str(p) for p in first["loc"] if isinstance(p, int) or p.isidentifier()]
        where = ".".join(loc) or "body"
        if first["type"] == "extra_forbidden":
            msg = f"{where}: unrecognized request argument"
        elif first["type"] == "missing":
            msg = f"{where}: required"
        else:
            msg = f"{where}: {first['msg']} (got {short_repr(first.get('input'))})"
        raise invalid(msg, loc[0] if loc else None) from None


TENANT_HEADER = "X-Paged-Tenant"


def tenant_header(value: str | None) -> str | None:
    """The ``X-Paged-Tenant`` header (the tenant when the body sets no ``user``), checked like ``user``."""
    if value is not None and len(value) > MAX_TENANT_LEN:
        raise invalid(f"{TENANT_HEADER}: header value {short_repr(value)} has {len(value)} characters; at most "
                      f"{MAX_TENANT_LEN} are accepted", TENANT_HEADER)
    return value


def check_limits(req: CommonRequest, limits: ServerConfig, num_prompts: int) -> None:
    """The server's caps on what one request may ask for, checked before anything is built."""
    if req.n > limits.max_n:
        raise invalid(f"n: invalid value {req.n}; at most {limits.max_n} (server.max_n)")
    if req.n > 0 and req.n * num_prompts > limits.max_samples_per_request:
        raise invalid(f"n: n x prompts = {req.n} x {num_prompts} exceeds {limits.max_samples_per_request} "
                      "(server.max_samples_per_request)")
    for name in ("stop", "stop_token_ids", "bad_words"):
        value = getattr(req, name)
        if isinstance(value, list) and len(value) > limits.max_stop:
            raise invalid(f"{name}: {len(value)} entries; at most {limits.max_stop} (server.max_stop)")


def sampling_params(req: CommonRequest, max_tokens: int | None, logprobs: int | None,
                    defaults: dict[str, Any] | None = None) -> SamplingParams:
    """``defaults``: the model's generation_config sampling (``AsyncLLM.default_sampling``), for
    the fields the request leaves unset; the caller applies its ``max_tokens``."""
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options: only allowed when stream is true")
    if req.logit_bias:
        bad_keys = [k for k in req.logit_bias if not k.strip().isdigit()]
        if bad_keys:
            raise invalid(f"logit_bias: key {short_repr(bad_keys[0])} is not a token id (a string of digits, "
                          "as OpenAI's API takes them)", "logit_bias")
    kw: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
    kw.update(
        n=req.n, max_tokens=max_tokens, logprobs=logprobs, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    return SamplingParams(**kw)
