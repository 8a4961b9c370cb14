"""Who runs a replay's step: ``SimExecutor`` (the real Scheduler, KVCacheManager and policy;
the model is a dummy token) or ``EngineExecutor`` (the real engine). Both run the scheduler on
the replay's clock (``now``), so a policy's ``now``, arrival times and deadlines agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.core.errors import ConfigError, PagedError
from paged.core.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from paged.core.engine.request import Request
from paged.core.engine.scheduler import Scheduler
from paged.core.engine.spec_decode import SpecDecodeStats
from paged.core.frontend.outputs import RequestOutputKind
from paged.core.lab.cost import CostModel
from paged.core.lab.records import LabRequest
from paged.core.sampling_params import SamplingParams

WARMUP_ID = "__paged_lab_warmup__"


# --- executors: who runs a step --------------------------------------------------------------------------
@dataclass
class SimSettings:
    """What the simulated scheduler and KV cache need: the engine's settings without a model."""

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True

    @classmethod
    def from_config(cls, config, cost: CostModel | None = None) -> "SimSettings":
        """Scheduler and cache settings from the engine config; what needs a model (the number of
        KV blocks, max_model_len) from ``--num-kv-blocks`` / ``--max-model-len``, else from the
        engine the cost model was calibrated on (its KV bytes per token for ``--kv-cache-memory-gib``)."""
        engine = (cost.engine if cost else {}) or {}
        cache, sched = config.cache, config.scheduler
        block_size = cache.block_size
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        elif cache.kv_cache_memory_gib is not None and engine.get("kv_bytes_per_token"):
            num_blocks = int(cache.kv_cache_memory_gib * 2**30 // (engine["kv_bytes_per_token"] * block_size))
        elif engine.get("num_blocks") and engine.get("block_size"):
            num_blocks = engine["num_blocks"] * engine["block_size"] // block_size
        else:
            raise ConfigError(
                "simulation: the number of KV blocks is unknown; give --num-kv-blocks (or a cost model "
                "from `paged lab calibrate`, which records the engine's)"
            )
        max_model_len = config.model.max_model_len or engine.get("max_model_len") or 4096
        return cls(int(num_blocks), block_size, cache.enable_prefix_caching, sched.max_num_seqs,
                   sched.max_num_batched_tokens, int(max_model_len), sched.long_prefill_token_threshold,
                   sched.enable_chunked_prefill)


class SimExecutor:
    """The real Scheduler, KVCacheManager and policy; the model is a dummy token."""

    mode = "sim"

    def __init__(self, policy, settings: SimSettings) -> None:
        self.settings = settings
        self.now = 0.0  # the replay's clock, set by the driver
        self.kv = KVCacheManager(settings.num_blocks, settings.block_size, settings.enable_prefix_caching)
        self.scheduler = Scheduler(
            policy, self.kv, max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens, max_model_len=settings.max_model_len,
            long_prefill_token_threshold=settings.long_prefill_token_threshold,
            enable_chunked_prefill=settings.enable_chunked_prefill, clock=lambda: self.now,
        )

    def add(self, request: LabRequest) -> Request:
        """Queue it; raises RequestRejectedError when the policy turns it away."""
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
        core = Request(request.id, request.prompt_token_ids, params, arrival_time=request.arrival,
                       priority=request.priority, cache_salt=request.cache_salt, max_tokens=request.output_len,
                       tenant=request.tenant, deadline=request.deadline)
        self.scheduler.add_request(core)
        return core

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self):
        sched = self.scheduler
        out = sched.schedule()
        snapshot = (len(sched.running), len(sched.waiting), self.kv.usage)
        sched.update_from_output(out, {s.request.request_id: 0 for s in out.scheduled if s.is_sampled})
        return out, snapshot

    def check(self, request: LabRequest) -> None:
        self.scheduler.check_request(len(request.prompt_token_ids), request.output_len)

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        return self.kv.prefix_cache_stats

    spec_decode = None  # the simulator does not speculate


class EngineExecutor:
    """The real engine (``LLMEngine``): the model runs; each step's scheduler output is observed."""

    def __init__(self, engine, mode: str) -> None:
        self.engine = engine
        self.mode = mode
        self.scheduler = engine.core.scheduler
        self.kv = engine.kv_cache_manager
        self.now = 0.0  # the replay's clock, set by the driver: the scheduler's clock too
        self.scheduler.clock = lambda: self.now
        self._last = None

        def observe(out) -> None:
            self._last = (out, (len(self.scheduler.running), len(self.scheduler.waiting), self.kv.usage))

        engine.core.schedule_observers.append(observe)
        self._requests: dict[str, Request] = {}

    def warm_up(self) -> None:
        """One short request through every stage, then a clean prefix cache and counters."""
        engine = self.engine
        engine.add_request(WARMUP_ID, list(range(TOKEN_WARMUP, TOKEN_WARMUP + 24)),
                           SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        self.kv.reset_prefix_cache()
        self.kv.prefix_cache_stats = PrefixCacheStats()
        speculator = engine.core.speculator
        if speculator is not None:
            speculator.stats = SpecDecodeStats()

    def add(self, request: LabRequest) -> Request:
        self.engine.add_request(request.id, request.prompt_token_ids, request.sampling_params(),
                                priority=request.priority, arrival_time=request.arrival,
                                cache_salt=request.cache_salt, tenant=request.tenant,
                                deadline_s=request.deadline_s, output_kind=RequestOutputKind.FINAL_ONLY)
        return self.scheduler.requests[request.id]

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self):
        self._last = None
        self.engine.step()
        if self._last is None:
            raise PagedError("lab: the engine stepped without scheduling")
        return self._last

    def check(self, request: LabRequest) -> None:
        vocab = self.engine.model_info.vocab_size
        bad = [t for t in request.prompt_token_ids if t >= vocab]
        if bad:
            raise PagedError(f"request {request.id!r}: token id {bad[0]} >= the model's vocabulary ({vocab})")
        self.scheduler.check_request(len(request.prompt_token_ids), request.output_len)

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        return self.kv.prefix_cache_stats

    @property
    def spec_decode(self) -> dict[str, Any] | None:
        """The speculator's counters since the warm-up (``SpecDecodeStats.to_dict``), or None
        when the engine does not speculate."""
        speculator = self.engine.core.speculator
        return None if speculator is None else {"method": speculator.method, **speculator.stats.to_dict()}


TOKEN_WARMUP = 200




def engine_settings(engine) -> dict[str, Any]:
    """The settings a simulation of this engine needs (recorded in cost models)."""
    config, info, runner = engine.config, engine.model_info, engine.core.runner
    layout = getattr(runner, "layout", None)
    per_block = getattr(layout, "bytes_per_block", None)
    return {
        "model_dir": info.model_dir,
        "num_blocks": info.num_blocks,
        "block_size": info.block_size,
        "kv_bytes_per_token": per_block / info.block_size if per_block else None,
        "max_model_len": info.max_model_len,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "long_prefill_token_threshold": config.scheduler.long_prefill_token_threshold,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "device": str(engine.core.device),
        "dtype": str(getattr(runner, "dtype", "")),
        "attention": engine.core.plugins.attention.name,
    }
