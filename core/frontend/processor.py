"""Front-end processing around an engine core: requests in (tokenize, validate, fan out n > 1,
build the core's ``EngineCoreRequest`` messages), outputs out (append each core output to its
request's state, detokenize incrementally, stop strings, hand out what each request's output
kind asks for: see ``paged.core.frontend.request_state``).

Used by the in-process ``LLMEngine`` and by the serving front-end alike.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

from paged.core.constraint_check import ConstraintValidator
from paged.core.engine.model_info import ModelInfo
from paged.core.engine.outputs import EngineCoreOutput, EngineCoreRequest
from paged.core.pooling_params import NOT_A_GENERATING_ENGINE, NOT_A_POOLING_ENGINE
from paged.core.engine.scheduler import check_request_fits
from paged.core.errors import InvalidRequestError
from paged.core.frontend.detokenizer import IncrementalDetokenizer
from paged.core.frontend.outputs import RequestOutput, RequestOutputKind
from paged.core.frontend.request_state import RequestState, SampleState
from paged.core.frontend.tools import render_tool_messages
from paged.core.lora import LoRARequest
from paged.core.pooling_params import PoolingParams
from paged.core.sampling_params import SamplingParams


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

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt for a conversation; ``tools`` (OpenAI function tools) go to a template that
        renders them, else into a Hermes-style system message (paged.core.frontend.tools).
        ``chat_template_kwargs``: more variables for the template (Qwen3's ``enable_thinking``)."""
        extra = check_chat_template_kwargs(chat_template_kwargs)
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
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra,
                                                  **kwargs)

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

    def _check_token_fields(self, params: SamplingParams) -> SamplingParams:
        """Token ids within the vocabulary, and ``bad_words`` tokenized (a copy when changed)."""
        vocab = self.info.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids", params.allowed_token_ids or [])):
            out_of_range = [t for t in ids if not 0 <= t < vocab]
            if out_of_range:
                raise InvalidRequestError(f"{name}: token ids {out_of_range[:5]} out of range; token ids must be in [0, {vocab})")
        if not params.bad_words or params.bad_words_token_ids:
            return params
        sequences: list[list[int]] = []
        for word in params.bad_words:
            # the word as written and as it appears after a space (another token for most BPEs)
            for text in dict.fromkeys((word.strip(), " " + word.strip())):
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                if ids and ids not in sequences:
                    sequences.append(ids)
        return params.copy(bad_words_token_ids=sequences)

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        prompt_token_ids: list[int] | None = None,
        tenant: str | None = None,
        deadline_s: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> tuple[RequestState, list[EngineCoreRequest]]:
        """Validate the request and build its state and its core requests (n of them, sharing
        one prompt token list, sent as they are); raises InvalidRequestError. ``prompt_token_ids``:
        a text prompt's tokens when the caller has them already. ``lora_request``: the LoRA
        adapter it runs with (the engine must have LoRA enabled)."""
        if lora_request is not None:
            check_lora_request(lora_request, self.info)
        if isinstance(prompt, str):
            text = prompt
            token_ids = prompt_token_ids
            if token_ids is None:
                token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        else:
            text = None
            token_ids = [int(t) for t in prompt]  # the one copy: the caller's sequence may be anything
            bad = [t for t in token_ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt_token_ids: {bad[:5]} out of range; token ids must be in [0, {self.info.vocab_size})"
                )
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise InvalidRequestError("lora_request: LoRA adapters apply to generation, not to pooling requests")
            return self._pooling_request(request_id, text, token_ids, params, priority, arrival_time, cache_salt,
                                         tenant, deadline_s, output_kind)
        if self.info.runner == "pooling":
            raise InvalidRequestError(NOT_A_GENERATING_ENGINE)
        params = self._check_token_fields(params)
        if params.structured_output is not None and self.validate_structured_output is not None:
            self.validate_structured_output(params.structured_output, self.info)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority: invalid value {priority!r}; must be an integer")
        check_request_metadata(tenant, deadline_s)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(self.info.max_model_len - len(token_ids), 1)
        info = self.info
        check_request_fits(len(token_ids), max_tokens, info.max_model_len, info.num_blocks, info.block_size,
                           info.sliding_window, info.max_num_batched_tokens)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        deadline = None if deadline_s is None else arrival_time + float(deadline_s)
        eos = self.info.eos_token_ids[0] if self.info.eos_token_ids else None
        extra_stop = [] if params.ignore_eos else [t for t in self.info.eos_token_ids[1:] if t not in params.stop_token_ids]
        state = RequestState(request_id, text, token_ids, output_kind)
        requests = []
        for index in range(params.n):
            child_params = params
            if params.n > 1 or extra_stop:
                seed = None if params.seed is None else params.seed + index
                child_params = params.copy(n=1, seed=seed, stop_token_ids=params.stop_token_ids + extra_stop)
                if index > 0 and params.prompt_logprobs is not None:  # one sample makes them; the rest may hit the cache
                    child_params.prompt_logprobs = None
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            requests.append(EngineCoreRequest(child_id, token_ids, child_params, arrival_time, priority, cache_salt,
                                              eos, max_tokens, tenant, deadline, lora_request=lora_request))
            state.add_sample(child_id, IncrementalDetokenizer(self.tokenizer, token_ids, child_params),
                             child_params.stop_token_ids, params.logprobs is not None)
        return state, requests


    def _pooling_request(self, request_id: str, text: str | None, token_ids: list[int], params: PoolingParams,
                         priority: int, arrival_time: float | None, cache_salt: str | None, tenant: str | None,
                         deadline_s: float | None, output_kind: RequestOutputKind,
                         ) -> tuple[RequestState, list[EngineCoreRequest]]:
        """A pooling request: its prompt, computed once, becomes a vector (no sampling, no text)."""
        info = self.info.pooling
        if info is None:
            raise InvalidRequestError(NOT_A_POOLING_ENGINE)
        if params.dimensions is not None:
            limit = info.get("max_dimensions")
            if limit is None:
                raise InvalidRequestError(f"dimensions: {params.dimensions} asked for, but this model has no Matryoshka "
                                          "dimensions (its config.json sets no matryoshka_dimensions; "
                                          "pooling.max_dimensions allows them)")
            if params.dimensions > limit:
                raise InvalidRequestError(f"dimensions: {params.dimensions} exceeds this model's {limit}; "
                                          f"give at most {limit}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority: invalid value {priority!r}; must be an integer")
        check_request_metadata(tenant, deadline_s)
        model = self.info
        check_request_fits(len(token_ids), 1, model.max_model_len, model.num_blocks, model.block_size,
                           model.sliding_window, model.max_num_batched_tokens)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        deadline = None if deadline_s is None else arrival_time + float(deadline_s)
        state = RequestState(request_id, text, token_ids, output_kind)
        state.pooling = (params, info)
        request = EngineCoreRequest(request_id, token_ids, _POOLING_SAMPLING, arrival_time, priority, cache_salt,
                                    None, 1, tenant, deadline, params)
        state.add_sample(request_id, None, [], False)
        return state, [request]


