"""The engine core: scheduler + model runner, working in token ids only.

``step()`` = schedule, execute, append sampled tokens / free finished requests, and report one
``EngineCoreOutput`` per request that got a token (or finished). Tokenization, detokenization,
stop strings and n > 1 fan-out belong to the front-end (paged.core.frontend.processor), so the same core
runs in-process (``LLMEngine``) or in its own process behind ZeroMQ.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from paged.core.config import EngineConfig, resolve_plugins
from paged.core.engine.kv_cache_manager import KVCacheManager
from paged.core.engine.request import Request, RequestStatus
from paged.core.engine.scheduler import Scheduler

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


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "rejected" (by the policy, no tokens)
    stop_token_id: int | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprobs per new token, when asked for
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    reject_reason: str | None = None  # with finish_reason "rejected": the policy's reason


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
        from paged.core.engine.tp_ranks import TensorParallelExecutor, configure_cpu_threads
        from paged.core.engine.model_runner import ModelRunner, resolve_device
        from paged.core.registry import get_registry

        self.config = config
        registry = registry or get_registry()
        self.device = resolve_device(config.device)
        self.plugins = resolve_plugins(config, registry, self.device.type)
        configure_cpu_threads(config, self.device)
        # Tensor parallelism: this process becomes rank 0 (the other ranks start or join here).
        self.executor = TensorParallelExecutor.start(config, self.device)
        if self.executor is not None:
            self.device = self.executor.device
        logger.info(
            "device %s, attention backend %r, policy %r", self.device, self.plugins.attention.name, self.plugins.policy.name
        )
        try:
            self.runner = ModelRunner(config, self.plugins, registry, self.device)
        except BaseException:
            if self.executor is not None:
                self.executor.abort()  # the other ranks may be inside a collective: no stop broadcast
            raise
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.plugins.policy.factory(self.plugins.policy_options),
            self.kv_cache_manager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=self.runner.max_model_len,
            long_prefill_token_threshold=config.scheduler.long_prefill_token_threshold,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
        )
        self.model_info = ModelInfo(
            model_dir=str(self.runner.model_dir),
            max_model_len=self.runner.max_model_len,
            vocab_size=self.runner.vocab_size,
            eos_token_ids=eos_token_ids(self.runner.model_dir, self.runner.hf_config),
            num_blocks=self.runner.num_blocks,
            block_size=config.cache.block_size,
        )
        self.stats = CoreStats()

    def add_request(self, request: Request) -> None:
        """Queue a request; raises InvalidRequestError if it could never run."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        result = self.runner.execute(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, result.sampled_token_ids)
        stats = self.stats
        stats.num_steps += 1
        stats.num_preemptions += len(scheduler_output.preempted_request_ids)
        stats.kv_usage = self.kv_cache_manager.usage
        stats.peak_kv_usage = max(stats.peak_kv_usage, stats.kv_usage)
        outputs = []
        for request in updated:
            token = request.output_token_ids[-1]
            finished = request.is_finished
            logprobs = result.logprobs.get(request.request_id)
            outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    [token],
                    finish_reason=request.status.finish_reason,
                    stop_token_id=token if finished and request.status == RequestStatus.FINISHED_STOPPED else None,
                    logprobs=[logprobs] if logprobs is not None else [],
                    arrival_time=request.arrival_time,
                    first_scheduled_time=request.first_scheduled_time,
                    first_token_time=request.first_token_time,
                    finished_time=request.finished_time,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    num_preemptions=request.num_preemptions,
                )
            )
        for request in scheduler_output.rejected:  # turned away by the policy before running
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=request.status.finish_reason,
                                            arrival_time=request.arrival_time, finished_time=request.finished_time,
                                            reject_reason=request.reject_reason))  # fmt: skip
        return outputs

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any; idempotent."""
        if self.executor is not None:
            self.executor.shutdown()

    def snapshot_stats(self) -> CoreStats:
        stats = self.stats
        stats.num_running = len(self.scheduler.running)
        stats.num_waiting = len(self.scheduler.waiting)
        stats.kv_usage = self.kv_cache_manager.usage
        prefix = self.kv_cache_manager.prefix_cache_stats
        stats.prefix_cache_queries, stats.prefix_cache_hits = prefix.queries, prefix.hits
        return stats


def eos_token_ids(model_dir, hf_config=None) -> list[int]:
    """EOS ids: generation_config.json first (it may list several), else config.json's."""
    value = None
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
    if value is None and hf_config is not None:
        value = getattr(hf_config, "eos_token_id", None)
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value]
    return []
