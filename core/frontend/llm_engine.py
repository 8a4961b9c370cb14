"""The in-process engine: add_request / step / abort_request.

``LLMEngine`` = InputProcessor (tokenize, validate, fan out n > 1, build the core's
``EngineCoreRequest``s) + EngineCore (scheduler and model runner, token ids only; it builds its
``Request``s from those messages) + OutputProcessor (detokenize, stop strings, gather samples,
hand out outputs as each request's ``RequestOutputKind`` asks). A request with ``n > 1`` runs as
n child requests that share the prompt's KV blocks through the prefix cache (the first child's
full prompt blocks are cached when allocated; its siblings, admitted in the same step, hit them).
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from paged.core.config import EngineConfig
from paged.core.engine.engine_core import EngineCore
from paged.core.errors import ConfigError, InvalidRequestError
from paged.core.frontend.outputs import RequestOutput, RequestOutputKind
from paged.core.frontend.processor import InputProcessor, OutputProcessor, structured_output_validator
from paged.core.engine.request import RequestStatus
from paged.core.lora import LoRARequest
from paged.core.sampling_params import SamplingParams


def check_offline_parallelism(config: EngineConfig) -> None:
    """The in-process engine is one engine core: data parallelism (several cores, each with its
    own KV cache, behind one front-end) exists only in ``paged serve``."""
    dp = config.parallel.data_parallel_size
    if dp > 1:
        raise ConfigError(
            f"parallel.data_parallel_size: {dp} is not supported by the offline engine (LLM, LLMEngine, "
            f"paged run, paged lab); data parallelism is supported by `paged serve --data-parallel-size {dp}`. "
            f"Use 1 here."
        )


class LLMEngine:
    def __init__(self, config: EngineConfig, registry=None) -> None:
        from paged.core.loading.generation_config import load_generation_defaults
        from paged.core.loading.tokenizer import load_tokenizer

        check_offline_parallelism(config)
        self.config = config
        self.core = EngineCore(config, registry)
        self.model_info = self.core.model_info
        self.tokenizer = load_tokenizer(self.model_info.tokenizer_dir or self.model_info.model_dir)
        # the model's generation_config.json sampling, for requests that leave those fields unset
        self.default_sampling = load_generation_defaults(self.model_info.model_dir)
        self.input_processor = InputProcessor(self.tokenizer, self.model_info, structured_output_validator(config, registry))
        self.output_processor = OutputProcessor()
        self._ids = itertools.count()

    @property
    def kv_cache_manager(self):
        return self.core.kv_cache_manager

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None) -> str:
        return self.input_processor.apply_chat_template(messages, tools, chat_template_kwargs)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        tenant: str | None = None,
        deadline_s: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError, or RequestRejectedError when
        the policy's admission control turns it away (nothing is queued then). ``tenant``: who
        sent it (fairness policies); ``deadline_s``: seconds after arrival by which it should finish.
        ``output_kind``: what ``step`` returns for it (``RequestOutputKind``; ``run_until_finished``
        needs CUMULATIVE or FINAL_ONLY, whose last output is the whole one). ``lora_request``: the
        LoRA adapter to run it with (read and checked by the core when first named)."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
        state, requests = self.input_processor.process(
            request_id, prompt, params or SamplingParams(), priority, arrival_time, cache_salt, add_special_tokens,
            tenant=tenant, deadline_s=deadline_s, output_kind=output_kind, lora_request=lora_request,
        )
        added = []
        try:
            for request in requests:  # the core builds its Request from each message
                self.core.add_request(request)
                added.append(request.request_id)
        except Exception:
            self.core.abort_requests(added)
            raise
        self.output_processor.add(state)
        return request_id

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter now (read and checked: InvalidRequestError naming the file and
        the field); requests may also name one that is not registered yet."""
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.core.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.core.list_loras()

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """End requests now and free their blocks; unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            self.core.abort_requests(self.output_processor.remove(request_id))

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor-parallel ranks), if any; idempotent."""
        self.core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs it produced, as each request's output kind says
        (CUMULATIVE, DELTA: one per request that changed; FINAL_ONLY: one per request that
        finished)."""
        result = self.output_processor.process(self.core.step())
        if result.stopped:
            self.core.abort_requests(result.stopped, RequestStatus.FINISHED_STOPPED)
        return result.outputs

    def run_until_finished(
        self, request_ids: Sequence[str], on_finished: Callable[[RequestOutput], None] | None = None
    ) -> list[RequestOutput]:
        """Step until every request has finished; their final outputs in the order of
        ``request_ids`` (``on_finished`` sees each as it finishes). On any error or interrupt
        the requests are aborted before it propagates, so the engine stays usable."""
        final: dict[str, RequestOutput] = {}
        try:
            while self.has_unfinished_requests():
                for output in self.step():
                    if output.finished:
                        final[output.request_id] = output
                        if on_finished is not None:
                            on_finished(output)
        except BaseException:
            self.abort_request(list(request_ids))
            raise
        return [final[i] for i in request_ids]
