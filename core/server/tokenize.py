"""POST /tokenize and POST /detokenize, with vLLM's request and response shapes.

/tokenize takes either ``prompt`` (text, ``add_special_tokens`` default true) or ``messages``
(rendered by the chat template exactly as /v1/chat/completions renders them, then tokenized
without adding special tokens again, as vLLM does) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}`` (``token_strs`` only with ``return_token_strs``). /detokenize takes
``tokens`` and answers ``{"prompt"}``. Both run on the tokenizer's worker thread."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from paged.core.server.chat import chat_messages
from paged.core.server.errors import invalid
from paged.core.server.generation import accept
from paged.core.server.protocol import STRICT_MODEL, ChatMessage
from paged.core.server.state import ServerState
from paged.core.frontend.tools import check_tools


class TokenizeRequest(BaseModel):
    model_config = STRICT_MODEL
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = STRICT_MODEL
    model: str | None = None
    tokens: list[int]


async def tokenize(state: ServerState, body: Any) -> dict[str, Any]:
    req, llm = accept(state, TokenizeRequest, body)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("prompt: exactly one of prompt and messages is required", "prompt")
    inputs = state.inputs
    if req.messages is not None:
        if not req.messages:
            raise invalid("messages: must not be empty", "messages")
        if not req.add_generation_prompt:
            raise invalid("add_generation_prompt: only true is supported (the prompt a chat completion sees)",
                          "add_generation_prompt")
        tools = check_tools(req.tools) if req.tools is not None else None
        text = await inputs.render_chat(chat_messages(req.messages), tools, req.chat_template_kwargs)
        add_special = bool(req.add_special_tokens)  # the template wrote them already
    else:
        inputs.check_length("prompt", len(req.prompt))
        text = req.prompt
        add_special = req.add_special_tokens is not False
    tokenizer = llm.tokenizer

    def work() -> tuple[list[int], list[str] | None]:
        ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
        return ids, (tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None)

    ids, strs = await inputs.run(work)
    return {"count": len(ids), "max_model_len": llm.model_info.max_model_len, "tokens": ids, "token_strs": strs}


async def detokenize(state: ServerState, body: Any) -> dict[str, Any]:
    req, llm = accept(state, DetokenizeRequest, body)
    vocab = llm.model_info.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise invalid(f"tokens: token ids {bad[:5]} out of range; token ids must be in [0, {vocab})", "tokens")
    if len(req.tokens) > llm.model_info.max_model_len:
        raise invalid(f"tokens: {len(req.tokens)} ids; at most max_model_len ({llm.model_info.max_model_len})",
                      "tokens")
    tokenizer = llm.tokenizer
    text = await state.inputs.run(lambda: tokenizer.decode(req.tokens))
    return {"prompt": text}
