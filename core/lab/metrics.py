"""Latency and throughput figures of a replay, overall and per priority class, and the
side-by-side text table of several replays.

- TTFT, TPOT, e2e: mean, p50, p99 (seconds; linear-interpolated percentiles).
- throughput: requests, output tokens and all tokens per second over the replay's span (first
  arrival to last finish).
- SLOs: a request attains them when TTFT <= ``slo_ttft`` and TPOT <= ``slo_tpot`` (each only if
  given; a one-token request has no TPOT and passes that part). ``slo_attainment`` is the share of
  requests that attain them, ``goodput`` those requests per second of span.
- preemptions: of the requests (a class's are its requests'); prefix-cache hit rate: prompt tokens
  found in the cache at first admission / prompt tokens.
- deadlines: a request with a trace ``deadline_s`` attains its SLO only if it also finishes within
  it; ``deadline_met`` is the share of requests with a deadline that finish in time. ``rejected``:
  requests the policy's admission control turned away (they attain nothing).
- tenants: the figures per tenant, and Jain's fairness index over tenants' service,
  ``(sum x)^2 / (n sum x^2)`` with ``x`` = tokens served to a tenant up to the last arrival (while
  every tenant could still ask for more) / its max-min fair share of those tokens given what it
  asked for (water-filling). 1 = every tenant got its fair share; 1/n = one tenant got everything.
- speculative decoding (a replay on the engine with ``--speculative-config``): the share of draft
  tokens accepted and the tokens a verified request advanced per step, over the whole replay.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from paged.core.lab.records import ReplayResult, RequestRecord


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    import numpy as np

    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def meets_slo(r: RequestRecord, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    if r.finished is None or r.met_deadline is False:
        return False
    if slo_ttft is not None and (r.ttft is None or r.ttft > slo_ttft):
        return False
    if slo_tpot is not None and r.tpot is not None and r.tpot > slo_tpot:
        return False
    return True


def summarize_requests(records: Iterable[RequestRecord], span: float, slo_ttft: float | None = None,
                       slo_tpot: float | None = None) -> dict[str, Any]:
    records = list(records)
    done = [r for r in records if r.finished is not None]
    output_tokens = sum(r.num_generated for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    met = sum(1 for r in done if meets_slo(r, slo_ttft, slo_tpot))
    with_deadline = [r for r in records if r.deadline_s is not None]
    span = span if span > 0 else math.nan
    return {
        "requests": len(records),
        "finished": len(done),
        "ttft": _stats([r.ttft for r in done if r.ttft is not None]),
        "tpot": _stats([r.tpot for r in done if r.tpot is not None]),
        "e2e": _stats([r.e2e for r in done if r.e2e is not None]),
        "queue": _stats([r.queue for r in done if r.queue is not None]),
        "request_throughput": len(done) / span,
        "output_throughput": output_tokens / span,
        "total_throughput": (output_tokens + prompt_tokens) / span,
        "slo_attainment": met / len(records) if records else None,
        "goodput": met / span,
        "deadline_met": sum(1 for r in with_deadline if r.met_deadline) / len(with_deadline) if with_deadline else None,
        "rejected": sum(1 for r in records if r.rejected is not None),
        "preemptions": sum(r.num_preemptions for r in records),
        "prefix_cache_hit_rate": sum(r.num_cached_tokens for r in done) / prompt_tokens if prompt_tokens else 0.0,
    }


def span_of(result: ReplayResult) -> float:
    arrivals = [r.arrival for r in result.requests]
    ends = [r.finished for r in result.requests if r.finished is not None]
    if not arrivals or not ends:
        return 0.0
    return max(ends) - min(arrivals)


def max_min_fair_shares(demands: dict[str, float], capacity: float) -> dict[str, float]:
    """Water-filling: each tenant gets min(its demand, an equal share of what the smaller
    demands leave)."""
    shares: dict[str, float] = {}
    left, pending = capacity, sorted(demands, key=demands.get)
    while pending:
        equal = left / len(pending)
        tenant = pending[0]
        if demands[tenant] <= equal:
            shares[tenant] = demands[tenant]
            left -= demands[tenant]
            pending.pop(0)
        else:
            for tenant in pending:
                shares[tenant] = equal
            break
    return shares


def jain_index(values: Sequence[float]) -> float | None:
    values = list(values)
    square_sum = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square_sum) if values and square_sum > 0 else None


def tenant_fairness(records: Sequence[RequestRecord]) -> float | None:
    """Jain's index over tenants' service / max-min fair share (see the module docstring)."""
    demand: dict[str, float] = {}
    served: dict[str, float] = {}
    for r in records:
        tenant = r.tenant or ""
        demand[tenant] = demand.get(tenant, 0.0) + r.prompt_len + r.output_len
        served[tenant] = served.get(tenant, 0.0) + r.service_tokens
    if len(demand) < 2:
        return None
    shares = max_min_fair_shares(demand, sum(served.values()))
    return jain_index([served[t] / shares[t] for t in demand if shares[t] > 0])


def summarize(result: ReplayResult, slo_ttft: float | None = None, slo_tpot: float | None = None) -> dict[str, Any]:
    """``{"all": {...}, "classes": {priority: {...}}, "tenants": {tenant: {...}}, ...}`` for one
    replay (tenants only when the trace names more than one)."""
    span = span_of(result)
    classes = sorted({r.priority for r in result.requests})
    tenants = sorted({r.tenant or "" for r in result.requests})
    return {
        "label": result.label,
        "mode": result.mode,
        "span_s": span,
        "steps": len(result.steps),
        "preemptions": result.num_preemptions,
        "engine_prefix_hit_rate": result.engine_prefix_hit_rate,
        "peak_kv_usage": max((s.kv_usage for s in result.steps), default=0.0),
        "spec_decode": result.spec_decode,
        "all": summarize_requests(result.requests, span, slo_ttft, slo_tpot),
        "classes": {
            str(c): summarize_requests([r for r in result.requests if r.priority == c], span, slo_ttft, slo_tpot)
            for c in classes
        },
        "tenants": {
            t: summarize_requests([r for r in result.requests if (r.tenant or "") == t], span, slo_ttft, slo_tpot)
            for t in (tenants if len(tenants) > 1 else [])
        },
        "jain_service": tenant_fairness(result.requests),
    }


# --- the side-by-side table ---------------------------------------------------------------------------
ROWS: list[tuple[str, str, str]] = [
    # (label, path in a summary block, format)
    ("requests", "requests", "int"),
    ("TTFT mean", "ttft.mean", "s"),
    ("TTFT p50", "ttft.p50", "s"),
    ("TTFT p99", "ttft.p99", "s"),
    ("TPOT mean", "tpot.mean", "s"),
    ("TPOT p50", "tpot.p50", "s"),
    ("TPOT p99", "tpot.p99", "s"),
    ("e2e mean", "e2e.mean", "s"),
    ("e2e p50", "e2e.p50", "s"),
    ("e2e p99", "e2e.p99", "s"),
    ("queue mean", "queue.mean", "s"),
    ("req/s", "request_throughput", "f"),
    ("output tok/s", "output_throughput", "f"),
    ("total tok/s", "total_throughput", "f"),
    ("SLO attainment", "slo_attainment", "%"),
    ("deadline met", "deadline_met", "%"),
    ("rejected", "rejected", "int"),
    ("goodput req/s", "goodput", "f"),
    ("preemptions", "preemptions", "int"),
    ("prefix hit rate", "prefix_cache_hit_rate", "%"),
]


TENANT_ROWS = [row for row in ROWS if row[0] in ("requests", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99", "rejected")]


def _get(block: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if block is None:
            return None
        block = block.get(part)
    return block


def fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "int":
        return str(int(value))
    if kind == "%":
        return f"{100 * value:.1f}%"
    if kind == "s":
        return f"{value * 1e3:.1f} ms" if abs(value) < 1 else f"{value:.3f} s"
    return f"{value:.2f}"


def table_rows(summaries: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): one column per replay, a section per scope (all, then each class, then
    each tenant with fewer rows)."""
    header = ["metric"] + [s["label"] for s in summaries]
    scopes = ["all"] + sorted({c for s in summaries for c in s["classes"]}, key=int)
    multi_class = len(scopes) > 2
    rows: list[list[str]] = []
    for scope in scopes:
        if scope != "all" and not multi_class:
            continue
        title = "all requests" if scope == "all" else f"priority class {scope}"
        rows.append([f"[{title}]"] + [""] * len(summaries))
        for label, path, kind in ROWS:
            values = [_get(s["all"] if scope == "all" else s["classes"].get(scope), path) for s in summaries]
            rows.append([label] + [fmt(v, kind) for v in values])
    for tenant in sorted({t for s in summaries for t in s.get("tenants", {})}):
        rows.append([f"[tenant {tenant or '(none)'}]"] + [""] * len(summaries))
        for label, path, kind in TENANT_ROWS:
            values = [_get(s["tenants"].get(tenant), path) for s in summaries]
            rows.append([label] + [fmt(v, kind) for v in values])
    if any(s.get("jain_service") is not None for s in summaries):
        rows.append(["Jain's index (service)"] + [fmt(s.get("jain_service"), "f") for s in summaries])
    rows.append(["[engine]"] + [""] * len(summaries))
    rows.append(["steps"] + [str(s["steps"]) for s in summaries])
    rows.append(["span"] + [fmt(s["span_s"], "s") for s in summaries])
    rows.append(["peak KV usage"] + [fmt(s["peak_kv_usage"], "%") for s in summaries])
    specs = [s.get("spec_decode") for s in summaries]
    if any(specs):
        rows.append(["drafts accepted"] + [fmt(x and x["acceptance_rate"], "%") for x in specs])
        rows.append(["tokens per verified step"] + [fmt(x and x["mean_accepted_length"], "f") for x in specs])
    return header, rows


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    header, rows = table_rows(summaries)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)
