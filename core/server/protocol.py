"""Request bodies of the OpenAI API (pydantic models) and their translation to SamplingParams."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from paged.core.sampling_params import SamplingParams
from paged.core.server.errors import invalid


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CommonRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")
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
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    deadline_s: float | None = None  # seconds after arrival by which it should finish (policies)
    user: str | None = None  # the tenant, for fairness policies (else the X-Paged-Tenant header)
    # OpenAI fields accepted and ignored (they change nothing here)
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(CommonRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; the first pydantic error becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise invalid("request body: must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            msg = f"{loc}: unrecognized request argument"
        elif first["type"] == "missing":
            msg = f"{loc}: required"
        else:
            msg = f"{loc}: {first['msg']} (got {first.get('input')!r})"
        raise invalid(msg, str(first["loc"][0]) if first["loc"] else None) from None


def sampling_params(req: CommonRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options: only allowed when stream is true")
    if req.logit_bias:
        raise invalid("logit_bias: not supported")
    kw: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, logprobs=logprobs, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "stop", "stop_token_ids"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    return SamplingParams(**kw)
