"""Reasoning in chat responses: a thinking model's ``<think>...</think>`` block apart from its answer.

Qwen3 (and other models that think between ``<think>`` and ``</think>``) writes its reasoning
first, then the answer. As vLLM's ``qwen3`` reasoning parser does, the chat API returns the
reasoning as ``reasoning_content`` and the rest as ``content``, streamed as deltas of either.
A template may open the block itself (``<think>`` at the end of the generation prompt, as the
Qwen3 thinking-only releases do); then the output starts inside it and only ``</think>`` ends it.
With ``enable_thinking=False`` Qwen3's template writes an empty block into the prompt and the
output is all content. An output that never closes a block it opened is all reasoning (cut by
``max_tokens``); one that opens none is all content.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from paged.core.frontend.tools import prefix_overlap

# model_type (HF config) -> the family's reasoning parser, chosen by server.reasoning_parser="auto".
REASONING_MODEL_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3"}
REASONING_PARSERS = ("auto", "qwen3", "none")


def reasoning_parser_for(setting: str, model_type: str | None) -> str | None:
    """The parser a server uses: ``setting`` (``server.reasoning_parser``) unless "auto", which
    picks the model family's (None: the model does not think in tags)."""
    if setting == "auto":
        return REASONING_MODEL_TYPES.get(model_type or "")
    return None if setting == "none" else setting


def starts_in_reasoning(prompt: str, start: str = "<think>", end: str = "</think>") -> bool:
    """Whether the rendered prompt leaves a thinking block open for the model to continue."""
    at = prompt.rfind(start)
    return at >= 0 and prompt.find(end, at) < 0 and not prompt[at + len(start):].strip()


class ThinkParser:
    """Splits output text into (reasoning, content). ``feed`` (streaming) returns the deltas of
    each; text that may be the start of a tag is held back until it is known, so a tag split
    across tokens is never sent as text. ``split`` gives what feeding the whole text gives."""

    START, END = "<think>", "</think>"

    def __init__(self, in_reasoning: bool = False) -> None:
        # "start": nothing seen yet (a block may open); "reasoning"; "content" (for good)
        self.state = "reasoning" if in_reasoning else "start"
        self.buffer = ""
        self.after_tag = in_reasoning  # newlines right after a tag are the template's, not text
        self.closed = False  # a block was opened and closed

    @classmethod
    def split(cls, text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
        """The final message's ``reasoning_content`` (None without a block) and ``content``."""
        parser = cls(in_reasoning)
        reasoning, content = parser.feed(text)
        more_reasoning, more_content = parser.finish()
        return (reasoning + more_reasoning if parser.opened else None), content + more_content

    @property
    def opened(self) -> bool:
        """Whether the output (or the prompt) opened a thinking block."""
        return self.state == "reasoning" or self.closed

    def _strip_after_tag(self) -> None:
        if self.after_tag:
            self.buffer = self.buffer.lstrip("\n")
            self.after_tag = not self.buffer

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning = ""
        if self.state == "start":
            stripped = self.buffer.lstrip()
            if stripped.startswith(self.START):
                self.buffer, self.state, self.after_tag = stripped[len(self.START):], "reasoning", True
            elif self.START.startswith(stripped):
                return "", ""  # maybe the tag, not complete yet (or only whitespace so far)
            else:
                self.state = "content"
        if self.state == "reasoning":
            self._strip_after_tag()
            at = self.buffer.find(self.END)
            if at < 0:
                keep = prefix_overlap(self.buffer, self.END)
                reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning = self.buffer[:at]
            self.buffer, self.state, self.after_tag, self.closed = self.buffer[at + len(self.END):], "content", True, True
        self._strip_after_tag()
        content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """At the end of the output: what was held back (a partial tag is text after all)."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest

    def take(self, output) -> tuple[str, Any]:
        """One streamed ``CompletionOutput``'s new text split: its reasoning, and the output with
        only the content left as ``new_text`` (what was held back comes out when it finishes)."""
        reasoning, content = self.feed(output.new_text)
        if output.finished:
            more_reasoning, more_content = self.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, replace(output, new_text=content)
