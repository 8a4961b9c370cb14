"""The request lifecycle shared by /v1/completions and /v1/chat/completions: add the requests,
then either collect the final outputs into one JSON response or stream them as server-sent
events. The endpoints differ only in how a choice is shaped (a ``ChoiceFormat``).

Choice indices: prompt ``i``'s sample ``j`` is choice ``i * n + j``."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response

from paged.core.frontend.async_llm import AsyncLLM
from paged.core.frontend.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from paged.core.lora import LoRARequest
from paged.core.sampling_params import SamplingParams
from paged.core.server.errors import from_exception, rejection, shutting_down
from paged.core.server.protocol import parse
from paged.core.server.state import ServerState
from paged.core.server.streaming import DONE, EventStream, Tokens, first_or_error, merged, sse, usage


class ChoiceFormat:
    """How one endpoint shapes its choices; one instance per request (it may keep state)."""

    object_name = ""  # the non-streamed response's "object"
    chunk_object = ""  # each streamed chunk's "object"

    def __init__(self, tokens: Tokens) -> None:
        self.tok = tokens

    def preamble(self, n: int) -> list[dict[str, Any]]:
        """Choices of a first chunk sent before any token (none by default)."""
        return []

    def final_choice(self, index: int, c: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def delta_choice(self, index: int, c: CompletionOutput, new_logprobs: list | None) -> dict[str, Any]:
        """A streamed chunk's choice: ``c`` holds this step's increments (``new_text``,
        ``new_token_ids``, their ``new_logprobs``)."""
        raise NotImplementedError

    def see_prompt(self, i: int, out: RequestOutput) -> None:
        """Prompt ``i``'s output, handed over before its choices are shaped (its prompt text and
        prompt logprobs, for ``echo`` and ``prompt_logprobs``)."""

    def completion_tokens(self, token_ids: list[int]) -> int:
        """The usage's count of generated tokens in ``token_ids``."""
        return len(token_ids)

    def response_fields(self) -> dict[str, Any]:
        """Top-level fields a non-streamed response adds."""
        return {}


def accept(state: ServerState, request_type: type, body: Any) -> tuple[Any, AsyncLLM]:
    """The parsed request and the engine that serves it, if the engine runs and the request
    names the served model (the request's one look at ``require_llm``)."""
    req = parse(request_type, body)
    llm = state.require_llm()
    state.check_model(req.model)
    return req, llm


async def start(state: ServerState, llm: AsyncLLM, request_id: str, prompts: list, params: SamplingParams,
                priority: int, add_special_tokens: bool, output_kind: RequestOutputKind,
                default_max_tokens: int | None = None, tenant: str | None = None,
                deadline_s: float | None = None, lora_request: LoRARequest | None = None) -> list:
    """One engine request per prompt (each with ``params.n`` samples); all closed if one fails.
    Text prompts are tokenized off the event loop first. ``default_max_tokens`` caps a request
    that sets no max_tokens (at what still fits in max_model_len after the prompt); ``tenant``
    and ``deadline_s`` are for the scheduling policy."""
    token_ids = await state.inputs.tokenize(prompts, add_special_tokens)
    if state.draining:  # the tokenizer's thread may have taken a while: no new request now
        raise shutting_down()
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            prompt_params = params
            if params.max_tokens is None and default_max_tokens is not None:
                room = llm.model_info.max_model_len - len(prompt if token_ids[i] is None else token_ids[i])
                prompt_params = params.copy(max_tokens=max(1, min(default_max_tokens, room)))
            streams.append(await llm.add_request(rid, prompt, prompt_params, priority,
                                                 add_special_tokens=add_special_tokens, prompt_token_ids=token_ids[i],
                                                 tenant=tenant, deadline_s=deadline_s, output_kind=output_kind,
                                                 lora_request=lora_request))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def respond(state: ServerState, fmt: ChoiceFormat, request_id: str, prompts: list, params: SamplingParams,
                  priority: int, add_special_tokens: bool, stream: bool, include_usage: bool,
                  default_max_tokens: int | None = None, tenant: str | None = None,
                  deadline_s: float | None = None, *, llm: AsyncLLM, model: str | None = None) -> Response:
    """Streamed, each request's increments (DELTA) become chunks as they come; otherwise each
    request's one final output (FINAL_ONLY) becomes its choices. ``model``: the request's (a LoRA
    adapter's name runs that adapter)."""
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        streams = await start(state, llm, request_id, prompts, params, priority, add_special_tokens, kind,
                              default_max_tokens, tenant, deadline_s, state.lora_of(model))
    except Exception as e:
        return from_exception(e).response()
    head = {"id": request_id, "object": fmt.object_name, "created": int(time.time()),
            "model": state.model_name(model)}
    n = params.n
    it = merged(streams, state.open_merges)

    if not stream:
        final: dict[int, RequestOutput] = {}
        try:
            async for i, out in it:
                final[i] = out
        except Exception as e:
            return from_exception(e).response()
        if (error := rejection(final.values())) is not None:
            return error.response()
        choices, completion_tokens = [], 0
        for i in range(len(prompts)):
            fmt.see_prompt(i, final[i])
            for c in final[i].outputs:
                completion_tokens += fmt.completion_tokens(c.token_ids)
                choices.append(fmt.final_choice(i * n + c.index, c))
        prompt_tokens = sum(len(final[i].prompt_token_ids) for i in range(len(prompts)))
        return JSONResponse({**head, "choices": choices, "usage": usage(prompt_tokens, completion_tokens),
                             **fmt.response_fields()})

    first = await first_or_error(it)
    if isinstance(first, Response):
        return first
    if (error := rejection([first[1]])) is not None:
        await it.aclose()
        return error.response()
    head["object"] = fmt.chunk_object

    def chunk(choices: list, usage_: Any = ...) -> bytes:
        data = {**head, "choices": choices}
        if usage_ is not ...:
            data["usage"] = usage_
        elif include_usage:
            data["usage"] = None
        return sse(data)

    async def events() -> AsyncIterator[bytes]:
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        try:
            preamble = fmt.preamble(n)
            if preamble:
                yield chunk(preamble)
            item = first
            while item is not None:
                i, out = item  # DELTA: only the samples that changed, each with its increments
                if any(c.finish_reason == "error" for c in out.outputs):  # a plugin failed on it: say so, end
                    yield sse(rejection([out]).body())
                    break
                prompt_tokens[i] = len(out.prompt_token_ids)
                fmt.see_prompt(i, out)
                choices = []
                for c in out.outputs:
                    completion_tokens += fmt.completion_tokens(c.new_token_ids)
                    if not c.new_text and not c.new_token_ids and not c.finished:
                        continue
                    choices.append(fmt.delta_choice(i * n + c.index, c, c.logprobs))
                if choices:
                    yield chunk(choices)
                item = await anext(it, None)
            if include_usage:
                yield chunk([], usage(sum(prompt_tokens.values()), completion_tokens))
        except Exception as e:
            yield sse(from_exception(e).body())
        finally:
            await it.aclose()
        yield DONE

    return EventStream(events(), media_type="text/event-stream")
