"""Tool calls in chat responses: the final message's ``tool_calls`` and, streamed, their deltas.

``auto``: the model's text goes through the model family's parser (Hermes ``<tool_call>``);
content outside the calls stays content. ``named``: the whole output is the arguments of the
named function (its JSON-schema constraint made sure), streamed as argument deltas.
``required``: the output is a JSON array of calls (constrained too), sent when complete.
A response with calls finishes with ``tool_calls`` (unless it ran out of tokens: ``length``)."""

from __future__ import annotations

from typing import Any

from paged.core.frontend.outputs import CompletionOutput
from paged.core.frontend.tools import ToolCall, calls_from_constrained


class ToolCallShaper:
    def __init__(self, mode: str, name: str | None, parser_cls: type | None) -> None:
        """``parser_cls``: the model family's parser (``paged.core.frontend.tools``); needed
        only when ``mode`` is not "none"."""
        self.mode, self.name, self.parser_cls = mode, name, parser_cls
        self.parsers: dict[int, Any] = {}  # choice index -> streaming parser (auto)
        self.streamed: dict[int, list[ToolCall]] = {}  # choice index -> calls sent so far
        self.buffers: dict[int, list[str]] = {}  # required: the text so far, in pieces (joined once, at the end)

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @staticmethod
    def _finish_reason(c: CompletionOutput, calls: list) -> str | None:
        if calls and c.finish_reason == "stop":
            return "tool_calls"
        return c.finish_reason

    def message(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """The final ``message`` and finish reason of a finished choice."""
        calls: list[ToolCall] = []
        content: str | None = c.text
        if self.mode in ("named", "required"):
            try:
                calls, content = calls_from_constrained(self.mode, self.name, c.text), None
            except (ValueError, KeyError, TypeError):  # cut short by max_tokens: not JSON yet
                calls = []
        elif self.mode == "auto":
            content, calls = self.parser_cls.parse(c.text)
            content = content or None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, self._finish_reason(c, calls)

    def delta(self, index: int, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """The ``delta`` of a streamed chunk for this choice, and its finish reason."""
        sent = self.streamed.setdefault(index, [])
        delta: dict[str, Any] = {}
        new_calls: list[dict[str, Any]] = []
        if self.mode == "named":
            if not sent:
                call = ToolCall(self.name, "")
                sent.append(call)
                new_calls.append({**call.to_openai(0), "function": {"name": self.name, "arguments": c.new_text}})
            elif c.new_text:
                new_calls.append({"index": 0, "function": {"arguments": c.new_text}})
        elif self.mode == "required":
            self.buffers.setdefault(index, []).append(c.new_text)
            if c.finished:
                try:
                    calls = calls_from_constrained("required", None, "".join(self.buffers[index]))
                except (ValueError, KeyError, TypeError):
                    calls = []
                new_calls = [call.to_openai(k) for k, call in enumerate(calls)]
                sent.extend(calls)
        else:  # auto
            parser = self.parsers.setdefault(index, self.parser_cls())
            text, calls = parser.feed(c.new_text)
            if c.finished:
                tail, more = parser.finish()
                text, calls = text + tail, calls + more
            if text:
                delta["content"] = text
            new_calls = [call.to_openai(len(sent) + k) for k, call in enumerate(calls)]
            sent.extend(calls)
        if new_calls:
            delta["tool_calls"] = new_calls
        return delta, self._finish_reason(c, sent) if c.finished else None

