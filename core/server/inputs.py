"""Prompt preparation off the event loop: a cheap length check first, then tokenization and
chat-template rendering in one worker thread (one, because a Hugging Face tokenizer is not
meant to be used from several threads at once), so /health and other streams stay responsive."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from paged.core.errors import InvalidRequestError
from paged.core.frontend.async_llm import AsyncLLM
from paged.core.server.errors import invalid


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token covers: the longest vocabulary entry (byte-level
    and SentencePiece entries are at least as long as the text they decode to)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


class PromptInputs:
    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.max_model_len = llm.model_info.max_model_len
        # A text longer than this is certainly more than max_model_len tokens.
        self.max_prompt_chars = self.max_model_len * longest_token_chars(llm.tokenizer)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="paged-tokenize")

    def check_length(self, field: str, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise invalid(f"{field}: {num_chars} characters cannot fit in max_model_len ({self.max_model_len}) "
                          "tokens; shorten the prompt")

    async def run(self, fn, *args) -> Any:
        """``fn(*args)`` on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def tokenize(self, prompts: list[str | list[int]], add_special_tokens: bool,
                       field: str = "prompt") -> list[list[int] | None]:
        """Each text prompt's tokens (None for a prompt given as token ids); errors name ``field``."""
        for k, p in enumerate(prompts):
            if isinstance(p, str):
                self.check_length(field if len(prompts) == 1 else f"{field}[{k}]", len(p))
        texts = [p for p in prompts if isinstance(p, str)]
        if not texts:
            return [None] * len(prompts)
        tokenizer = self.llm.tokenizer
        ids = await self.run(lambda: [tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"]
                                       for t in texts])
        if not all(ids):
            raise invalid(f"{field}: must not be empty (a text has no tokens)")
        it = iter(ids)
        return [next(it) if isinstance(p, str) else None for p in prompts]

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                          chat_template_kwargs: dict[str, Any] | None = None) -> str:
        self.check_length("messages", sum(len(m["content"]) for m in messages))
        try:
            return await self.run(self.llm.apply_chat_template, messages, tools, chat_template_kwargs)
        except InvalidRequestError:
            raise
        except (TypeError, ValueError, KeyError, IndexError) as e:
            raise invalid(f"messages: the chat template cannot render them: {e}") from None
        except Exception as e:
            if type(e).__module__.startswith("jinja2"):  # TemplateError and its kin, raised by the template
                raise invalid(f"messages: the chat template cannot render them: {e}") from None
            raise

    def close(self, cancel_pending: bool = True) -> None:
        """Stop the worker thread; ``cancel_pending=False`` lets the queued work finish first."""
        self.pool.shutdown(wait=False, cancel_futures=cancel_pending)
