"""POST /v1/chat/completions: messages rendered by the model's chat template, ``n`` samples."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from fastapi.responses import Response

from paged.core.errors import InvalidRequestError
from paged.core.frontend.outputs import CompletionOutput, RequestOutput
from paged.core.frontend.reasoning import ThinkParser, starts_in_reasoning
from paged.core.server.errors import from_exception, invalid
from paged.core.server.generation import ChoiceFormat, accept, respond
from paged.core.server.protocol import ChatCompletionRequest, ChatMessage, check_limits, sampling_params
from paged.core.server.state import ServerState
from paged.core.server.structured import check_compiles, constraint_field, structured_output_of
from paged.core.server.tool_calls import ToolCallShaper
from paged.core.frontend.tools import check_tools, tool_choice_mode, tool_constraint
from paged.core.server.streaming import chat_logprobs, prompt_logprobs_json


class ChatFormat(ChoiceFormat):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def preamble(self, n: int) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]

    def __init__(self, tokens, tools: ToolCallShaper, reasoning: bool | None = None) -> None:
        """``reasoning``: None when the output has no thinking block to take apart, else whether
        the prompt left one open (``paged.core.frontend.reasoning``)."""
        super().__init__(tokens)
        self.tools = tools
        self.reasoning = reasoning
        self.thinkers: dict[int, ThinkParser] = {}  # choice index -> streaming parser
        self.prompt_output: RequestOutput | None = None

    def see_prompt(self, i: int, out: RequestOutput) -> None:
        self.prompt_output = out

    def response_fields(self) -> dict[str, Any]:
        """vLLM's top-level ``prompt_logprobs`` (of the rendered conversation), when asked for."""
        out = self.prompt_output
        if out is None or out.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(self.tok, out.prompt_logprobs)}

    def final_choice(self, index: int, c: CompletionOutput) -> dict[str, Any]:
        reasoning = None
        if self.reasoning is not None:
            reasoning, content = ThinkParser.split(c.text, self.reasoning)
            c = replace(c, text=content)
        choice = self._final_choice(index, c)
        if reasoning is not None:
            choice["message"]["reasoning_content"] = reasoning
        return choice

    def _final_choice(self, index: int, c: CompletionOutput) -> dict[str, Any]:
        if self.tools.active:
            message, finish_reason = self.tools.message(c)
            return {"index": index, "message": message,
                    "logprobs": chat_logprobs(self.tok, c.logprobs) if c.logprobs is not None else None,
                    "finish_reason": finish_reason, "stop_reason": c.stop_reason}
        return {"index": index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(self.tok, c.logprobs) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def delta_choice(self, index: int, c: CompletionOutput, new_logprobs: list | None) -> dict[str, Any]:
        logprobs = chat_logprobs(self.tok, new_logprobs) if new_logprobs is not None else None
        reasoning = ""
        if self.reasoning is not None:
            reasoning, c = self.thinkers.setdefault(index, ThinkParser(self.reasoning)).take(c)
        if self.tools.active:
            delta, finish_reason = self.tools.delta(index, c)
        else:
            delta = {"content": c.new_text} if c.new_text or not (c.finished or reasoning) else {}
            finish_reason = c.finish_reason
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """What the chat template sees: role (developer rendered as system), content as a string
    (text parts joined; null is empty) and, when set, an assistant's ``tool_calls`` and a tool
    result's ``tool_call_id`` (required, as OpenAI does) and ``name`` (for tool-calling templates)."""
    out = []
    for k, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "text" and isinstance(part.get("text"), str) and set(part) == {"type", "text"}:
                    parts.append(part["text"])
                else:
                    raise invalid(f"messages[{k}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                  "are supported", "messages")
            content = "".join(parts)
        if m.role == "tool" and m.tool_call_id is None:
            raise invalid(f"messages[{k}].tool_call_id: required in a message of role 'tool' (the id of the "
                          "assistant's tool call it answers)")
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


async def chat(state: ServerState, body: Any, tenant: str | None = None) -> Response:
    try:
        req, llm = accept(state, ChatCompletionRequest, body)
        prompt, params, shaper = await prepare_chat(state, req, llm)
    except Exception as e:
        return from_exception(e).response()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    chat_format = ChatFormat(state.tokens, shaper, reasoning_start(state, shaper, prompt, params))
    return await respond(state, chat_format, f"chatcmpl-{uuid.uuid4().hex}", [prompt], params,
                         req.priority, False, req.stream, include_usage, state.config.server.chat_default_max_tokens,
                         tenant=req.user or tenant, deadline_s=req.deadline_s, llm=llm, model=req.model)


def reasoning_start(state: ServerState, shaper: ToolCallShaper, prompt: str, params: Any) -> bool | None:
    """None when the output has no thinking block to take apart, else whether the prompt left one
    open. None without a reasoning parser, for a forced tool call, and for a JSON constraint
    (``json_schema``, ``json_object``): these constrain the output from its first token (not from
    the end of the thinking, as vLLM's reasoning-aware structured outputs do), so it is all JSON,
    content even where the prompt left a block open."""
    if state.reasoning_parser is None or shaper.mode not in ("none", "auto"):
        return None
    constraint = params.structured_output
    if constraint is not None and (constraint.json_schema is not None or constraint.json_object):
        return None
    return starts_in_reasoning(prompt)


async def prepare_chat(state: ServerState, req: ChatCompletionRequest, llm) -> tuple[str, Any, ToolCallShaper]:
    """A validated chat request's prompt (rendered by the template), sampling parameters (with
    any structured-output or tool constraint) and tool-call shaper; raises a 400 for what is
    wrong (also what /v1/responses turns its requests into)."""
    tools = check_tools(req.tools) if req.tools is not None else None
    tool_mode, tool_name = tool_choice_mode(req.tool_choice, tools)
    validate = llm.input_processor.validate_structured_output
    constraint = structured_output_of(req, req.response_format, validate)
    forced = tool_constraint(tool_mode, tool_name, tools, req.parallel_tool_calls is not False) if tools else None
    if forced is not None:
        if constraint is not None:
            raise invalid(f"tool_choice: {req.tool_choice!r} cannot be combined with another structured-output "
                          "constraint (response_format, structured_outputs, guided_*)", "tool_choice")
        try:
            validate(forced)
        except InvalidRequestError as e:
            raise invalid(f"tools: a function's parameters cannot be used as a constraint: {e}", "tools") from None
        constraint = forced
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs: requires logprobs to be true", "top_logprobs")
    check_limits(req, state.config.server, 1)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = llm.default_sampling.get("max_tokens")  # the model's max_new_tokens, if it sets one
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        params = sampling_params(req, max_tokens, logprobs, llm.default_sampling)
    except InvalidRequestError as e:
        msg = str(e)
        if req.logprobs and msg.startswith("logprobs:"):
            raise invalid("top_logprobs:" + msg[len("logprobs:"):], "top_logprobs") from None
        raise
    if constraint is not None:
        params = params.copy(structured_output=constraint)
    if req.prompt_logprobs is not None:
        if req.stream:
            raise invalid("prompt_logprobs: not available when stream is true", "prompt_logprobs")
        params = params.copy(prompt_logprobs=req.prompt_logprobs)
    if not req.messages:
        raise invalid("messages: must not be empty", "messages")
    if forced is not None:
        try:
            await validate.check_async(forced, llm.model_info)
        except InvalidRequestError as e:
            raise invalid(f"tools: a function's parameters cannot be used as a constraint: {e}", "tools") from None
    elif constraint is not None:
        await check_compiles(llm, constraint, constraint_field(req, req.response_format))
    prompt = await state.inputs.render_chat(chat_messages(req.messages), tools if tool_mode != "none" else None,
                                            req.chat_template_kwargs)
    # the model family's parser, found at start-up (only a request with tools needs it)
    shaper = ToolCallShaper(tool_mode, tool_name, state.tool_parser if tool_mode != "none" else None)
    if tool_mode == "auto" and getattr(state.tool_parser, "keeps_special_tokens", False):
        params = params.copy(skip_special_tokens=False)
    return prompt, params, shaper
