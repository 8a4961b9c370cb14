"""Front-end processing around an engine core: requests in (tokenize, validate, fan out n > 1),
outputs out (detokenize incrementally, stop strings, gather the n samples of a request).

Used by the in-process ``LLMEngine`` and by the serving front-end alike.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from paged.core.frontend.detokenizer import IncrementalDetokenizer
from paged.core.engine.engine_core import ModelInfo
from paged.core.constraint_check import ConstraintValidator
from paged.core.engine.outputs import EngineCoreOutput
from paged.core.errors import InvalidRequestError
from paged.core.frontend.tools import render_tool_messages
from paged.core.frontend.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged.core.engine.request import Request
from paged.core.sampling_params import SamplingParams
from paged.core.structured_output import StructuredOutputParams
from paged.core.engine.scheduler import check_request_fits


@dataclass
class _Child:
    request_id: str
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput
    stop_token_ids: list[int]


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.output.finished for c in self.children)

    @property
    def child_ids(self) -> list[str]:
        return [c.request_id for c in self.children]


def structured_output_validator(config, registry=None) -> ConstraintValidator:
    """The check of a constraint before queueing (paged.core.constraint_check): bounded checks,
    then, given the model, the configured backend's compile in a worker process with a time
    limit; raises InvalidRequestError naming the field and the problem."""
    from paged.core.config import resolve_structured_output

    spec, options = resolve_structured_output(config, registry)  # an unknown or missing backend fails here
    return ConstraintValidator(config, spec, options)


class InputProcessor:
    def __init__(self, tokenizer, model_info: ModelInfo,
                 validate_structured_output: ConstraintValidator | None = None) -> None:
        self.tokenizer = tokenizer
        self.info = model_info
        self.validate_structured_output = validate_structured_output
        self._renders_tools: bool | None = None

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt for a conversation; ``tools`` (OpenAI function tools) go to a template that
        renders them, else into a Hermes-style system message (paged.core.frontend.tools)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages: this model's tokenizer has no chat template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise InvalidRequestError("messages: must be a list of {'role': ..., 'content': ...} objects")
        kwargs = {}
        if tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
            renders = self.template_renders_tools()
            messages = render_tool_messages(messages, tools, renders)
            if renders and tools:
                kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    def template_renders_tools(self) -> bool:
        """Whether the chat template shows ``tools`` (it changes the prompt); probed once."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {"name": "probe_fn", "parameters": {"type": "object"}}}
            plain = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
            try:
                with_tools = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True,
                                                                tools=[tool])
            except Exception:  # a template that chokes on tools does not render them
                with_tools = plain
            self._renders_tools = "probe_fn" in with_tools and with_tools != plain
        return self._renders_tools

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        prompt_token_ids: list[int] | None = None,
        tenant: str | None = None,
        deadline_s: float | None = None,
    ) -> tuple[ParentRequest, list[Request]]:
        """Validate and build the core requests (n of them); raises InvalidRequestError.
        ``prompt_token_ids``: a text prompt's tokens when the caller has them already."""
        if isinstance(prompt, str):
            text = prompt
            token_ids = prompt_token_ids
            if token_ids is None:
                token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        else:
            text = None
            token_ids = [int(t) for t in prompt]
            bad = [t for t in token_ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt_token_ids: {bad[:5]} out of range; token ids must be in [0, {self.info.vocab_size})"
                )
        if params.structured_output is not None and self.validate_structured_output is not None:
            self.validate_structured_output(params.structured_output, self.info)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority: invalid value {priority!r}; must be an integer")
        check_request_metadata(tenant, deadline_s)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(self.info.max_model_len - len(token_ids), 1)
        info = self.info
        check_request_fits(len(token_ids), max_tokens, info.max_model_len, info.num_blocks, info.block_size)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        deadline = None if deadline_s is None else arrival_time + float(deadline_s)
        eos = self.info.eos_token_ids[0] if self.info.eos_token_ids else None
        extra_stop = [] if params.ignore_eos else [t for t in self.info.eos_token_ids[1:] if t not in params.stop_token_ids]
        parent = ParentRequest(request_id, text, token_ids)
        requests = []
        for index in range(params.n):
            child_params = params
            if params.n > 1 or extra_stop:
                seed = None if params.seed is None else params.seed + index
                child_params = params.copy(n=1, seed=seed, stop_token_ids=params.stop_token_ids + extra_stop)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            requests.append(
                Request(child_id, token_ids, child_params, arrival_time=arrival_time, priority=priority,
                        cache_salt=cache_salt, eos_token_id=eos, max_tokens=max_tokens, tenant=tenant,
                        deadline=deadline)
            )
            parent.children.append(
                _Child(
                    child_id,
                    IncrementalDetokenizer(self.tokenizer, token_ids, child_params),
                    CompletionOutput(index, logprobs=[] if params.logprobs is not None else None),
                    child_params.stop_token_ids,
                )
            )
        return parent, requests


