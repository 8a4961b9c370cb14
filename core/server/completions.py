"""POST /v1/completions: one or several prompts (text or token ids), ``n`` samples each."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi.responses import Response

from paged.core.frontend.outputs import CompletionOutput, RequestOutput
from paged.core.server.errors import from_exception, invalid
from paged.core.server.generation import ChoiceFormat, accept, respond
from paged.core.server.protocol import CompletionRequest, check_limits, sampling_params
from paged.core.server.state import ServerState
from paged.core.server.structured import check_compiles, constraint_field, structured_output_of
from paged.core.server.streaming import completion_logprobs, echoed_prompt_logprobs, prompt_logprobs_json


class CompletionFormat(ChoiceFormat):
    """Choices of /v1/completions. ``echo``: each choice's text (and logprobs) starts with its
    prompt's; ``generate`` false (echo with ``max_tokens`` 0): only the prompt comes back;
    ``prompt_logprobs``: each choice carries vLLM's ``prompt_logprobs``."""

    object_name = chunk_object = "text_completion"

    def __init__(self, tokens, n: int = 1, echo: bool = False, generate: bool = True,
                 prompt_logprobs: bool = False) -> None:
        super().__init__(tokens)
        self.n, self.echo, self.generate, self.prompt_logprobs = n, echo, generate, prompt_logprobs
        self.prompts: dict[int, RequestOutput] = {}  # prompt index -> its latest output
        self.text_offsets: dict[int, int] = {}  # choice index -> length of the text streamed so far

    def see_prompt(self, i: int, out: RequestOutput) -> None:
        self.prompts[i] = out

    def completion_tokens(self, token_ids: list[int]) -> int:
        return len(token_ids) if self.generate else 0

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tok.tokenizer.decode(out.prompt_token_ids)

    def _choice(self, index: int, text: str, logprobs: list | None, first: bool, offset: int,
                c: CompletionOutput) -> dict[str, Any]:
        """``first``: the choice's first text (where an echo goes)."""
        if not self.generate:
            text, logprobs = "", [] if logprobs is not None else None
        lp = None
        out = self.prompts.get(index // self.n)
        if self.echo and first:
            prompt_text = self._prompt_text(out)
            if logprobs is not None:
                lp = echoed_prompt_logprobs(self.tok, out.prompt_token_ids, out.prompt_logprobs)
                more = completion_logprobs(self.tok, logprobs, offset + len(prompt_text))
                for key in lp:
                    lp[key] += more[key]
            text = prompt_text + text
        elif logprobs is not None:
            lp = completion_logprobs(self.tok, logprobs, offset)
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason if c.finished else None}
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_json(self.tok, out.prompt_logprobs)
        return choice

    def final_choice(self, index: int, c: CompletionOutput) -> dict[str, Any]:
        return self._choice(index, c.text, c.logprobs, True, 0, c)

    def delta_choice(self, index: int, c: CompletionOutput, new_logprobs: list | None) -> dict[str, Any]:
        first = index not in self.text_offsets
        offset = self.text_offsets.get(index, 0)
        choice = self._choice(index, c.new_text, new_logprobs, first, offset, c)
        self.text_offsets[index] = offset + len(choice["text"])
        return choice


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
        if req.suffix:
            raise invalid("suffix: not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise invalid(f"best_of: only best_of == n is supported (got {req.best_of}, n={req.n})", "best_of")
        prompts = prompt_list(req.prompt)
        check_limits(req, state.config.server, len(prompts))
        max_tokens = defaults.get("max_tokens", 16) if req.max_tokens is None else req.max_tokens
        generate = not (req.echo and req.max_tokens == 0)  # echo with max_tokens 0: the prompt's logprobs only
        if req.prompt_logprobs is not None and req.stream:
            raise invalid("prompt_logprobs: not available when stream is true (echo with logprobs is)",
                          "prompt_logprobs")
        params = sampling_params(req, max_tokens if generate else 1, req.logprobs, defaults)
        prompt_k = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_k = max(prompt_k or 0, req.logprobs)
        if prompt_k is not None:
            params = params.copy(prompt_logprobs=prompt_k)
        constraint = structured_output_of(req, validate=llm.input_processor.validate_structured_output)
        if constraint is not None:
            params = params.copy(structured_output=constraint)
            await check_compiles(llm, constraint, constraint_field(req))
    except Exception as e:
        return from_exception(e).response()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    fmt = CompletionFormat(state.tokens, params.n, req.echo, generate, req.prompt_logprobs is not None)
    return await respond(state, fmt, f"cmpl-{uuid.uuid4().hex}", prompts, params,
                         req.priority, True, req.stream, include_usage, tenant=req.user or tenant,
                         deadline_s=req.deadline_s, llm=llm, model=req.model)
