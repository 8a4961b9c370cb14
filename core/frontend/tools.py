"""OpenAI tools for chat: validating ``tools`` / ``tool_choice``, the constraint that enforces
``required`` and a named function, rendering tools and tool messages into the prompt, and the
parsers that turn the model's text into ``tool_calls``.

Parsers are registered per model family (``TOOL_PARSERS``, keyed by the HF ``model_type``);
``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Qwen2.5's and Qwen3's
format) is the default; Mistral and Mixtral get ``[TOOL_CALLS]`` (``MistralToolParser``). A chat template that does not render ``tools`` itself (SmolLM2's) gets the tools
in a system message in Hermes' wording, and tool calls / tool results rendered as Hermes text.
"""

from __future__ import annotations

import functools
import json
import re
import reprlib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged.core.errors import InvalidRequestError
from paged.core.structured_output import StructuredOutputParams


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


# --- request side --------------------------------------------------------------------------------
def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The ``tools`` list, each ``{"type": "function", "function": {"name", "parameters"?}}``."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools: must be a non-empty list of {'type': 'function', 'function': {...}}")
    names = set()
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(f"{where}: must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise InvalidRequestError(f"{where}.function.name: must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in names:
            raise InvalidRequestError(f"{where}.function.name: {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        # As OpenAI: arguments are a JSON object, so the schema must describe one ({} or absent: no parameters).
        if params is not None and params != {} and not (isinstance(params, dict) and params.get("type") == "object"):
            raise InvalidRequestError(f"{where}.function.parameters: must be a JSON Schema of type 'object', e.g. "
                                      f"{{'type': 'object', 'properties': {{...}}}}, got {reprlib.repr(params)}")
    return tools


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """The schema of a tool's arguments; none (or {}) means it takes none: ``{}``."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def tool_choice_mode(tool_choice: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", function name for "named")."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice: {tool_choice!r} needs a non-empty 'tools' list")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        known = [t["function"]["name"] for t in tools or []]
        if name not in known:
            raise InvalidRequestError(f"tool_choice: unknown function {name!r}; the tools are {known}")
        return "named", name
    raise InvalidRequestError(
        f"tool_choice: must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
    )


def tool_constraint(mode: str, name: str | None, tools: list[dict[str, Any]], parallel: bool) -> StructuredOutputParams | None:
    """``named``: the output is the function's arguments. ``required``: a JSON array of
    ``{"name", "arguments"}`` calls (one unless ``parallel``), each valid for its tool."""
    if mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == name)
        return StructuredOutputParams(json_schema=_parameters(tool))
    if mode != "required":
        return None
    calls = [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                          "arguments": _parameters(t)}, "required": ["name", "arguments"]}
        for t in tools
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return StructuredOutputParams(json_schema={"type": "array", "items": items, "minItems": 1,
                                               **({} if parallel else {"maxItems": 1})})


def calls_from_constrained(mode: str, name: str | None, text: str) -> list[ToolCall]:
    """The tool calls of a ``named`` / ``required`` output (valid JSON by construction)."""
    if mode == "named":
        return [ToolCall(name, json.dumps(json.loads(text)))]
    return [ToolCall(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]


# --- prompt side ---------------------------------------------------------------------------------
HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query. You are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def render_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         template_renders_tools: bool) -> list[dict[str, Any]]:
    """Messages for a chat template. A template that renders tools gets them as they are; for
    one that does not, assistant ``tool_calls`` become ``<tool_call>`` text, tool results
    ``<tool_response>`` text in a user turn, and the tools a Hermes system message."""
    if template_renders_tools:
        return [_with_argument_objects(m) for m in messages]
    out = []
    for k, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or "name" not in fn:
                    raise InvalidRequestError(f"messages[{k}].tool_calls: each must have a 'function' with a 'name'")
                args = fn.get("arguments", "{}")
                args = json.loads(args) if isinstance(args, str) and args.strip() else (args or {})
                calls.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}) + "\n</tool_call>")
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n".join(calls)).strip()})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": role, "content": m.get("content") or ""})
    if tools:
        listing = "\n".join(json.dumps(t) for t in tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments as objects: templates write them with ``tojson`` (a JSON string would
    be encoded twice)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for c in message["tool_calls"]:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"] or "{}")
            except json.JSONDecodeError:
                pass
        calls.append({**c, "function": fn})
    return {**message, "tool_calls": calls}


# --- output side ---------------------------------------------------------------------------------
class ToolParser:
    """A model family's tool-call format: ``feed(delta) -> (content delta, completed calls)``
    while the output streams, ``finish()`` at its end, ``parse`` for a whole output."""

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    @classmethod
    def parse(cls, text: str) -> tuple[str, list[ToolCall]]:
        parser = cls()
        content, calls = parser.feed(text)
        tail, more = parser.finish()
        return (content + tail).strip(), calls + more


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the rest is content.
    ``feed`` (streaming) returns (content delta, completed calls); text that may be the start
    of a ``<tool_call>`` tag is held back until it is known."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, calls = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(self.OPEN)
                if at < 0:
                    keep = prefix_overlap(self.buffer, self.OPEN)
                    content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, calls
                content += self.buffer[:at]
                self.buffer = self.buffer[at + len(self.OPEN):]
                self.in_call = True
            end = self.buffer.find(self.CLOSE)
            if end < 0:
                return content, calls
            call = _call_from_json(self.buffer[:end])
            self.buffer = self.buffer[end + len(self.CLOSE):]
            self.in_call = False
            if call is not None:
                calls.append(call)
                self.num_calls += 1

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: an unclosed call is taken if its JSON is complete."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            call = _call_from_json(rest)
            return ("", [call]) if call is not None else (self.OPEN + rest, [])
        return rest, []


def prefix_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call_from_json(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class MistralToolParser(ToolParser):
    """Mistral's ``[TOOL_CALLS]``: then a JSON array of ``{"name", "arguments"}`` (the v3
    tokenizers) or ``name[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]`` (v11 and
    later). Text before the first ``[TOOL_CALLS]`` is content; the calls are parsed when the
    output ends (they are its last part), so ``feed`` sends content only."""

    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    # [TOOL_CALLS] is a control token: the output's text must keep special tokens to show it
    keeps_special_tokens = True

    def __init__(self) -> None:
        self.buffer = ""
        self.in_calls = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        if self.in_calls:
            return "", []
        at = self.buffer.find(self.MARK)
        if at >= 0:
            content, self.buffer, self.in_calls = self.buffer[:at], self.buffer[at:], True
            return content, []
        keep = prefix_overlap(self.buffer, self.MARK)
        content, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The calls (all of them or, when one does not parse, none: the text stays content)."""
        rest, self.buffer = self.buffer, ""
        if not self.in_calls:
            return rest, []
        calls: list[ToolCall] = []
        for part in rest.split(self.MARK)[1:]:
            part = part.strip()
            if part.startswith("["):
                try:
                    items = json.loads(part)
                except json.JSONDecodeError:
                    return rest, []
                found = [_call_from_json(json.dumps(item)) for item in items] if isinstance(items, list) else [None]
            else:
                name, sep, args = part.partition(self.ARGS)
                found = [_call_from_json(json.dumps({"name": name.strip(), "arguments": json.loads(args)}))
                         if sep and name.strip() and _is_json(args) else None]
            if not found or any(call is None for call in found):
                return rest, []
            calls.extend(found)
        return "", calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


# model_type (HF config) -> parser class; "hermes" for the rest (Qwen2, Qwen2.5, Qwen3 and
# their MoE variants write Hermes blocks).
TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser, "qwen2": HermesToolParser, "llama": HermesToolParser,
                                 "qwen3": HermesToolParser, "qwen3_moe": HermesToolParser,
                                 "mistral": MistralToolParser, "mixtral": MistralToolParser}


def tool_parser_for(model_type: str | None) -> type:
    return TOOL_PARSERS.get(model_type or "", HermesToolParser)


@functools.lru_cache(maxsize=8)  # read once per served model, not once per chat request
def model_type(model_dir: str) -> str | None:
    """The HF ``model_type`` of the served model (it picks the tool-call parser)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
