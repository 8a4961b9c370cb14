"""Workload traces: the JSONL format, reading and writing, the synthetic generator, and turning
a trace line into the token ids a replay submits.

Format (one JSON object per line, UTF-8)::

    {"paged_trace": 1, "source": "paged lab gen", "seed": 0, "params": {...}}      # optional header
    {"id": "r0", "arrival_s": 0.0, "prompt_len": 180, "max_tokens": 64, "priority": 0}
    {"id": "r1", "arrival_s": 0.12, "prompt_len": 300, "prefix": {"id": 2, "len": 256}, "max_tokens": 20}
    {"arrival_s": 0.5, "prompt": "Hello there", "sampling": {"temperature": 0.7}, "output_len": 12}
    {"arrival_s": 0.7, "prompt_token_ids": [1, 504, 29], "max_tokens": 8, "cache_salt": "tenant-a"}

Request fields (only ``arrival_s`` and one prompt field are required):

- ``arrival_s``: seconds from the trace start (>= 0; lines need not be sorted).
- the prompt, one of (first present wins): ``prompt_token_ids`` (list of ints), ``prompt`` (text,
  tokenized with the model's tokenizer, special tokens added), ``prompt_len`` (a length only: the
  replay draws seeded random token ids).
- ``prefix``: ``{"id": K, "len": L}`` with ``prompt_len``: the first L tokens are the token ids of
  shared prefix K (the same for every request naming K), the rest are the request's own.
- the output length, first present wins: ``output_len`` (what a recording measured),
  ``max_tokens``, ``sampling.max_tokens``; default 16. A replay generates exactly that many tokens
  (``ignore_eos``, no stop conditions): the lab replays lengths, not content.
- ``sampling``: other SamplingParams fields (temperature, top_p, seed, ...), used by real replays;
  ``n > 1`` is replayed as n requests with the same prompt.
- ``priority`` (int, lower runs first, default 0), ``cache_salt`` (str), ``id`` (str; default
  ``r<line index>``), ``tenant`` (str: who sent it, for fairness policies and per-tenant figures),
  ``deadline_s`` (seconds after arrival by which it should finish, > 0; scaled with the arrival
  times). Unknown fields are errors.

The header (optional, the first line only) is any object with ``"paged_trace": <version>``; its
``seed`` (default 0) seeds the token ids of length-only prompts.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from paged.core.errors import PagedError

logger = logging.getLogger("paged")

TRACE_VERSION = 1
DEFAULT_OUTPUT_LEN = 16
# Token ids drawn for length-only prompts: below any real vocabulary's size, above the usual
# special-token ids.
TOKEN_LOW, TOKEN_HIGH = 100, 32000

_REQUEST_FIELDS = {
    "id", "arrival_s", "prompt", "prompt_token_ids", "prompt_len", "prefix", "output_len", "max_tokens",
    "sampling", "priority", "cache_salt", "tenant", "deadline_s",
}


class TraceError(PagedError, ValueError):
    """A trace file or line is invalid."""


@dataclass
class TraceRequest:
    arrival_s: float
    id: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_len: int | None = None
    prefix: dict[str, int] | None = None  # {"id": K, "len": L}
    output_len: int | None = None
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    deadline_s: float | None = None

    @property
    def num_output_tokens(self) -> int:
        for value in (self.output_len, self.max_tokens, self.sampling.get("max_tokens")):
            if value is not None:
                return int(value)
        return DEFAULT_OUTPUT_LEN

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
        out["arrival_s"] = self.arrival_s
        for name in ("prompt", "prompt_token_ids", "prompt_len", "prefix", "output_len", "max_tokens"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.sampling:
            out["sampling"] = self.sampling
        out["priority"] = self.priority
        for name in ("cache_salt", "tenant", "deadline_s"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "trace") -> "TraceRequest":
        def bad(name: str, accepted: str) -> TraceError:
            return TraceError(f"{where}: {name}: invalid value {data.get(name)!r}; {accepted}")

        unknown = set(data) - _REQUEST_FIELDS
        if unknown:
            raise TraceError(f"{where}: unknown field(s) {sorted(unknown)}; accepted: {sorted(_REQUEST_FIELDS)}")
        arrival = data.get("arrival_s")
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
            raise bad("arrival_s", "must be a number of seconds >= 0")
        prompt, ids, length = data.get("prompt"), data.get("prompt_token_ids"), data.get("prompt_len")
        if prompt is None and ids is None and length is None:
            raise TraceError(f"{where}: needs one of 'prompt_token_ids', 'prompt' or 'prompt_len'")
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise bad("prompt", "must be a non-empty string")
        if ids is not None and (not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids)):
            raise bad("prompt_token_ids", "must be a non-empty list of token ids >= 0")
        if length is not None and (not _is_int(length) or length < 1):
            raise bad("prompt_len", "must be an integer >= 1")
        prefix = data.get("prefix")
        if prefix is not None:
            if (not isinstance(prefix, dict) or set(prefix) != {"id", "len"} or not _is_int(prefix["id"])
                    or not _is_int(prefix["len"]) or prefix["len"] < 1):
                raise bad("prefix", 'must be {"id": <int>, "len": <int >= 1>}')
            if length is None or prefix["len"] >= length:
                raise bad("prefix", "needs prompt_len, longer than the prefix")
        for name in ("output_len", "max_tokens"):
            value = data.get(name)
            if value is not None and (not _is_int(value) or value < 1):
                raise bad(name, "must be an integer >= 1")
        sampling = data.get("sampling") or {}
        if not isinstance(sampling, dict):
            raise bad("sampling", "must be an object of SamplingParams fields")
        priority = data.get("priority", 0)
        if not _is_int(priority):
            raise bad("priority", "must be an integer")
        salt = data.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise bad("cache_salt", "must be a string")
        tenant = data.get("tenant")
        if tenant is not None and not isinstance(tenant, str):
            raise bad("tenant", "must be a string")
        deadline = data.get("deadline_s")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not math.isfinite(deadline) or deadline <= 0):
            raise bad("deadline_s", "must be a number of seconds > 0")
        rid = data.get("id")
        return cls(
            arrival_s=float(arrival), id=None if rid is None else str(rid), prompt=prompt,
            prompt_token_ids=ids, prompt_len=length, prefix=prefix, output_len=data.get("output_len"),
            max_tokens=data.get("max_tokens"), sampling=dict(sampling), priority=priority, cache_salt=salt,
            tenant=tenant, deadline_s=None if deadline is None else float(deadline),
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Trace:
    requests: list[TraceRequest]
    header: dict[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        return int(self.header.get("seed", 0))

    def __len__(self) -> int:
        return len(self.requests)


def write_trace(path: str | Path, trace: Trace) -> None:
    with open(path, "w", encoding="utf-8") as f:
        header = {"paged_trace": TRACE_VERSION, **{k: v for k, v in trace.header.items() if k != "paged_trace"}}
        f.write(json.dumps(header, ensure_ascii=False) + "\n")
        for request in trace.requests:
            f.write(json.dumps(request.to_dict(), ensure_ascii=False) + "\n")


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace: no such file {str(path)!r}")
    header: dict[str, Any] = {}
    requests: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path.name} line {number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: invalid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object")
            if "paged_trace" in obj:
                if requests or header:
                    raise TraceError(f"{where}: the header must be the first line")
                if obj["paged_trace"] != TRACE_VERSION:
                    raise TraceError(f"{where}: unsupported trace version {obj['paged_trace']!r} (expected {TRACE_VERSION})")
                header = obj
                continue
            requests.append(TraceRequest.from_dict(obj, where))
    if not requests:
        raise TraceError(f"trace: {str(path)!r} holds no requests")
    seen: set[str] = set()
    for i, request in enumerate(requests):
        if request.id is None:
            request.id = f"r{i}"
        if request.id in seen:
            raise TraceError(f"trace: duplicate request id {request.id!r}")
        seen.add(request.id)
    return Trace(requests, header)


# --- token ids for a replay ---------------------------------------------------------------------
def random_tokens(key: str, n: int) -> list[int]:
    rng = random.Random(key)  # str seeds are hashed with SHA-512: the same in every process
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def prompt_token_ids(request: TraceRequest, seed: int, tokenize=None) -> list[int]:
    """The token ids a replay submits for ``request``. Length-only prompts get seeded random ids
    (a shared prefix: the same ids for every request that names it); text needs ``tokenize``."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if request.prompt is not None:
        if tokenize is None:
            raise TraceError(f"request {request.id!r}: a text prompt needs a tokenizer")
        return list(tokenize(request.prompt))
    assert request.prompt_len is not None
    prefix: list[int] = []
    if request.prefix is not None:
        prefix = random_tokens(f"paged-lab:{seed}:prefix:{request.prefix['id']}", request.prefix["len"])
    own = random_tokens(f"paged-lab:{seed}:request:{request.id}", request.prompt_len - len(prefix))
    return prefix + own


