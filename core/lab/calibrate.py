"""Calibration: time real engine steps of varied batch shapes, fit the cost model; validation:
replay a small trace on the engine and simulated, and compare the latencies.

The calibration workload (``calibration_trace``) is replayed on the real engine with the ``steps``
clock (its schedule does not depend on timing), in groups that arrive far apart so that each
drains before the next:

- decode groups: 1, 2, 4, ... ``max_num_seqs`` requests at once, short and long contexts: steps
  of many decodes;
- prefill groups: prompts of 32 tokens up to ``max_model_len / 2`` (chunked when longer than the
  token budget): steps of one big prefill;
- a mixed stream: requests arriving every other step: prefill chunks next to decodes.

Every step is timed (wall and CPU) and its batch shape recorded; the fit uses the clock asked for.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Callable

from paged.core.lab.cost import CostModel, fit_cost_model
from paged.core.lab.driver import run_replay
from paged.core.lab.executors import EngineExecutor, SimExecutor, SimSettings, engine_settings
from paged.core.lab.records import PolicyRun, ReplayResult, materialize
from paged.core.lab.trace import GeneratorSpec, Trace, TraceRequest, generate_trace

logger = logging.getLogger("paged")
GAP = 1e4  # seconds between calibration groups (the steps clock jumps idle gaps)


def calibration_trace(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, num_blocks: int,
                      block_size: int, seed: int = 0, scale: float = 1.0) -> Trace:
    """Requests covering decode batch sizes, prefill lengths and mixed steps (see the module doc).
    ``scale`` multiplies the decode steps of each group and the requests of the others; every
    batch size and length is covered whatever the scale."""
    rng = random.Random(seed)
    capacity = num_blocks * block_size  # tokens the KV cache holds
    requests: list[TraceRequest] = []
    t = 0.0

    def add(prompt_len: int, output_len: int, at: float) -> None:
        prompt_len = max(1, min(prompt_len, max_model_len - output_len - 1))
        requests.append(TraceRequest(arrival_s=at, id=f"c{len(requests)}", prompt_len=prompt_len, max_tokens=output_len))

    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    decode_steps = max(4, round(16 * scale))
    contexts = [c for c in (16, 64, 256, 1024, 4096) if c <= max_model_len // 2] or [max(1, max_model_len // 4)]
    for context in contexts:
        for b in sizes:
            for _ in range(max(1, min(b, capacity // (context + decode_steps + 2 * block_size)))):
                add(context + rng.randrange(8), decode_steps, t)
            t += GAP
    length = 32
    while length <= max_model_len // 2:
        for _ in range(max(1, round(2 * scale))):
            add(length, 4, t)
        t += GAP
        length *= 2
    for k in range(max(4, round(3 * max_num_seqs * scale))):
        add(int(rng.lognormvariate(4.5, 0.8)), rng.randrange(4, 32), t + 2.0 * k)
    t += GAP
    return Trace(requests, {"source": "paged lab calibrate", "seed": seed})


def calibrate(config, *, clock: str = "wall", seed: int = 0, scale: float = 1.0, registry=None,
              log: Callable[[str], None] | None = None) -> tuple[CostModel, ReplayResult]:
    """Build the engine from ``config``, replay the calibration workload, fit. Returns the model
    and the timed replay."""
    from paged.core.frontend.llm_engine import LLMEngine

    if clock not in ("wall", "cpu"):
        from paged.core.errors import ConfigError

        raise ConfigError(f"--clock: invalid value {clock!r}; calibration times wall or cpu")
    engine = LLMEngine(config, registry)
    executor = EngineExecutor(engine, "steps")
    executor.warm_up()
    info = engine.model_info
    sched = config.scheduler
    trace = calibration_trace(sched.max_num_seqs, sched.max_num_batched_tokens, info.max_model_len, info.num_blocks,
                              info.block_size, seed=seed, scale=scale)
    requests = materialize(trace)
    if log:
        log(f"calibration: {len(requests)} requests on {info.model_dir}")
    result = run_replay(requests, executor, cost=CostModel.constant(1.0), label="calibration", policy=sched.policy)
    steps = [s for s in result.steps if s.num_seqs]
    times = [s.measured_cpu_s if clock == "cpu" else s.measured_s for s in steps]
    model = fit_cost_model([s.shape for s in steps], times, clock)
    model.engine = engine_settings(engine)
    if log:
        log(f"calibration: {len(steps)} steps timed in {result.elapsed_s:.1f} s; fit {model.fit}")
    return model, result


def validation_trace(cost: CostModel, settings: SimSettings, num_requests: int = 0, seed: int = 1,
                     load: float = 0.6) -> Trace:
    """A Poisson trace at about ``load`` of the engine's capacity under the cost model: the
    rate at which ``load x max_num_seqs`` requests run at once (Little's law)."""
    from paged.core.lab.cost import BatchShape

    prompt, output = min(96, settings.max_model_len // 4), min(24, settings.max_model_len // 8)
    concurrency = max(1.0, load * settings.max_num_seqs)
    n = max(1, round(concurrency))
    decode = cost.predict(BatchShape(n, 0, n, n * (prompt + output // 2), 0))
    prefill = cost.predict(BatchShape(1, prompt, 0, prompt, prompt * prompt, 1))
    e2e = prefill + output * decode
    rate = concurrency / max(e2e, 1e-6)
    spec = GeneratorSpec(
        num_requests=num_requests or int(min(64, max(16, 3 * settings.max_num_seqs))), rate=rate, arrival="poisson",
        prompt_len_median=prompt, prompt_len_sigma=0.5, prompt_len_min=4,
        prompt_len_max=max(4, settings.max_model_len // 2), output_len_median=output, output_len_sigma=0.4,
        output_len_min=2, output_len_max=max(2, settings.max_model_len // 4), seed=seed,
    )
    return generate_trace(spec)


def rel_error(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return (sim - real) / real


def validate(cost: CostModel, config, trace: Trace | None = None, *, policy: PolicyRun | None = None,
             clock: str | None = None, registry=None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Replay ``trace`` (default: ``validation_trace``) on the real engine with ``clock``
    (default: the one the cost model was fitted on) and simulated with ``cost``; relative errors
    (sim - real) / real of mean TTFT, TPOT, e2e and of the span."""
    from paged.core.frontend.llm_engine import LLMEngine
    from paged.core.lab.metrics import summarize

    clock = clock or (cost.clock if cost.clock in ("wall", "cpu") else "wall")
    policy = policy or PolicyRun(config.scheduler.policy, dict(config.scheduler.policy_options))
    engine_config = config.model_copy(deep=True)
    engine_config.scheduler.policy = policy.name
    engine_config.scheduler.policy_options = dict(policy.options)
    engine = LLMEngine(engine_config, registry)
    settings = SimSettings.from_config(engine_config, CostModel(cost.coef, engine=engine_settings(engine)))
    trace = trace or validation_trace(cost, settings)
    requests = materialize(trace)
    executor = EngineExecutor(engine, clock)
    executor.warm_up()
    real = run_replay(requests, executor, label=f"real ({clock})", policy=policy.name)
    _, options, sim_policy = policy.build(registry)
    sim = run_replay(requests, SimExecutor(sim_policy, settings), cost=cost, label="simulated", policy=policy.name)
    real_s, sim_s = summarize(real), summarize(sim)
    errors = {
        f"{metric}_mean": rel_error(sim_s["all"][metric]["mean"], real_s["all"][metric]["mean"])
        for metric in ("ttft", "tpot", "e2e")
    }
    errors["span"] = rel_error(sim_s["span_s"], real_s["span_s"])
    # The cost model alone, on the real run's own batches (no schedule drift): predicted / measured total.
    measured = [s.measured_cpu_s if clock == "cpu" else s.measured_s for s in real.steps if s.num_seqs]
    predicted = sum(cost.predict(s.shape) for s in real.steps if s.num_seqs)
    errors["step_time_total"] = rel_error(predicted, sum(measured))
    out = {
        "clock": clock,
        "num_requests": len(requests),
        "rel_errors": {k: None if v is None else round(v, 4) for k, v in errors.items()},
        "real": {m: real_s["all"][m]["mean"] for m in ("ttft", "tpot", "e2e")} | {"span_s": real_s["span_s"], "steps": len(real.steps)},
        "sim": {m: sim_s["all"][m]["mean"] for m in ("ttft", "tpot", "e2e")} | {"span_s": sim_s["span_s"], "steps": len(sim.steps)},
        "same_schedule": real.schedule_digest == sim.schedule_digest,
    }
    if log:
        log("validation (sim vs real, relative error of the mean): " + ", ".join(
            f"{k} {'-' if v is None else f'{100 * v:+.1f}%'}" for k, v in out["rel_errors"].items()))
    return out
