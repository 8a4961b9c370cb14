"""The research policies compared in the lab, simulated: one workload per policy's point.

For each workload of ``paged lab gen --workload`` the trace is replayed by the real Scheduler,
KVCacheManager and policy (``paged lab replay --simulate``), the step times coming from a cost
model: ``--cost COST.json`` (from ``paged lab calibrate`` on the default model) or, without it,
the synthetic linear model below (10 ms per step + 0.1 ms per prefill token + 0.5 ms per decode
token). Printed: the README's comparison table (markdown) and, with ``--json``, every summary.

    python benchmarks/policy_comparison.py [--quick] [--cost COST.json] [--json]

With ``--real`` the same workloads (scaled by ``--scale``, arrivals stretched by ``--time-scale``
because a CPU step is slower than the synthetic one) are replayed on the real engine with the
default model (wall clock, one engine per policy, warmed up first). The same by hand::

    paged lab gen --workload multi-tenant --num-requests 400 --rate 40 --out mt.jsonl
    paged lab replay mt.jsonl --policy fcfs --policy fair --clock wall

    python benchmarks/policy_comparison.py --real --scale 0.25 --time-scale 4
"""

from __future__ import annotations

import argparse
import json
import sys

from paged.core.lab.cost import FEATURES, CostModel
from paged.core.lab.driver import run_replay
from paged.core.lab.executors import SimExecutor, SimSettings
from paged.core.lab.metrics import summarize
from paged.core.lab.records import PolicyRun, materialize
from paged.core.lab.workloads import WorkloadSpec, generate_workload

SYNTHETIC = dict(const=0.010, prefill_tokens=1e-4, decode_tokens=5e-4)

# (workload, its spec, simulated engine settings, the policies compared, the figures that matter)
SCENARIOS = [
    ("multi-tenant", dict(num_requests=400, rate=24.0), dict(num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=512),
     ["fcfs", "fair", "fair:preemptive=true"]),
    ("shared-prefix", dict(num_requests=400, rate=30.0, num_prefixes=8, prefix_len=512),
     dict(num_blocks=160, max_num_seqs=8, max_num_batched_tokens=1024), ["fcfs", "cache-aware"]),
    ("heavy-tail", dict(num_requests=400, rate=16.0), dict(num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=1024),
     ["fcfs", "srpt", "srpt:preemptive=true"]),
    ("deadline", dict(num_requests=400, rate=20.0), dict(num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=1024),
     ["fcfs", "priority", "slo"]),
]


def synthetic_cost() -> CostModel:
    return CostModel([SYNTHETIC.get(f, 0.0) for f in FEATURES], FEATURES, "sim")


def simulate(trace, policy: str, settings: SimSettings, cost: CostModel, label: str | None = None):
    """One simulated replay of ``trace`` under ``policy`` (NAME or NAME:K=V,...)."""
    run = PolicyRun.parse(policy)
    _, options, instance = run.build()
    result = run_replay(materialize(trace), SimExecutor(instance, settings), cost=cost, label=label or run.label,
                        policy=run.name, options=options.model_dump() if options is not None else {})
    return summarize(result), result


def alone(trace, keep) -> object:
    """The trace with only the requests ``keep`` accepts (e.g. the light tenants, alone)."""
    from paged.core.lab.trace import Trace

    return Trace([r for r in trace.requests if keep(r)], dict(trace.header))


def real(trace, policies: list[str], settings: dict, time_scale: float, labels: list[str] | None = None) -> list[dict]:
    """Replays of ``trace`` on the real engine (default model, wall clock), one engine per policy."""
    from paged.core.config import load_config
    from paged.core.lab.replay import replay_trace

    config = load_config(None, {"device": "cpu", "cache": {"num_blocks": settings["num_blocks"]},
                                "scheduler": {"max_num_seqs": settings["max_num_seqs"],
                                              "max_num_batched_tokens": settings["max_num_batched_tokens"]}})
    results = replay_trace(trace, [PolicyRun.parse(p) for p in policies], config, mode="wall", time_scale=time_scale,
                           log=lambda m: print(m, file=sys.stderr, flush=True))
    summaries = [summarize(r) for r in results]
    for s, label in zip(summaries, labels or []):
        s["label"] = label
    return summaries


def run_scenarios(scale: float, cost: CostModel, real_time_scale: float | None = None) -> list[dict]:
    rows = []
    for workload, spec, settings, policies in SCENARIOS:
        spec = dict(spec, num_requests=max(20, int(spec["num_requests"] * scale)))
        trace = generate_workload(WorkloadSpec(workload, **spec))
        if real_time_scale is not None:
            summaries = real(trace, policies, settings, real_time_scale)
            if workload == "multi-tenant":
                light = alone(trace, lambda r: r.tenant != "t0")
                summaries += real(light, ["fcfs"], settings, real_time_scale, labels=["light tenants alone"])
        else:
            sim = SimSettings(max_model_len=8192, **settings)
            summaries = [simulate(trace, p, sim, cost)[0] for p in policies]
            if workload == "multi-tenant":
                light = alone(trace, lambda r: r.tenant != "t0")
                summaries.append(simulate(light, "fcfs", sim, cost, label="light tenants alone")[0])
        rows.append({"workload": workload, "spec": spec, "settings": settings, "summaries": summaries})
    return rows


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def markdown(rows: list[dict]) -> str:
    lines = ["| workload | policy | TTFT p50 / p99 | e2e mean / p99 | light tenants' TTFT p99 | Jain | prefix hits | "
             "tok/s | deadline met | goodput req/s | rejected |", "|" + "---|" * 11]
    for row in rows:
        for s in row["summaries"]:
            a = s["all"]
            light = [v["ttft"]["p99"] for t, v in s.get("tenants", {}).items() if t != "t0" and v["ttft"]["p99"] is not None]
            lines.append(
                f"| {row['workload']} | {s['label']} | {_ms(a['ttft']['p50'])} / {_ms(a['ttft']['p99'])} | "
                f"{_ms(a['e2e']['mean'])} / {_ms(a['e2e']['p99'])} | {_ms(max(light)) if light else '-'} | "
                f"{'-' if s.get('jain_service') is None else format(s['jain_service'], '.3f')} | "
                f"{100 * a['prefix_cache_hit_rate']:.1f}% | {a['total_throughput']:.0f} | "
                f"{'-' if a['deadline_met'] is None else format(100 * a['deadline_met'], '.1f') + '%'} | "
                f"{a['goodput']:.2f} | {a['rejected']} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument("--cost", help="cost model JSON from `paged lab calibrate` (default: the synthetic one)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--real", action="store_true", help="replay on the real engine (default model, wall clock)")
    parser.add_argument("--scale", type=float, default=None, help="share of each workload's requests (default 1; --quick 0.25)")
    parser.add_argument("--time-scale", type=float, default=4.0, help="--real: arrival times (and deadlines) x this")
    args = parser.parse_args(argv)
    cost = CostModel.load(args.cost) if args.cost else synthetic_cost()
    scale = args.scale if args.scale is not None else 0.25 if args.quick else 1.0
    rows = run_scenarios(scale, cost, args.time_scale if args.real else None)
    print(json.dumps(rows, indent=1, default=str) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
