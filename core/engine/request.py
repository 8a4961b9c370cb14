"""A request as the scheduler sees it: token ids, progress, and its place in the KV cache."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from paged.core.policy import RequestView
from paged.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"  # the policy's admission control turned it away
    FINISHED_ERROR = "error"  # a plugin failed on it (paged.core.engine.plugin_faults); ``error`` says how

    def __init__(self, value: str) -> None:
        # Plain attributes, not properties: read for every scheduled request at every step.
        self.finished: bool = value in ("stop", "length", "abort", "rejected", "error")
        self.finish_reason: str | None = value if self.finished else None


@dataclass(eq=False)
class Request:
    """Invariants: ``all_token_ids = prompt_token_ids + output_token_ids``;
    ``0 <= num_computed_tokens <= len(all_token_ids)``; the request holds
    ``ceil(num_computed_tokens / block_size)`` or more blocks while running (the KV manager owns
    the block list). ``block_hashes[i]`` is the chained hash of full block i of all_token_ids.
    Policies see it through ``view``; the fields the view reads are the contract's
    (``paged.core.policy.RequestFields``), so renaming one here means renaming it there.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    eos_token_id: int | None = None
    max_tokens: int = 16  # resolved against max_model_len when added to the engine
    tenant: str | None = None  # who sent it (OpenAI ``user``), for fairness policies
    deadline: float | None = None  # absolute, on the scheduler's clock; None = no deadline
    # A LoRA adapter (paged.core.lora.LoRARequest) or None: the base model alone
    lora_request: Any = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    # Structured output: the matcher (paged.core.structured_output.GrammarMatcher), set by the
    # engine core once compiled; it has accepted exactly output_token_ids.
    grammar: Any = None
    # Speculative decoding: the drafts the proposer made for the next step (the scheduler takes
    # them, paged.core.engine.spec_decode); never part of all_token_ids.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_window_drafted: int = 0  # draft tokens verified (and accepted) since the last acceptance check
    spec_window_accepted: int = 0
    spec_paused_until: int = 0  # the speculator's step from which it is asked again
    # Prompt logprobs (sampling_params.prompt_logprobs): an entry per prompt token after the first,
    # filled chunk by chunk by the runner, which computes only those not here yet (a request
    # preempted in its prefill does not get them twice); None when not asked for.
    prompt_logprobs: list | None = None
    # A pooling request (paged.core.pooling): its whole output is one pooled vector, made when its
    # prompt is computed; ``pool_every_token``: the pooler reads every prompt position's hidden state.
    pooling_params: Any = None
    pool_every_token: bool = False
    lora_int_id: int = 0  # lora_request's id (0: none): its slot, its block hashes
    # Set by the policy at admission; compared with < (lower runs first, higher is preempted).
    sort_key: tuple = ()
    # Policy inputs the scheduler maintains (read through RequestView).
    prefix_hit_tokens: int = 0  # tokens the prefix cache holds for it at the last lookup
    num_service_tokens: int = 0  # tokens computed for it so far, recomputation included
    running_s: float = 0.0  # seconds spent running before the current run
    running_since: float | None = None  # start of the current run; None while not running
    reject_reason: str = ""  # set with FINISHED_REJECTED
    error: str = ""  # set with FINISHED_ERROR, or during a step by code that found it failed
    # Timestamps for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        if self.lora_request is not None:
            self.lora_int_id = self.lora_request.lora_int_id
        self.view = RequestView(self)  # what policies see
        self._draft_view = None
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    @property
    def computes_every_prompt_token(self) -> bool:
        """Prompt logprobs still to make, or a pooler that reads every prompt position: each of
        them must run, so no prefix-cache hit is taken (its blocks are still cached for others)."""
        if self.pool_every_token:
            return True
        done = self.prompt_logprobs
        return done is not None and len(done) < len(self.prompt_token_ids) - 1

    @property
    def draft_view(self):
        """What a speculative proposer sees (paged.core.speculative.DraftRequest), made once."""
        if self._draft_view is None:
            from paged.core.speculative import DraftRequest

            self._draft_view = DraftRequest(self)
        return self._draft_view

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    # Token-level stop conditions are decided here and nowhere else: the scheduler asks
    # ``check_stop`` after each appended token, and the sampler bans ``stop_token_ids()`` until
    # ``min_tokens`` are out. (Stop *strings* need the decoded text: the front-end's detokenizer.)

    def stop_token_ids(self) -> set[int]:
        """The tokens that end this request: ``stop_token_ids``, and EOS unless ``ignore_eos``."""
        params = self.sampling_params
        ids = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            ids.add(self.eos_token_id)
        return ids

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """After a token was appended: FINISHED_STOPPED (a stop token, once ``min_tokens`` are
        out), FINISHED_LENGTH (``max_tokens`` or ``max_model_len`` reached) or None."""
        params = self.sampling_params
        num_output = len(self.output_token_ids)
        token = self.output_token_ids[-1]
        if num_output >= params.min_tokens:
            if token in params.stop_token_ids or (not params.ignore_eos and token == self.eos_token_id):
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens or len(self.all_token_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
