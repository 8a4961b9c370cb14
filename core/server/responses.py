"""The Responses API: ``POST /v1/responses`` (streamed or not), ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel`` and ``DELETE /v1/responses/{id}``.

A request becomes a chat request: ``instructions`` a system message, ``input`` (a string, or
message / ``function_call`` / ``function_call_output`` items) the messages after the stored
conversation of ``previous_response_id``, ``text.format`` the structured-output constraint,
function ``tools`` and ``tool_choice`` chat's tools; it is then checked, rendered and run exactly as
/v1/chat/completions would run it (``chat.prepare_chat``). The output is a ``message`` item with
the text and one ``function_call`` item per tool call, after a ``reasoning`` item (its text as
``reasoning_text`` content, no summary) when the model thinks (``server.reasoning_parser``, as
chat's ``reasoning_content``). Streamed, the official events come in
order: ``response.created``, ``response.in_progress``, per item ``response.output_item.added`` ...
``response.output_item.done`` (text through ``response.content_part.added``,
``response.output_text.delta`` / ``.done``, ``response.content_part.done``; reasoning through
``response.reasoning_text.delta`` / ``.done``; calls through
``response.function_call_arguments.delta`` / ``.done``), then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it, ``response.failed`` on an error).

Stored responses (``store``, default true) are kept in memory, the newest
``server.max_stored_responses`` of them, with the conversation that led to each, for
``previous_response_id`` and GET. A response still running can be cancelled (its engine request
is aborted; it ends ``cancelled``). Not supported, each refused with a 400 naming the field:
``background``, tools other than functions, input other than text.
``reasoning`` (effort, summary) is accepted and echoed; it changes nothing (no summaries are
written). A ``reasoning`` input item (a previous turn's) is not shown to the model again, as
Qwen3's template drops earlier turns' thinking. ``usage.output_tokens_details.reasoning_tokens``
counts the reasoning text as the tokenizer encodes it again.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import Any, AsyncIterator, Literal

import msgspec
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from paged.core.frontend.outputs import RequestOutputKind
from paged.core.frontend.reasoning import ThinkParser
from paged.core.server.chat import prepare_chat, reasoning_start
from paged.core.server.errors import APIError, from_exception, invalid, rejection
from paged.core.server.generation import accept, start
from paged.core.server.protocol import STRICT_MODEL, ChatCompletionRequest, parse
from paged.core.server.state import ServerState
from paged.core.server.streaming import EventStream, merged


class ResponsesRequest(BaseModel):
    model_config = STRICT_MODEL
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    # accepted and ignored (they change nothing here)
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # extras, as vLLM accepts them
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int = 0


class ResponseStore:
    """The newest ``capacity`` stored responses, by id: the response object and the messages of
    its conversation (its own output included), for ``previous_response_id``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self.running: dict[str, list] = {}  # id -> its engine streams, while it runs
        self.cancelled: set[str] = set()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        self.items[response["id"]] = (response, conversation)
        self.items.move_to_end(response["id"])
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        found = self.items.get(response_id)
        if found is None:
            raise APIError(404, f"response_id: no stored response {response_id!r} (responses are kept in memory, "
                           f"the newest {self.capacity}, and only with store=true)", "invalid_request_error",
                           "response_id", "not_found")
        return found


# ---- the request, as chat sees it ------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: must be a string or a list of text parts", "input")
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{k}]: only text parts ({{'type': 'input_text', 'text': ...}}) are supported",
                          "input")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages from ``input``: messages, and function calls with their outputs (consecutive
    calls become one assistant message with several ``tool_calls``)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise invalid("input: must not be empty", "input")
    messages: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"input[{k}].role: invalid value {role!r}; accepted: user, system, developer, assistant",
                              "input")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"input[{k}].content")})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise invalid(f"input[{k}]: a function_call needs string call_id, name and arguments", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise invalid(f"input[{k}].call_id: required (the call_id of the function_call it answers)", "input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, f"input[{k}].output")})
        elif kind == "reasoning":
            continue  # a previous turn's reasoning: not shown to the model again
        else:
            raise invalid(f"input[{k}].type: invalid value {kind!r}; accepted: message, function_call, "
                          "function_call_output, reasoning", "input")
    return messages


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for k, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise invalid(f"tools[{k}].type: invalid value {tool.get('type')!r}; only 'function' tools are supported",
                          "tools")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid(f"tool_choice: invalid value {choice!r}; accepted: 'auto', 'none', 'required' or "
                          "{'type': 'function', 'name': ...}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid(f"text.format.type: invalid value {fmt.get('type')!r}; accepted: text, json_object, json_schema",
                  "text")


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list]:
    """The chat request this response runs as, and its conversation without the instructions
    (what a later ``previous_response_id`` continues: instructions are not carried over)."""
    if req.background:
        raise invalid("background: not supported (responses run while the request is open)", "background")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise invalid(f"max_output_tokens: invalid value {req.max_output_tokens}; must be an integer >= 1",
                      "max_output_tokens")
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream, "priority": req.priority}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "user", "seed", "top_k", "min_p", "repetition_penalty", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = _chat_tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    response_format = _response_format(req.text)
    if response_format is not None:
        body["response_format"] = response_format
    return parse(ChatCompletionRequest, body), conversation