class OutputProcessor:
    """Turns core outputs into RequestOutputs. ``process`` also returns the child ids that a
    stop string ended: the caller aborts them in the core (as finished, not as errors)."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self._child: dict[str, tuple[ParentRequest, _Child]] = {}

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self._child[child.request_id] = (parent, child)

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; returns its child ids (to abort in the core)."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        for child_id in parent.child_ids:
            self._child.pop(child_id, None)
        return parent.child_ids

    def __len__(self) -> int:
        return len(self.parents)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        touched: dict[str, ParentRequest] = {}
        stopped: list[str] = []
        for core_out in core_outputs:
            entry = self._child.get(core_out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            parent, child = entry
            out = child.output
            if out.finished:
                continue
            out.token_ids.extend(core_out.new_token_ids)
            out.new_token_ids.extend(core_out.new_token_ids)
            if out.logprobs is not None:
                out.logprobs.extend(core_out.logprobs)
            delta = child.detokenizer.update(core_out.new_token_ids)
            if child.detokenizer.stopped:
                if core_out.finish_reason is None:
                    stopped.append(core_out.request_id)
                out.finish_reason = "stop"
                out.stop_reason = child.detokenizer.stop_reason
            elif core_out.finish_reason is not None:
                delta += child.detokenizer.finalize()
                out.finish_reason = core_out.finish_reason
                out.stop_reason = core_out.stop_token_id if core_out.stop_token_id in child.stop_token_ids else None
                if core_out.finish_reason == "rejected":  # turned away by the policy: why, for the client
                    out.stop_reason = core_out.reject_reason
                elif core_out.finish_reason == "error":  # a plugin failed on it: who, and how
                    out.stop_reason = core_out.error
            out.text += delta
            out.new_text += delta
            out.metrics = RequestMetrics(
                arrival_time=core_out.arrival_time,
                first_scheduled_time=core_out.first_scheduled_time,
                first_token_time=core_out.first_token_time,
                finished_time=core_out.finished_time if out.finish_reason else None,
                num_cached_tokens=core_out.num_cached_tokens,
                num_preemptions=core_out.num_preemptions,
            )
            if out.finish_reason and out.metrics.finished_time is None:
                out.metrics.finished_time = time.monotonic()
            touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            outputs.append(_snapshot(parent))
            if parent.finished:
                self.remove(parent.request_id)
        return outputs, stopped


def _snapshot(parent: ParentRequest) -> RequestOutput:
    completions = []
    for child in parent.children:
        out = child.output
        completions.append(
            CompletionOutput(
                index=out.index,
                text=out.text,
                token_ids=list(out.token_ids),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                logprobs=list(out.logprobs) if out.logprobs is not None else None,
                new_text=out.new_text,
                new_token_ids=out.new_token_ids,
                metrics=out.metrics,
            )
        )
        out.new_text, out.new_token_ids = "", []
    return RequestOutput(
        parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
        finished=parent.finished, metrics=completions[0].metrics,
    )


MAX_TENANT_LEN = 256


def check_request_metadata(tenant, deadline_s) -> None:
    """The scheduling metadata of a request: ``tenant`` (the OpenAI ``user``) and ``deadline_s``
    (seconds after arrival by which it should finish). Raises InvalidRequestError naming the field."""
    if tenant is not None and (not isinstance(tenant, str) or len(tenant) > MAX_TENANT_LEN):
        raise InvalidRequestError(f"user: invalid value {tenant!r}; must be a string of at most {MAX_TENANT_LEN} characters")
    if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                   or not math.isfinite(deadline_s) or deadline_s <= 0):
        raise InvalidRequestError(f"deadline_s: invalid value {deadline_s!r}; must be a number of seconds > 0")