# --- the synthetic generator ---------------------------------------------------------------------
@dataclass
class GeneratorSpec:
    """Seeded synthetic workload. Lengths are log-normal (median, sigma), clipped to [min, max]."""

    num_requests: int = 100
    rate: float = 10.0  # mean requests per second
    arrival: str = "poisson"  # poisson | bursty | constant
    burstiness: float = 0.2  # bursty: gamma shape of the inter-arrival times (< 1: bursts)
    prompt_len_median: float = 128
    prompt_len_sigma: float = 0.8
    prompt_len_min: int = 4
    prompt_len_max: int = 1024
    output_len_median: float = 64
    output_len_sigma: float = 0.6
    output_len_min: int = 1
    output_len_max: int = 256
    shared_prefix_frac: float = 0.0  # share of requests whose prompt starts with a shared prefix
    num_prefixes: int = 4
    prefix_len: int = 128
    priority_classes: int = 1
    priority_weights: list[float] | None = None  # share of each class, class 0 first (default equal)
    seed: int = 0

    def validate(self) -> None:
        def bad(name: str, accepted: str) -> None:
            raise TraceError(f"{name}: invalid value {getattr(self, name)!r}; {accepted}")

        if self.num_requests < 1:
            bad("num_requests", "must be >= 1")
        if not self.rate > 0:
            bad("rate", "must be > 0")
        if self.arrival not in ("poisson", "bursty", "constant"):
            bad("arrival", "must be poisson, bursty or constant")
        if not self.burstiness > 0:
            bad("burstiness", "must be > 0")
        if not 0 <= self.shared_prefix_frac <= 1:
            bad("shared_prefix_frac", "must be in [0, 1]")
        if self.num_prefixes < 1:
            bad("num_prefixes", "must be >= 1")
        if self.prefix_len < 1:
            bad("prefix_len", "must be >= 1")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            bad("prompt_len_min", "must be in [1, prompt_len_max]")
        if not 1 <= self.output_len_min <= self.output_len_max:
            bad("output_len_min", "must be in [1, output_len_max]")
        if self.priority_classes < 1:
            bad("priority_classes", "must be >= 1")
        weights = self.priority_weights
        if weights is not None and (len(weights) != self.priority_classes or any(w < 0 for w in weights) or not sum(weights) > 0):
            bad("priority_weights", f"must be {self.priority_classes} shares >= 0, not all 0")


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal draw around ``median`` (``sigma`` 0: the median), rounded, within [lo, hi]."""
    value = rng.lognormvariate(math.log(median), sigma) if sigma > 0 else median
    return max(lo, min(hi, int(round(value))))


def generate_trace(spec: GeneratorSpec) -> Trace:
    """A synthetic trace, identical for identical specs (its own seeded RNG)."""
    spec.validate()
    rng = random.Random(spec.seed)
    weights = spec.priority_weights or [1.0] * spec.priority_classes
    t = 0.0
    requests = []
    for i in range(spec.num_requests):
        if i:
            if spec.arrival == "poisson":
                t += rng.expovariate(spec.rate)
            elif spec.arrival == "bursty":  # gamma: mean 1/rate, coefficient of variation 1/sqrt(shape)
                t += rng.gammavariate(spec.burstiness, 1.0 / (spec.rate * spec.burstiness))
            else:
                t += 1.0 / spec.rate
        prompt_len = lognormal_int(rng, spec.prompt_len_median, spec.prompt_len_sigma, spec.prompt_len_min, spec.prompt_len_max)
        output_len = lognormal_int(rng, spec.output_len_median, spec.output_len_sigma, spec.output_len_min, spec.output_len_max)
        prefix = None
        if spec.shared_prefix_frac and rng.random() < spec.shared_prefix_frac:
            prefix = {"id": rng.randrange(spec.num_prefixes), "len": spec.prefix_len}
            prompt_len += spec.prefix_len  # the drawn length is the request's own part
        priority = rng.choices(range(spec.priority_classes), weights)[0] if spec.priority_classes > 1 else 0
        requests.append(
            TraceRequest(arrival_s=round(t, 6), id=f"r{i}", prompt_len=prompt_len, prefix=prefix,
                         max_tokens=output_len, priority=priority)
        )
    header = {"source": "paged lab gen", "seed": spec.seed, "params": _spec_dict(spec)}
    return Trace(requests, header)


def _spec_dict(spec: GeneratorSpec) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(spec)


# --- recording what the engine served --------------------------------------------------------------
def _sampling_fields(params: Any) -> dict[str, Any]:
    """The fields that differ from the defaults, as JSON (a structured-output constraint as its
    dict, which ``SamplingParams`` reads back)."""
    from dataclasses import asdict, fields, is_dataclass

    from paged.core.sampling_params import SamplingParams

    defaults = SamplingParams()
    out = {}
    for f in fields(params):
        value = getattr(params, f.name)
        if value != getattr(defaults, f.name):
            out[f.name] = asdict(value) if is_dataclass(value) else value
    return out


def _arrival_time(output: Any) -> float:
    metrics = output.metrics or (output.outputs[0].metrics if output.outputs else None)
    return metrics.arrival_time if metrics is not None else 0.0


def _trace_request(output: Any, params: Any, priority: int, text: str | None, t0: float) -> TraceRequest:
    """One finished ``RequestOutput`` as a trace line: arrival relative to ``t0``, the exact
    prompt token ids (the text too, for reading), the generated length as ``output_len``, the
    non-default sampling fields."""
    return TraceRequest(
        arrival_s=round(max(_arrival_time(output) - t0, 0.0), 6), id=str(output.request_id),
        prompt=text if isinstance(text, str) and text else None,
        prompt_token_ids=list(output.prompt_token_ids),
        output_len=max((len(c.token_ids) for c in output.outputs), default=0) or None,
        sampling=_sampling_fields(params), priority=int(priority),
    )


def trace_from_outputs(outputs: Iterable[Any], params: Iterable[Any], priorities: Iterable[int],
                       prompts: Iterable[str | None] = (), source: str = "paged run") -> Trace:
    """A trace of finished ``RequestOutput``s, arrival times relative to the first arrival."""
    outputs, params, priorities = list(outputs), list(params), list(priorities)
    prompts = list(prompts) or [None] * len(outputs)
    t0 = min((_arrival_time(o) for o in outputs), default=0.0)
    requests = [_trace_request(o, p, prio, text, t0) for o, p, prio, text in zip(outputs, params, priorities, prompts)]
    return Trace(requests, {"source": source})


class TraceRecorder:
    """Appends each request to a trace file as it finishes (for a server that runs for days):
    arrival times are relative to the recorder's start; aborted requests are not recorded."""

    def __init__(self, path: str | Path, source: str = "paged serve") -> None:
        import time

        self.t0 = time.monotonic()
        self._pending: dict[str, tuple[Any, int, str | None]] = {}
        self._file = open(path, "w", encoding="utf-8")
        self._file.write(json.dumps({"paged_trace": TRACE_VERSION, "source": source}) + "\n")
        self._file.flush()

    def add(self, request_id: str, params: Any, priority: int, prompt: str | None) -> None:
        self._pending[request_id] = (params, priority, prompt)

    def discard(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def finish(self, output: Any) -> None:
        entry = self._pending.pop(output.request_id, None)
        if entry is None:
            return
        try:
            request = _trace_request(output, *entry, self.t0)
            self._file.write(json.dumps(request.to_dict(), ensure_ascii=False) + "\n")
            self._file.flush()
        except Exception as e:  # a request the trace cannot hold: say so; serving goes on
            logger.warning("trace recorder: request %s not recorded: %s: %s", output.request_id, type(e).__name__, e)

    def close(self) -> None:
        self._file.close()
