"""The policy lab: record, replay and compare scheduling policies on workload traces.

- ``trace``: the JSONL trace format, reading/writing, the seeded synthetic generator, recording.
- ``records``: what a replay submits and records; ``PolicyRun`` (a policy and its options).
- ``executors``: who runs a step: the real engine, or the real Scheduler + KVCacheManager +
  policy with time from a cost model (simulated).
- ``driver``: the replay loop (arrivals, steps, the clock).
- ``replay``: one comparison: a trace replayed once per policy (the clocks are described there).
- ``cost``: the step cost model (batch shape -> seconds), its least-squares fit, its JSON file.
- ``calibrate``: timing real steps to fit the cost model; sim-vs-real validation.
- ``metrics``: TTFT / TPOT / e2e, throughput, SLO attainment and goodput, per priority class and
  per tenant, Jain's fairness index; the table.
- ``report``: timeline and TTFT-CDF pictures, the HTML page.
- ``checks``: warnings on how far a cost model can be trusted (poor fit, settings outside it).
- ``workloads``: named seeded workloads that show what each research policy is for.

Its command line, ``paged lab gen | replay | calibrate | validate | policies``, is
paged.core.cli.lab.
"""

from paged.core.lab.cost import BatchShape, CostModel, fit_cost_model
from paged.core.lab.driver import run_replay
from paged.core.lab.executors import SimSettings
from paged.core.lab.records import LabRequest, PolicyRun, ReplayResult, materialize
from paged.core.lab.replay import replay_trace
from paged.core.lab.trace import GeneratorSpec, Trace, TraceRequest, generate_trace, read_trace, write_trace

__all__ = [
    "BatchShape", "CostModel", "GeneratorSpec", "LabRequest", "PolicyRun", "ReplayResult", "SimSettings", "Trace",
    "TraceRequest", "fit_cost_model", "generate_trace", "materialize", "read_trace", "replay_trace", "run_replay",
    "write_trace",
]
