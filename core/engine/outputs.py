"""The engine core's two per-request messages, each the one type used both in-process and on
the wire between an engine-core process and its front-end: ``EngineCoreRequest`` (what a
front-end adds; ``EngineCore.add_request`` builds the engine's ``Request`` from it) and
``EngineCoreOutput`` (what one step reports per request, with its ``TokenLogprobs``)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from paged.core.engine.request import Request, RequestStatus
from paged.core.lora import LoRARequest
from paged.core.pooling_params import PoolingParams
from paged.core.sampling_params import SamplingParams


@dataclass
class TokenLogprobs:
    """Logprob information for one sampled token."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token (1 + the number of tokens with a strictly larger logprob)
    top: list[tuple[int, float]]  # the sampling_params.logprobs most likely (token_id, logprob), best first


class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True):
    """One core request (one sample of a front-end request), validated by the front-end, which
    builds it once and sends it as is: in-process to ``EngineCore.add_request``, or encoded to
    an engine-core process (``tag``: its name in ``paged.core.ipc.messages.CoreRequest``). The n
    samples of a request share one ``prompt_token_ids`` list: nothing may mutate it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    eos_token_id: int | None = None
    max_tokens: int = 16  # resolved by the front-end against max_model_len
    tenant: str | None = None
    deadline: float | None = None  # absolute, time.monotonic() (the same clock in every process)
    pooling_params: PoolingParams | None = None  # a pooling request (model.runner: pooling)
    lora_request: LoRARequest | None = None  # the adapter it runs with (paged.core.lora); None: the base model

    def to_request(self) -> Request:
        """The engine's own request (it copies the prompt into its growing token list)."""
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params, arrival_time=self.arrival_time,
                       priority=self.priority, cache_salt=self.cache_salt, eos_token_id=self.eos_token_id,
                       max_tokens=self.max_tokens, tenant=self.tenant, deadline=self.deadline,
                       pooling_params=self.pooling_params, lora_request=self.lora_request)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request's new token(s) this step and, when it ended, why (msgpack-encodable as is)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "rejected" (by the policy) | "error"
    stop_token_id: int | None = None
    logprobs: list[TokenLogprobs] = []  # one per new token, when asked for
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    reject_reason: str | None = None  # with finish_reason "rejected": the policy's reason
    error: str | None = None  # with finish_reason "error": who failed, how (paged.core.engine.plugin_faults)
    # with the first token, when asked for: one entry per prompt token after the first
    prompt_logprobs: list[TokenLogprobs] | None = None
    pooled: bytes | None = None  # a pooling request's vector: float32, little-endian (its whole output)

    @classmethod
    def ended(cls, request: Request) -> "EngineCoreOutput":
        """A request that ended this step without a new token (rejected, or failed)."""
        return cls(request.request_id, [], request.status.finish_reason, arrival_time=request.arrival_time,
                   first_scheduled_time=request.first_scheduled_time, first_token_time=request.first_token_time,
                   finished_time=request.finished_time, num_preemptions=request.num_preemptions,
                   reject_reason=request.reject_reason or None, error=request.error or None)

    @classmethod
    def of(cls, request: Request, logprobs: TokenLogprobs | None = None) -> "EngineCoreOutput":
        """The request's last sampled token (appended just now) and its state."""
        token = request.output_token_ids[-1]
        status = request.status
        # Positional, in field order (one per request per step: keywords cost a third more).
        return cls(
            request.request_id,
            [token],
            status.finish_reason,
            token if status is RequestStatus.FINISHED_STOPPED else None,
            [logprobs] if logprobs is not None else [],
            request.arrival_time,
            request.first_scheduled_time,
            request.first_token_time,
            request.finished_time,
            request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
            request.num_preemptions,
        )
