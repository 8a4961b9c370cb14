"""The policy lab: record, replay and compare scheduling policies on workload traces.

- ``trace``: the JSONL trace format, reading/writing, the seeded synthetic generator, recording.
- ``replay``: the driver loop; real-engine replays (wall, CPU or step clock) and simulated ones
  (the real Scheduler + KVCacheManager + policy, time from a cost model).
- ``cost``: the step cost model (batch shape -> seconds), its least-squares fit, its JSON file.
- ``calibrate``: timing real steps to fit the cost model; sim-vs-real validation.
- ``metrics``: TTFT / TPOT / e2e, throughput, SLO attainment, per priority class; the table.
- ``report``: timeline and TTFT-CDF pictures, the HTML page.
- ``cli``: ``paged lab gen | replay | calibrate | validate | policies``.
"""

from paged.core.lab.cost import BatchShape, CostModel, fit_cost_model
from paged.core.lab.replay import LabRequest, PolicyRun, ReplayResult, SimSettings, materialize, replay_trace, run_replay
from paged.core.lab.trace import GeneratorSpec, Trace, TraceRequest, generate_trace, read_trace, write_trace

__all__ = [
    "BatchShape", "CostModel", "GeneratorSpec", "LabRequest", "PolicyRun", "ReplayResult", "SimSettings", "Trace",
    "TraceRequest", "fit_cost_model", "generate_trace", "materialize", "read_trace", "replay_trace", "run_replay",
    "write_trace",
]  # fmt: skip
