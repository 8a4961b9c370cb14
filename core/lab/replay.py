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

import logging
from dataclasses import asdict
from typing import Callable, Sequence

from paged.core.errors import ConfigError
from paged.core.lab.cost import CostModel
from paged.core.lab.driver import run_replay
from paged.core.lab.executors import EngineExecutor, SimExecutor, SimSettings, engine_settings
from paged.core.lab.records import LabRequest, PolicyRun, ReplayResult, RequestRecord, StepRecord, materialize
from paged.core.lab.trace import Trace

logger = logging.getLogger("paged")

MODES = ("wall", "cpu", "steps", "sim")

__all__ = [
    "MODES", "EngineExecutor", "LabRequest", "PolicyRun", "ReplayResult", "RequestRecord", "SimExecutor", "SimSettings",
    "StepRecord", "engine_settings", "materialize", "replay_trace", "run_replay",
]


# --- one comparison: a trace, several policies -----------------------------------------------------------------
def _tokenizer_for(config, cost: CostModel | None):
    from paged.core.loading.loader import load_tokenizer, resolve_model_dir

    source = config.model.tokenizer or config.model.model or ((cost.engine if cost else {}) or {}).get("model_dir")
    tokenizer = load_tokenizer(resolve_model_dir(source) if not config.model.tokenizer else source)
    return lambda text: tokenizer(text, add_special_tokens=True)["input_ids"]


def replay_trace(trace: Trace, policies: Sequence[PolicyRun], config, *, mode: str = "wall",
                 cost: CostModel | None = None, step_time: float = 0.01, time_scale: float = 1.0,
                 seed: int | None = None, max_requests: int | None = None, registry=None,
                 log: Callable[[str], None] | None = None) -> list[ReplayResult]:
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
                            options=options.model_dump() if options is not None else {})
        result.settings = settings_dict
        results.append(result)
        if log:
            log(f"  {len(result.steps)} steps, {result.elapsed_s:.2f} s")
    return results