# ---- the response object --------------------------------------------------------------------------


def output_items(message: dict[str, Any], status: str = "completed") -> list[dict[str, Any]]:
    """A chat message (``ToolCallShaper.message``) as Responses output items (``status``: the
    message's, "incomplete" when max_output_tokens cut it)."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"], status))
    if message.get("content"):
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                      "content": [{"type": "output_text", "text": message["content"], "annotations": [],
                                   "logprobs": []}]})
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def response_object(req: ResponsesRequest, response_id: str, created: float, model: str, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None, finish_reason: str | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model, "status": status,
        "output": output, "usage": usage, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "store": req.store, "metadata": req.metadata or {},
        "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "reasoning": req.reasoning,
        "user": req.user,
    }


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens, "total_tokens": prompt_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}


# ---- the endpoints ---------------------------------------------------------------------------------


async def create(state: ServerState, store: ResponseStore, body: Any, tenant: str | None = None) -> Response:
    created = time.time()
    response_id = f"resp_{uuid.uuid4().hex}"
    try:
        req, llm = accept(state, ResponsesRequest, body)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            try:
                history = list(store.get(req.previous_response_id)[1])
            except APIError:
                raise invalid(f"previous_response_id: no stored response {req.previous_response_id!r}",
                              "previous_response_id") from None
        chat_req, conversation = chat_request(req, history)
        prompt, params, shaper = await prepare_chat(state, chat_req, llm)
        in_reasoning = reasoning_start(state, shaper, prompt, params)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        streams = await start(state, llm, response_id, [prompt], params, req.priority, False, kind,
                              state.config.server.chat_default_max_tokens, req.user or tenant, None,
                              state.lora_of(req.model))
    except Exception as e:
        return from_exception(e).response()
    store.running[response_id] = streams
    model = state.model_name(req.model)

    def finish(message: dict[str, Any], finish_reason: str | None, out, output_tokens: int) -> dict[str, Any]:
        """The final response (stored when asked): ``message`` in chat's shape, ``out`` the last output."""
        cancelled = response_id in store.cancelled or finish_reason == "abort"
        status = "cancelled" if cancelled else "incomplete" if finish_reason == "length" else "completed"
        prompt_tokens = len(out.prompt_token_ids) if out is not None else 0
        cached = getattr(out.metrics, "num_cached_tokens", 0) if out is not None else 0
        item_status = "incomplete" if status in ("incomplete", "cancelled") else "completed"
        reasoning_tokens = (len(state.tokens.tokenizer.encode(message["reasoning"], add_special_tokens=False))
                            if message.get("reasoning") else 0)
        response = response_object(req, response_id, created, model, status, output_items(message, item_status),
                                   _usage(prompt_tokens, output_tokens, cached, reasoning_tokens), finish_reason)
        if req.store:
            reply = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                reply["tool_calls"] = message["tool_calls"]
            store.put(response, conversation + [reply])
        return response

    if not req.stream:
        try:
            final = None
            async for _, out in merged(streams, state.open_merges):
                final = out
            if final is not None and (error := rejection([final])) is not None:
                return error.response()
            c = final.outputs[0] if final is not None and final.outputs else None
            reasoning = None
            if c is not None and in_reasoning is not None:
                reasoning, content = ThinkParser.split(c.text, in_reasoning)
                c = replace(c, text=content)
            message = shaper.message(c)[0] if c is not None else {"content": None}
            if reasoning:
                message = {**message, "reasoning": reasoning}
            return JSONResponse(finish(message, c.finish_reason if c else "abort", final,
                                       len(c.token_ids) if c else 0))
        except Exception as e:
            return from_exception(e).response()
        finally:
            store.running.pop(response_id, None)
            store.cancelled.discard(response_id)
    return EventStream(_events(state, store, req, response_id, created, streams, shaper, finish, in_reasoning),
                       media_type="text/event-stream")


