"""Replaying a trace against a scheduler, step by step, with one of four clocks.

The driver loop is the same for every mode: admit the requests whose arrival time has come, run
one step, advance the clock, record what the step did; when nothing is left to run, move on to
the next arrival. What executes a step and how time advances differ:

=========  ======================================  =============================================
mode       a step runs                              the clock advances by
=========  ======================================  =============================================
``wall``   the real engine (``LLMEngine.step``)     the wall time it took; idle gaps are slept
``cpu``    the real engine                          the CPU time it took (process CPU seconds);
                                                    idle gaps are skipped. Immune to other
                                                    processes competing for the machine
``steps``  the real engine                          a fixed ``step_time``: the schedule does not
                                                    depend on timing, so it is reproducible
``sim``    ``Scheduler`` + ``KVCacheManager`` only  the cost model's time for the batch shape
=========  ======================================  =============================================

Arrival times are the trace's ``arrival_s`` times ``time_scale``. A request's ``arrival_time``
(what FCFS and priority aging compare) is that scaled trace time, so every mode orders requests
identically. Latencies are measured from it: TTFT = end of the step that produced the first
token - arrival; e2e = end of the step that produced the last token - arrival; TPOT = (e2e -
TTFT) / (output tokens - 1). The scheduler's own timestamps are not used.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from paged.core.errors import ConfigError, PagedError
from paged.core.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from paged.core.lab.cost import BatchShape, CostModel, batch_shape
from paged.core.lab.trace import Trace, prompt_token_ids
from paged.core.engine.request import Request
from paged.core.sampling_params import SamplingParams
from paged.core.engine.scheduler import Scheduler

logger = logging.getLogger("paged")

MODES = ("wall", "cpu", "steps", "sim")
WARMUP_ID = "__paged_lab_warmup__"


# --- what a replay submits ------------------------------------------------------------------------
@dataclass
class LabRequest:
    id: str
    arrival: float  # seconds from the replay start (trace time x time_scale)
    prompt_token_ids: list[int]
    output_len: int
    priority: int = 0
    cache_salt: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)

    def sampling_params(self) -> SamplingParams:
        """The trace's sampling fields, generating exactly ``output_len`` tokens."""
        drop = {"n", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output"}
        kept = {k: v for k, v in self.sampling.items() if k not in drop}
        kept.setdefault("temperature", 0.0)
        return SamplingParams.from_dict({**kept, "max_tokens": self.output_len, "ignore_eos": True})


def materialize(trace: Trace, *, seed: int | None = None, time_scale: float = 1.0,
                tokenize: Callable[[str], list[int]] | None = None, max_requests: int | None = None) -> list[LabRequest]:  # fmt: skip
    """Trace lines -> requests with token ids, in arrival order. ``seed`` (default: the trace
    header's) seeds the token ids of length-only prompts; ``n > 1`` becomes n requests."""
    if not time_scale > 0:
        raise ConfigError(f"--time-scale: invalid value {time_scale!r}; must be > 0")
    seed = trace.seed if seed is None else seed
    out: list[LabRequest] = []
    for index, request in enumerate(trace.requests[: max_requests or None]):
        if request.id is None:
            request.id = f"r{index}"
        tokens = prompt_token_ids(request, seed, tokenize)
        n = int(request.sampling.get("n", 1) or 1)
        for k in range(n):
            rid = request.id if n == 1 else f"{request.id}#{k}"
            out.append(LabRequest(rid, request.arrival_s * time_scale, tokens, request.num_output_tokens,
                                  request.priority, request.cache_salt, request.sampling))  # fmt: skip
    out.sort(key=lambda r: r.arrival)  # stable: ties keep the trace order
    return out


# --- what a replay records ------------------------------------------------------------------------
@dataclass(slots=True)
class StepRecord:
    index: int
    t_start: float
    t_end: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    prefill_attention: int
    prefill_seqs: int
    running: int  # after scheduling (the batch and the requests paused in it)
    waiting: int  # after scheduling
    kv_usage: float  # blocks in use after scheduling / all blocks
    preemptions: int
    finished: int
    measured_s: float | None = None  # real modes: wall seconds of the step
    measured_cpu_s: float | None = None  # real modes: CPU seconds of the step

    @property
    def batch_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def shape(self) -> BatchShape:
        return BatchShape(self.num_seqs, self.prefill_tokens, self.decode_tokens, self.context_tokens,
                          self.prefill_attention, self.prefill_seqs)  # fmt: skip

    def schedule_key(self) -> tuple:
        """Everything but the times: equal keys = the same scheduling decisions."""
        return (self.index, self.num_seqs, self.prefill_tokens, self.decode_tokens, self.context_tokens,
                self.prefill_seqs, self.running, self.waiting, round(self.kv_usage, 9), self.preemptions, self.finished)  # fmt: skip


@dataclass(slots=True)
class RequestRecord:
    id: str
    priority: int
    arrival: float
    prompt_len: int
    output_len: int  # what it was asked to generate
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_generated: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def queue(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finished is None or self.first_token is None or self.num_generated < 2:
            return None
        return (self.finished - self.first_token) / (self.num_generated - 1)


@dataclass
class ReplayResult:
    label: str  # the policy as given, e.g. "priority:aging_s=5"
    policy: str
    options: dict[str, Any]
    mode: str
    steps: list[StepRecord]
    requests: list[RequestRecord]
    schedule_digest: str  # SHA-256 over every step's (request id, computed, new tokens)
    engine_prefix_hit_rate: float  # the KV manager's own counter (re-admissions included)
    elapsed_s: float  # real seconds the replay took
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def num_preemptions(self) -> int:
        return sum(s.preemptions for s in self.steps)

    def to_dict(self, include_steps: bool = True) -> dict[str, Any]:
        out = {
            "label": self.label, "policy": self.policy, "options": self.options, "mode": self.mode,
            "schedule_digest": self.schedule_digest, "engine_prefix_hit_rate": self.engine_prefix_hit_rate,
            "elapsed_s": self.elapsed_s, "settings": self.settings, "num_steps": len(self.steps),
            "requests": [{**asdict(r), "ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e} for r in self.requests],
        }  # fmt: skip
        if include_steps:
            out["steps"] = [asdict(s) for s in self.steps]
        return out


# --- policies -----------------------------------------------------------------------------------------
@dataclass
class PolicyRun:
    """One policy of a comparison with its options (values as given; validated by its model)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.options.items())

    @classmethod
    def parse(cls, text: str) -> "PolicyRun":
        """``NAME`` or ``NAME:KEY=VALUE[,KEY=VALUE...]``."""
        name, _, rest = text.partition(":")
        name = name.strip()
        if not name:
            raise ConfigError(f"--policy: expected NAME or NAME:KEY=VALUE,..., got {text!r}")
        options: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--policy {text!r}: expected KEY=VALUE after ':', got {item!r}")
            options[key.strip()] = value.strip()
        return cls(name, options)

    def build(self, registry=None):
        """(spec, validated options, policy instance), through the plugin registry."""
        from paged.core.config import _validate_options
        from paged.core.registry import get_registry

        spec = (registry or get_registry()).policy(self.name)
        options = _validate_options(spec, self.options, f"policy {self.label!r} options")
        return spec, options, spec.factory(options)


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
                   sched.enable_chunked_prefill)  # fmt: skip


class SimExecutor:
    """The real Scheduler, KVCacheManager and policy; the model is a dummy token."""

    mode = "sim"

    def __init__(self, policy, settings: SimSettings) -> None:
        self.settings = settings
        self.kv = KVCacheManager(settings.num_blocks, settings.block_size, settings.enable_prefix_caching)
        self.scheduler = Scheduler(
            policy, self.kv, max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens, max_model_len=settings.max_model_len,
            long_prefill_token_threshold=settings.long_prefill_token_threshold,
            enable_chunked_prefill=settings.enable_chunked_prefill,
        )  # fmt: skip

    def add(self, request: LabRequest) -> Request:
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
        core = Request(request.id, request.prompt_token_ids, params, arrival_time=request.arrival,
                       priority=request.priority, cache_salt=request.cache_salt, max_tokens=request.output_len)  # fmt: skip
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


class EngineExecutor:
    """The real engine (``LLMEngine``): the model runs; each step's scheduler output is observed."""

    def __init__(self, engine, mode: str) -> None:
        self.engine = engine
        self.mode = mode
        self.scheduler = engine.core.scheduler
        self.kv = engine.kv_cache_manager
        self._last = None

        def observe(out) -> None:
            self._last = (out, (len(self.scheduler.running), len(self.scheduler.waiting), self.kv.usage))

        engine.core.schedule_observers.append(observe)
        self._requests: dict[str, Request] = {}

    def warm_up(self) -> None:
        """One short request through every stage, then a clean prefix cache and counters."""
        engine = self.engine
        engine.add_request(WARMUP_ID, list(range(TOKEN_WARMUP, TOKEN_WARMUP + 24)),
                           SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))  # fmt: skip
        while engine.has_unfinished_requests():
            engine.step()
        self.kv.reset_prefix_cache()
        self.kv.prefix_cache_stats = PrefixCacheStats()

    def add(self, request: LabRequest) -> Request:
        self.engine.add_request(request.id, request.prompt_token_ids, request.sampling_params(),
                                priority=request.priority, arrival_time=request.arrival,
                                cache_salt=request.cache_salt)  # fmt: skip
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


TOKEN_WARMUP = 200


# --- the driver loop ----------------------------------------------------------------------------------------
def run_replay(requests: Sequence[LabRequest], executor, *, cost: CostModel | None = None, label: str = "",
               policy: str = "", options: dict | None = None) -> ReplayResult:  # fmt: skip
    """Replay ``requests`` (sorted by arrival) on ``executor``; ``cost`` drives the clock in the
    ``sim`` and ``steps`` modes."""
    mode = executor.mode
    if mode in ("sim", "steps") and cost is None:
        raise ConfigError(f"lab: mode {mode!r} needs a cost model (or a fixed step time)")
    for request in requests:
        try:
            executor.check(request)
        except PagedError as e:
            raise PagedError(f"trace request {request.id!r} cannot be replayed: {e}") from None
    records = {r.id: RequestRecord(r.id, r.priority, r.arrival, len(r.prompt_token_ids), r.output_len) for r in requests}
    live: dict[str, tuple[Request, RequestRecord]] = {}
    steps: list[StepRecord] = []
    digest = hashlib.sha256()
    perf, cpu = time.perf_counter, time.process_time
    wall_t0 = perf()
    now = 0.0
    i, n = 0, len(requests)
    empty_steps = 0
    last_end: float | None = None  # end of the previous step, unless the engine went idle since
    while i < n or executor.busy():
        if mode == "wall":
            now = perf() - wall_t0
        while i < n and requests[i].arrival <= now:
            core = executor.add(requests[i])
            live[requests[i].id] = (core, records[requests[i].id])
            i += 1
        if not executor.busy():
            if i >= n:
                break
            target = requests[i].arrival
            if mode == "wall":
                time.sleep(max(0.0, target - (perf() - wall_t0)))
            else:
                now = target
            last_end = None
            continue
        # Back to back steps touch (in wall mode the bookkeeping between them counts to the next).
        t_start = now if last_end is None else last_end
        w0, c0 = perf(), cpu()
        out, (running, waiting, kv_usage) = executor.step()
        w1, c1 = perf(), cpu()
        shape = batch_shape(out)
        if mode == "wall":
            now = w1 - wall_t0
        elif mode == "cpu":
            now += c1 - c0
        else:
            now += cost.predict(shape)
        finished = 0
        for s in out.scheduled:
            core = s.request
            digest.update(f"{core.request_id}:{s.num_computed_tokens}:{s.num_new_tokens};".encode())
            entry = live.get(core.request_id)
            if entry is None or entry[0] is not core:
                continue
            record = entry[1]
            if record.first_scheduled is None:
                record.first_scheduled = t_start
            generated = core.num_output_tokens
            if generated > record.num_generated:
                record.num_generated = generated
                if record.first_token is None:
                    record.first_token = now
            if core.is_finished:
                record.finished = now
                record.num_cached_tokens = max(core.num_cached_tokens, 0)
                record.num_preemptions = core.num_preemptions
                del live[core.request_id]
                finished += 1
        digest.update(b"|")
        last_end = now
        steps.append(
            StepRecord(len(steps), t_start, now, shape.num_seqs, shape.prefill_tokens, shape.decode_tokens,
                       shape.context_tokens, shape.prefill_attention, shape.prefill_seqs, running, waiting, kv_usage,
                       len(out.preempted_request_ids), finished,
                       (w1 - w0) if mode != "sim" else None, (c1 - c0) if mode != "sim" else None)
        )  # fmt: skip
        empty_steps = empty_steps + 1 if not out.scheduled else 0
        if empty_steps > 1000:
            raise PagedError("lab: the scheduler scheduled nothing for 1000 steps in a row with requests left")
    stats = executor.prefix_stats
    return ReplayResult(label or policy, policy, dict(options or {}), mode, steps, list(records.values()),
                        digest.hexdigest(), stats.hit_rate, perf() - wall_t0)  # fmt: skip


# --- one comparison: a trace, several policies -----------------------------------------------------------------
def _tokenizer_for(config, cost: CostModel | None):
    from paged.core.loading.loader import load_tokenizer, resolve_model_dir

    source = config.model.tokenizer or config.model.model or ((cost.engine if cost else {}) or {}).get("model_dir")
    tokenizer = load_tokenizer(resolve_model_dir(source) if not config.model.tokenizer else source)
    return lambda text: tokenizer(text, add_special_tokens=True)["input_ids"]


def replay_trace(trace: Trace, policies: Sequence[PolicyRun], config, *, mode: str = "wall",
                 cost: CostModel | None = None, step_time: float = 0.01, time_scale: float = 1.0,
                 seed: int | None = None, max_requests: int | None = None, registry=None,
                 log: Callable[[str], None] | None = None) -> list[ReplayResult]:  # fmt: skip
    """Replay ``trace`` once per policy, on the real engine (modes wall, cpu, steps: an engine
    built from ``config`` per policy, warmed up first) or simulated (mode sim, with ``cost``)."""
    if mode not in MODES:
        raise ConfigError(f"--clock: invalid value {mode!r}; one of {', '.join(MODES)}")
    if mode == "steps":
        if not step_time > 0:
            raise ConfigError(f"--step-time: invalid value {step_time!r}; must be > 0")
        cost = CostModel.constant(step_time)
    if not policies:
        policies = [PolicyRun(config.scheduler.policy, dict(config.scheduler.policy_options))]
    built = [(run, *run.build(registry)) for run in policies]  # every name and option checked first
    needs_tokenizer = any(r.prompt is not None and r.prompt_token_ids is None for r in trace.requests[: max_requests or None])
    tokenize = None
    if needs_tokenizer:
        tokenize = _tokenizer_for(config, cost)
    requests = materialize(trace, seed=seed, time_scale=time_scale, tokenize=tokenize, max_requests=max_requests)
    results = []
    for run, spec, options, policy in built:
        if mode == "sim":
            settings = SimSettings.from_config(config, cost)
            executor = SimExecutor(policy, settings)
            settings_dict = asdict(settings)
        else:
            from paged.core.frontend.llm_engine import LLMEngine

            engine_config = config.model_copy(deep=True)
            engine_config.scheduler.policy = run.name
            engine_config.scheduler.policy_options = dict(run.options)
            engine = LLMEngine(engine_config, registry)
            executor = EngineExecutor(engine, mode)
            executor.warm_up()
            settings_dict = engine_settings(engine)
        if log:
            log(f"replaying {len(requests)} requests with policy {run.label!r} ({mode})")
        result = run_replay(requests, executor, cost=cost, label=run.label, policy=run.name,
                            options=options.model_dump() if options is not None else {})  # fmt: skip
        result.settings = settings_dict
        results.append(result)
        if log:
            log(f"  {len(result.steps)} steps, {result.elapsed_s:.2f} s")
    return results


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
