"""POST /v1/chat/completions: messages rendered by the model's chat template, ``n`` samples."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi.responses import Response

from paged.core.errors import InvalidRequestError
from paged.core.frontend.outputs import CompletionOutput
from paged.core.server.errors import from_exception, invalid
from paged.core.server.generation import ChoiceFormat, respond
from paged.core.server.protocol import ChatCompletionRequest, parse, sampling_params
from paged.core.server.state import ServerState
from paged.core.server.streaming import chat_logprobs


class ChatFormat(ChoiceFormat):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def preamble(self, n: int) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]

    def final_choice(self, index: int, c: CompletionOutput) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(self.tok, c.logprobs) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def delta_choice(self, index: int, c: CompletionOutput, new_logprobs: list | None) -> dict[str, Any]:
        delta = {"content": c.new_text} if c.new_text or not c.finished else {}
        logprobs = chat_logprobs(self.tok, new_logprobs) if new_logprobs is not None else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason}


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with each ``content`` made a string (text parts joined; null is empty)."""
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise invalid(f"messages[{k}]: must be an object with 'role' and 'content'", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    raise invalid(f"messages[{k}].content: only text parts are supported", "messages")
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise invalid(f"messages[{k}].content: must be a string or a list of text parts", "messages")
        out.append({**m, "content": content})
    return out


async def chat(state: ServerState, body: Any, tenant: str | None = None) -> Response:
    try:
        req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
        llm = state.require_llm()
        state.check_model(req.model)
        if req.tools:
            raise invalid("tools: not supported", "tools")
        if req.tool_choice not in (None, "none"):
            raise invalid("tool_choice: not supported", "tool_choice")
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise invalid("response_format: only {'type': 'text'} is supported", "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs: requires logprobs to be true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = sampling_params(req, max_tokens, logprobs)
        except InvalidRequestError as e:
            msg = str(e)
            if req.logprobs and msg.startswith("logprobs:"):
                raise invalid("top_logprobs:" + msg[len("logprobs:"):], "top_logprobs") from None
            raise
        if not req.messages:
            raise invalid("messages: must not be empty", "messages")
        prompt = llm.apply_chat_template(chat_messages(req.messages))
    except Exception as e:
        return from_exception(e).response()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await respond(state, ChatFormat(state.tokens), f"chatcmpl-{uuid.uuid4().hex}", [prompt], params,
                         req.priority, False, req.stream, include_usage, req.user or tenant, req.deadline_s)