async def _events(state: ServerState, store: ResponseStore, req: ResponsesRequest, response_id: str, created: float,
                  streams: list, shaper, finish, in_reasoning: bool | None) -> AsyncIterator[bytes]:
    """The streamed events (see the module docstring), numbered by ``sequence_number``."""
    seq = 0
    model = state.model_name(req.model)

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"

    running = response_object(req, response_id, created, model, "in_progress", [], None)
    items: list[dict[str, Any]] = []  # the output items opened so far, in order
    text_item: dict[str, Any] | None = None  # the message item while text streams into it
    thinker = ThinkParser(in_reasoning) if in_reasoning is not None else None
    reasoning_parts: list[str] = []
    thought: dict[str, Any] | None = None  # the reasoning item while reasoning streams into it
    calls: dict[int, dict[str, Any]] = {}  # tool call index -> its function_call item
    last = None
    finish_reason: str | None = "abort"  # until an output says otherwise (a cancel ends the stream early)
    output_tokens = 0
    try:
        yield event("response.created", response=running)
        yield event("response.in_progress", response=running)
        async for _, out in merged(streams, state.open_merges):
            last = out
            for c in out.outputs:
                if c.finish_reason in ("error", "rejected"):
                    raise rejection([out])
                output_tokens += len(c.new_token_ids)
                if c.finished:
                    finish_reason = c.finish_reason
                if thinker is not None:
                    reasoning, c = thinker.take(c)
                    if reasoning:
                        if thought is None:
                            thought = reasoning_item("", "in_progress")
                            items.append(thought)
                            yield event("response.output_item.added", output_index=len(items) - 1,
                                        item={**thought, "content": []})
                        reasoning_parts.append(reasoning)
                        yield event("response.reasoning_text.delta", item_id=thought["id"],
                                    output_index=items.index(thought), content_index=0, delta=reasoning)
                delta = shaper.delta(0, c)[0] if shaper.active else ({"content": c.new_text} if c.new_text else {})
                if delta.get("content"):
                    if text_item is None:
                        text_item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                                     "role": "assistant", "content": [], "text": []}
                        items.append(text_item)
                        index = len(items) - 1
                        yield event("response.output_item.added", output_index=index, item=_public(text_item))
                        yield event("response.content_part.added", item_id=text_item["id"], output_index=index,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    text_item["text"].append(delta["content"])
                    yield event("response.output_text.delta", item_id=text_item["id"],
                                output_index=items.index(text_item), content_index=0, delta=delta["content"],
                                logprobs=[])
                for call in delta.get("tool_calls") or []:
                    item = calls.get(call["index"])
                    if item is None:
                        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                                "call_id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                                "name": call["function"].get("name", ""), "arguments": "", "status": "in_progress"}
                        calls[call["index"]] = item
                        items.append(item)
                        yield event("response.output_item.added", output_index=len(items) - 1, item=dict(item))
                    piece = call["function"].get("arguments") or ""
                    if piece:
                        item["arguments"] += piece
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=items.index(item), delta=piece)
        text = "".join(text_item["text"]) if text_item is not None else ""
        reasoning_text = "".join(reasoning_parts)
        message: dict[str, Any] = {"content": text or None, "reasoning": reasoning_text or None, "tool_calls": [
            {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            for item in calls.values()]}
        response = finish(message, finish_reason, last, output_tokens)
        # the streamed items, done: the final response lists these (same ids)
        for index, item in enumerate(items):
            if item is thought:
                item.update(reasoning_item(reasoning_text, "completed", item["id"]))
                yield event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=reasoning_text)
            elif item is text_item:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                item.pop("text")
                item.update(status="completed" if response["status"] == "completed" else "incomplete", content=[part])
                yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=[])
                yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part)
            else:
                item["status"] = "completed"
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
        response["output"] = items  # the stored response is this same object
        done = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(response["status"],
                                                                                          "response.failed")
        yield event(done, response=response)
    except Exception as e:
        error = from_exception(e)
        failed = response_object(req, response_id, created, model, "failed", items, None,
                                 error={"code": error.code or error.type, "message": error.message})
        yield event("response.failed", response=failed)
    finally:
        store.running.pop(response_id, None)
        store.cancelled.discard(response_id)


def _public(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k != "text"}


async def retrieve(state: ServerState, store: ResponseStore, response_id: str) -> dict[str, Any]:
    state.require_llm()
    return store.get(response_id)[0]


async def cancel(state: ServerState, store: ResponseStore, response_id: str) -> dict[str, Any]:
    state.require_llm()
    streams = store.running.get(response_id)
    if streams is None:
        if response_id in store.items:
            raise invalid(f"response_id: response {response_id!r} has finished; only a running one can be cancelled",
                          "response_id")
        store.get(response_id)  # the 404
    store.cancelled.add(response_id)
    state.require_llm().abort(response_id)  # ends its stream: the open POST answers with status "cancelled"
    return {"id": response_id, "object": "response", "status": "cancelled"}


async def delete(state: ServerState, store: ResponseStore, response_id: str) -> dict[str, Any]:
    state.require_llm()
    store.get(response_id)
    del store.items[response_id]
    return {"id": response_id, "object": "response.deleted", "deleted": True}
