"""POST /v1/completions: one or several prompts (text or token ids), ``n`` samples each."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi.responses import Response

from paged.core.frontend.outputs import CompletionOutput
from paged.core.server.errors import from_exception, invalid
from paged.core.server.generation import ChoiceFormat, accept, respond
from paged.core.server.protocol import CompletionRequest, check_limits, sampling_params
from paged.core.server.state import ServerState
from paged.core.server.structured import check_compiles, constraint_field, structured_output_of
from paged.core.server.streaming import completion_logprobs


class CompletionFormat(ChoiceFormat):
    object_name = chunk_object = "text_completion"

    def __init__(self, tokens) -> None:
        super().__init__(tokens)
        self.text_offsets: dict[int, int] = {}  # choice index -> length of the text streamed so far

    def final_choice(self, index: int, c: CompletionOutput) -> dict[str, Any]:
        return {"index": index, "text": c.text,
                "logprobs": completion_logprobs(self.tok, c.logprobs, 0) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def delta_choice(self, index: int, c: CompletionOutput, new_logprobs: list | None) -> dict[str, Any]:
        logprobs = None
        if new_logprobs is not None:
            logprobs = completion_logprobs(self.tok, new_logprobs, self.text_offsets.get(index, 0))
        self.text_offsets[index] = self.text_offsets.get(index, 0) + len(c.new_text)
        return {"index": index, "text": c.new_text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason if c.finished else None}


def prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt: must not be empty")
    if isinstance(prompt[0], int):
        return [prompt]
    if any(not p for p in prompt):
        raise invalid("prompt: must not contain an empty prompt")
    return list(prompt)


async def completions(state: ServerState, body: Any, tenant: str | None = None) -> Response:
    try:
        req, llm = accept(state, CompletionRequest, body)
        defaults = llm.default_sampling  # the model's generation_config.json
        if req.echo:
            raise invalid("echo: not supported", "echo")
        if req.suffix:
            raise invalid("suffix: not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise invalid(f"best_of: only best_of == n is supported (got {req.best_of}, n={req.n})", "best_of")
        prompts = prompt_list(req.prompt)
        check_limits(req, state.config.server, len(prompts))
        max_tokens = defaults.get("max_tokens", 16) if req.max_tokens is None else req.max_tokens
        params = sampling_params(req, max_tokens, req.logprobs, defaults)
        constraint = structured_output_of(req, validate=llm.input_processor.validate_structured_output)
        if constraint is not None:
            params = params.copy(structured_output=constraint)
            await check_compiles(llm, constraint, constraint_field(req))
    except Exception as e:
        return from_exception(e).response()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await respond(state, CompletionFormat(state.tokens), f"cmpl-{uuid.uuid4().hex}", prompts, params,
                         req.priority, True, req.stream, include_usage, tenant=req.user or tenant,
                         deadline_s=req.deadline_s, llm=llm)
