"""The engine core: scheduler + model runner, working in token ids only.

``step()`` = schedule, execute, append sampled tokens / free finished requests, and report one
``EngineCoreOutput`` per request that got a token (or finished). Tokenization, detokenization,
stop strings and n > 1 fan-out belong to the front-end (paged.core.frontend.processor), so the same core
runs in-process (``LLMEngine``) or in its own process behind ZeroMQ.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Callable, Iterable

from paged.core.config import EngineConfig, resolve_plugins, resolve_structured_output
from paged.core.engine.grammar import StructuredOutputManager
from paged.core.engine.kv_cache_manager import KVCacheManager
from paged.core.engine.outputs import EngineCoreOutput
from paged.core.engine.request import Request, RequestStatus
from paged.core.engine.scheduler import Scheduler, SchedulerOutput
from paged.core.errors import InvalidRequestError, RequestRejectedError
from paged.core.loading.model_config import resolve_model

logger = logging.getLogger("paged")


@dataclass
class ModelInfo:
    """What a front-end needs to know about the core's model to build requests."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    tokenizer_dir: str = ""  # the model's own directory unless model.tokenizer names another


@dataclass
class CoreStats:
    num_steps: int = 0
    num_preemptions: int = 0
    peak_kv_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig, registry=None) -> None:
        from paged.core.engine.tp_ranks import TensorParallelRanks, configure_cpu_threads
        from paged.core.engine.model_runner import ModelRunner, resolve_device
        from paged.core.registry import get_registry

        self.config = config
        registry = registry or get_registry()
        self.device = resolve_device(config.device)
        self.plugins = resolve_plugins(config, registry, self.device.type)
        # The model's settings are settled (and checked) before any rank starts or loads weights.
        self.model_config = resolve_model(config, registry, self.device)
        configure_cpu_threads(config, self.device)
        # Tensor parallelism: this process becomes rank 0 (the other ranks start or join here).
        self.tp_ranks = TensorParallelRanks.start(config, self.device)
        if self.tp_ranks is not None:
            self.device = self.tp_ranks.device
        logger.info(
            "device %s, attention backend %r, policy %r", self.device, self.plugins.attention.name, self.plugins.policy.name
        )
        try:
            self.runner = ModelRunner(config, self.plugins, self.model_config, self.device, registry)
        except BaseException:
            if self.tp_ranks is not None:
                self.tp_ranks.abort()  # the other ranks may be inside a collective: no stop broadcast
            raise
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.plugins.policy.factory(self.plugins.policy_options),
            self.kv_cache_manager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=self.model_config.max_model_len,
            long_prefill_token_threshold=config.scheduler.long_prefill_token_threshold,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
        )
        self.model_info = ModelInfo(
            model_dir=str(self.model_config.model_dir),
            max_model_len=self.model_config.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.model_config.eos_token_ids,
            num_blocks=self.runner.num_blocks,
            block_size=config.cache.block_size,
            tokenizer_dir=str(self.model_config.tokenizer_dir),
        )
        spec, options = resolve_structured_output(config, registry)
        self.structured_output = StructuredOutputManager(
            spec, options, self.model_info.tokenizer_dir or self.model_info.model_dir, self.model_config.vocab_size,
            self.model_info.eos_token_ids, max_workers=config.structured_output.compile_workers,
        )
        # Constrained requests whose matcher is being built: outside the scheduler until ready.
        self.compiling: dict[str, tuple[Request, Future]] = {}
        self._grammars_admitted = False  # until a constrained request runs, steps skip the matcher pass
        self.stats = CoreStats()
        # Called with each step's SchedulerOutput right after scheduling, before the model runs
        # (the policy lab records steps this way); empty in serving.
        self.schedule_observers: list[Callable[[SchedulerOutput], None]] = []

    def add_request(self, request: Request) -> None:
        """Queue a request; raises InvalidRequestError if it could never run. A constrained one
        waits here, outside the scheduler, until its grammar is compiled."""
        params = request.sampling_params.structured_output
        if params is None:
            self.scheduler.add_request(request)
            return
        if request.request_id in self.scheduler.requests or request.request_id in self.compiling:
            raise InvalidRequestError(f"request_id: {request.request_id!r} is already in use")
        self.scheduler.check_request(request.num_prompt_tokens, request.max_tokens)
        self.compiling[request.request_id] = (request, self.structured_output.submit(params))

    def abort_requests(self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        request_ids = list(request_ids)
        for request_id in request_ids:
            entry = self.compiling.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.compiling)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move the requests whose matcher is ready into the scheduler; end those whose
        constraint failed to compile (finish_reason "abort"; the front-end validated it, so this
        is a backend limit that only a full compile finds). Waits a little when nothing else can
        run, rather than spinning."""
        if not self.scheduler.has_unfinished_requests():
            wait([f for _, f in self.compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        failed = []
        for request_id, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                request.grammar = future.result()
                self._grammars_admitted = True
            except Exception as e:
                logger.warning("request %s: structured output failed to compile: %s", request_id, e)
                request.status = RequestStatus.FINISHED_ABORTED
                failed.append(EngineCoreOutput(request_id, [], finish_reason="abort", arrival_time=request.arrival_time))
                continue
            try:
                self.scheduler.add_request(request)  # the policy's admission control decides now
            except RequestRejectedError as e:
                request.status = RequestStatus.FINISHED_REJECTED
                failed.append(EngineCoreOutput(request_id, [], finish_reason="rejected", arrival_time=request.arrival_time,
                                               reject_reason=str(e)))  # fmt: skip
        return failed

    def step(self) -> list[EngineCoreOutput]:
        failed = self._admit_compiled() if self.compiling else []
        scheduler_output = self.scheduler.schedule()
        for observe in self.schedule_observers:
            observe(scheduler_output)
        result = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, result.sampled_token_ids, result.logprobs)
        # Advance each constrained request's matcher by the token it just received.
        constrained = {}
        if self._grammars_admitted:
            constrained = {s.request.request_id: s.request for s in scheduler_output.scheduled if s.request.grammar is not None}
        for index, output in enumerate(outputs if constrained else ()):
            request = constrained.get(output.request_id)
            if request is None:
                continue
            if not self.structured_output.accept(request, output.new_token_ids[-1]):
                # The mask allowed only tokens the grammar accepts: this is a backend fault.
                logger.error("request %s: the grammar refused its sampled token", request.request_id)
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
                logprobs = output.logprobs[-1] if output.logprobs else None
                outputs[index] = EngineCoreOutput.of(request, logprobs)
        stats = self.stats
        stats.num_steps += 1
        stats.num_preemptions += len(scheduler_output.preempted_request_ids)
        stats.kv_usage = self.kv_cache_manager.usage
        stats.peak_kv_usage = max(stats.peak_kv_usage, stats.kv_usage)
        for request in scheduler_output.rejected:  # turned away by the policy before running
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=request.status.finish_reason,
                                            arrival_time=request.arrival_time, finished_time=request.finished_time,
                                            reject_reason=request.reject_reason))  # fmt: skip
        return failed + outputs if failed else outputs

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any, and the compile threads; idempotent."""
        self.structured_output.shutdown()
        if self.tp_ranks is not None:
            self.tp_ranks.shutdown()

    def snapshot_stats(self) -> CoreStats:
        stats = self.stats
        stats.num_running = len(self.scheduler.running)
        stats.num_waiting = len(self.scheduler.waiting)
        stats.kv_usage = self.kv_cache_manager.usage
        prefix = self.kv_cache_manager.prefix_cache_stats
        stats.prefix_cache_queries, stats.prefix_cache_hits = prefix.queries, prefix.hits
        return stats

