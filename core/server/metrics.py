"""Prometheus metrics: the front-end's histograms and token counters (``StatsObserver``) plus the
core's gauges and counters, refreshed from a ``stats`` utility call at each scrape of /metrics.
With several data-parallel cores, per-core gauges labelled ``dp_rank`` are added."""

from __future__ import annotations

from typing import Any

from paged.core.frontend.async_llm import StatsObserver

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class Metrics(StatsObserver):
    """Front-end measurements (histograms, token counters) plus the core's gauges and counters,
    refreshed from a ``stats`` utility call at each scrape. One registry per app."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.core_stats: dict[str, Any] | None = None
        self.per_core_stats: list[dict[str, Any]] | None = None  # only with several cores
        self.core_alive = False
        self.cores_serving = 0  # engine cores serving (the lost ones left out)
        self._prompt = Counter("paged:prompt_tokens", "Prompt tokens processed (per sample)", registry=r)
        self._generation = Counter("paged:generation_tokens", "Tokens generated", registry=r)
        self._success = Counter("paged:request_success", "Finished requests (samples) by finish reason",
                                ["finished_reason"], registry=r)
        self._ttft = Histogram("paged:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                               registry=r)
        self._itl = Histogram("paged:inter_token_latency_seconds", "Time between generated tokens",
                              buckets=_ITL_BUCKETS, registry=r)
        self._e2e = Histogram("paged:e2e_request_latency_seconds", "Arrival to finish", buckets=_E2E_BUCKETS,
                              registry=r)
        self._queue = Histogram("paged:request_queue_time_seconds", "Arrival to first scheduled",
                                buckets=_E2E_BUCKETS, registry=r)
        r.register(_CoreCollector(self))

    def prompt_tokens(self, n: int) -> None:
        self._prompt.inc(n)

    def generation_tokens(self, n: int) -> None:
        self._generation.inc(n)

    def time_to_first_token(self, s: float) -> None:
        self._ttft.observe(s)

    def inter_token_latency(self, s: float) -> None:
        self._itl.observe(s)

    def e2e_latency(self, s: float) -> None:
        self._e2e.observe(s)

    def queue_time(self, s: float) -> None:
        self._queue.observe(s)

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(finish_reason).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# (name, kind, help, key in the core's stats)
_CORE_METRICS = [
    ("paged:num_requests_running", "gauge", "Requests (samples) in the running batch", "num_running"),
    ("paged:num_requests_waiting", "gauge", "Requests (samples) waiting to be scheduled", "num_waiting"),
    ("paged:kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0..1)", "kv_usage"),
    ("paged:num_kv_blocks", "gauge", "KV cache blocks in total", "num_blocks"),
    ("paged:num_free_kv_blocks", "gauge", "KV cache blocks free (cached-but-unused blocks count as free)",
     "num_free_blocks"),
    ("paged:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    ("paged:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache", "prefix_cache_hits"),
    ("paged:num_preemptions", "counter", "Preemptions of running requests", "num_preemptions"),
    ("paged:engine_steps", "counter", "Engine steps run", "num_steps"),
    # speculative decoding (vLLM's spec_decode names)
    ("paged:spec_decode_num_drafts", "counter", "Requests' steps verified with draft tokens", "spec_decode_num_drafts"),
    ("paged:spec_decode_num_draft_tokens", "counter", "Draft tokens verified", "spec_decode_num_draft_tokens"),
    ("paged:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted", "spec_decode_num_accepted_tokens"),
]


# With several data-parallel cores, also per core (label dp_rank); the families above are the sums.
_PER_CORE_METRICS = [
    ("paged:core_num_requests_running", "gauge", "Requests (samples) running in this core", "num_running"),
    ("paged:core_num_requests_waiting", "gauge", "Requests (samples) waiting in this core", "num_waiting"),
    ("paged:core_kv_cache_usage_perc", "gauge", "Fraction of this core's KV blocks in use (0..1)", "kv_usage"),
    ("paged:core_requests_added", "counter", "Requests (samples) sent to this core", "num_requests_added"),
]


class _CoreCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def _families(self, stats: dict[str, Any] | None, per_core: list[dict[str, Any]] | None):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("paged:engine_core_alive", "1 while the engine core process runs",
                                value=1.0 if self.metrics.core_alive else 0.0)
        for name, kind, help_text, key in _CORE_METRICS:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name, help_text)
            if stats is not None and key in stats:
                family.add_metric([], float(stats[key]))
            yield family
        yield GaugeMetricFamily("paged:engine_cores_serving", "Data-parallel engine cores serving (fewer than "
                                "data_parallel_size once a core is lost, with data_parallel_on_core_loss: continue)",
                                value=float(self.metrics.cores_serving))
        if per_core is None:
            return
        for name, kind, help_text, key in _PER_CORE_METRICS:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name, help_text, labels=["dp_rank", "host"])
            for core_stats in per_core:
                if key in core_stats:
                    family.add_metric([str(core_stats["dp_rank"]), core_stats.get("host", "")], float(core_stats[key]))
            yield family

    def describe(self):
        return list(self._families(None, None))

    def collect(self):
        return list(self._families(self.metrics.core_stats, self.metrics.per_core_stats))