_POOLING_SAMPLING = SamplingParams(max_tokens=1)  # what a pooling request carries (never sampled)


@dataclass
class ProcessedOutputs:
    """What one batch of core outputs did (``OutputProcessor.process``)."""

    outputs: list[RequestOutput]  # to hand out: those of the requests that have no stream
    stopped: list[str]  # samples a stop string ended: the core still runs them; abort them there as finished
    finished: list[SampleState]  # samples that finished (stopped ones included)
    done: list[RequestState]  # requests whose every sample finished: their last output is out; forgotten


class OutputProcessor:
    """The front-end's per-request states, by request id (``requests``) and by core request id
    (``samples``). ``process`` appends each core output to its sample once and hands out what
    each request's output kind asks for: to the request's ``stream`` if it has one, else in the
    result. A request is forgotten when its last output is out or when it is removed."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        self.samples: dict[str, SampleState] = {}

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for sample in state.samples:
            self.samples[sample.request_id] = sample

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; returns its samples still live in the core (for the caller to abort)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        live = []
        for sample in state.samples:
            self.samples.pop(sample.request_id, None)
            if sample.live:
                sample.live = False
                live.append(sample.request_id)
        return live

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_live_samples(self) -> int:
        return sum(sample.live for sample in self.samples.values())

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        samples = self.samples
        touched: list[RequestState] = []
        stopped: list[str] = []
        finished: list[SampleState] = []
        for core_out in core_outputs:
            sample = samples.get(core_out.request_id)
            if sample is None or sample.finish_reason is not None:
                continue  # aborted meanwhile, or already ended by a stop string
            if sample.append(core_out):
                stopped.append(sample.request_id)
            state = sample.request
            if sample.finish_reason is not None:
                finished.append(sample)
                state.num_unfinished -= 1
            if not state.changed:
                state.changed = True
                touched.append(state)
        result = ProcessedOutputs([], stopped, finished, [])
        for state in touched:
            state.changed = False
            output = state.output()
            if state.num_unfinished == 0:
                self.remove(state.request_id)
                result.done.append(state)
            if output is None:
                continue
            if state.stream is not None:
                state.stream.put(output)
            else:
                result.outputs.append(output)
        return result


MAX_TENANT_LEN = 256


# apply_chat_template's own arguments: set by paged, never by a request's chat_template_kwargs
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                 "add_generation_prompt", "continue_final_message", "padding", "truncation",
                                 "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                 "tokenizer_kwargs"})


def check_chat_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` as the template's extra variables ({} for None)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise InvalidRequestError(f"chat_template_kwargs: must be an object whose keys are names, e.g. "
                                  f"{{'enable_thinking': false}}; got {kwargs!r}")
    taken = sorted(_TEMPLATE_ARGUMENTS.intersection(kwargs))
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs: {taken[0]!r} is set by the server, not the request "
                                  "(the template's own variables, such as enable_thinking, are accepted)")
    return kwargs


LORA_NOT_ENABLED = ("LoRA adapters are not enabled; start the engine with --enable-lora (lora.enable_lora, "
                    "LLM(enable_lora=True))")


def check_lora_request(lora_request: Any, info: ModelInfo) -> None:
    """A request's adapter: a ``LoRARequest`` with a name, an id >= 1 and a path, on an engine
    that serves adapters. Raises InvalidRequestError naming the field."""
    if info.max_loras == 0:
        raise InvalidRequestError(f"lora_request: {LORA_NOT_ENABLED}")
    if not isinstance(lora_request, LoRARequest):
        raise InvalidRequestError(f"lora_request: must be a LoRARequest(lora_name, lora_int_id, lora_path), "
                                  f"got {type(lora_request).__name__}")
    lora_id = lora_request.lora_int_id
    if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
        raise InvalidRequestError(f"lora_request.lora_int_id: invalid value {lora_id!r}; must be an integer >= 1")
    for name in ("lora_name", "lora_path"):
        value = getattr(lora_request, name)
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"lora_request.{name}: invalid value {value!r}; must be a non-empty string")


def check_request_metadata(tenant, deadline_s) -> None:
    """The scheduling metadata of a request: ``tenant`` (the OpenAI ``user``) and ``deadline_s``
    (seconds after arrival by which it should finish). Raises InvalidRequestError naming the field."""
    if tenant is not None and (not isinstance(tenant, str) or len(tenant) > MAX_TENANT_LEN):
        raise InvalidRequestError(f"user: invalid value {tenant!r}; must be a string of at most {MAX_TENANT_LEN} characters")
    if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                   or not math.isfinite(deadline_s) or deadline_s <= 0):
        raise InvalidRequestError(f"deadline_s: invalid value {deadline_s!r}; must be a number of seconds > 0")
