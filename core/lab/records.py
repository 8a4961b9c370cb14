"""What a replay submits (``LabRequest``, from trace lines), what it records (one
``StepRecord`` per step, one ``RequestRecord`` per request, the ``ReplayResult``), and the
policy of a replay (``PolicyRun``: a name and its options)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from paged.core.errors import ConfigError
from paged.core.lab.cost import BatchShape
from paged.core.lab.trace import Trace, prompt_token_ids
from paged.core.sampling_params import SamplingParams


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
    tenant: str | None = None
    deadline_s: float | None = None  # relative to arrival, already scaled

    @property
    def deadline(self) -> float | None:
        return None if self.deadline_s is None else self.arrival + self.deadline_s

    def sampling_params(self) -> SamplingParams:
        """The trace's sampling fields, generating exactly ``output_len`` tokens."""
        drop = {"n", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output"}
        kept = {k: v for k, v in self.sampling.items() if k not in drop}
        kept.setdefault("temperature", 0.0)
        return SamplingParams.from_dict({**kept, "max_tokens": self.output_len, "ignore_eos": True})


def materialize(trace: Trace, *, seed: int | None = None, time_scale: float = 1.0,
                tokenize: Callable[[str], list[int]] | None = None, max_requests: int | None = None) -> list[LabRequest]:
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
            deadline = None if request.deadline_s is None else request.deadline_s * time_scale
            out.append(LabRequest(rid, request.arrival_s * time_scale, tokens, request.num_output_tokens,
                                  request.priority, request.cache_salt, request.sampling, request.tenant, deadline))
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
                          self.prefill_attention, self.prefill_seqs)

    def schedule_key(self) -> tuple:
        """Everything but the times: equal keys = the same scheduling decisions."""
        return (self.index, self.num_seqs, self.prefill_tokens, self.decode_tokens, self.context_tokens,
                self.prefill_seqs, self.running, self.waiting, round(self.kv_usage, 9), self.preemptions, self.finished)


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
    tenant: str | None = None
    deadline_s: float | None = None
    rejected: str | None = None  # the policy's reason, when admission control turned it away
    # Tokens computed for it (prefill and decode, recomputation included) in steps that ended
    # by the last arrival: the service while every tenant could still ask for more.
    service_tokens: int = 0

    @property
    def met_deadline(self) -> bool | None:
        if self.deadline_s is None:
            return None
        return self.finished is not None and self.finished - self.arrival <= self.deadline_s

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
    # the speculator's counters (SpecDecodeStats.to_dict plus "method"); None: no speculation
    spec_decode: dict[str, Any] | None = None

    @property
    def num_preemptions(self) -> int:
        return sum(s.preemptions for s in self.steps)

    def to_dict(self, include_steps: bool = True) -> dict[str, Any]:
        out = {
            "label": self.label, "policy": self.policy, "options": self.options, "mode": self.mode,
            "schedule_digest": self.schedule_digest, "engine_prefix_hit_rate": self.engine_prefix_hit_rate,
            "elapsed_s": self.elapsed_s, "settings": self.settings, "num_steps": len(self.steps),
            "spec_decode": self.spec_decode,
            "requests": [{**asdict(r), "ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e} for r in self.requests],
        }
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
        from paged.core.config import validate_options
        from paged.core.registry import get_registry

        spec = (registry or get_registry()).policy(self.name)
        options = validate_options(spec, self.options, f"policy {self.label!r} options")
        return spec, options, spec.factory(options)
