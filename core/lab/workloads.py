"""Named workloads that show what each research policy is for (``paged lab gen --workload``).

Each is seeded (the same arguments give the same trace) and sized by ``num_requests`` and
``rate`` (mean requests per second over the whole trace):

- ``multi-tenant``: ``tenants`` tenants, Poisson arrivals; tenant ``t0`` sends ``flood`` times
  the rate of each other tenant (10x by default). Shows ``fair`` (VTC): the light tenants should
  see about the latency they would see alone.
- ``shared-prefix``: ``num_prefixes`` long shared prefixes (system prompts, documents), requests
  interleaved across them in random order with a short own part. When the KV cache cannot hold
  every prefix at once, the order decides the prefix-cache hit rate: ``cache-aware``.
- ``heavy-tail``: most requests short, a few very long (prompts and outputs from a two-part
  mixture): ``srpt`` lowers mean latency by not letting the long ones block the short.
- ``deadline``: interactive requests (short, ``deadline_s`` of a few seconds) mixed with batch ones
  (longer, loose deadlines); at overload rates ``slo`` turns away what cannot make it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from paged.core.lab.trace import Trace, TraceError, TraceRequest, lognormal_int

WORKLOADS = ("multi-tenant", "shared-prefix", "heavy-tail", "deadline")


@dataclass
class WorkloadSpec:
    workload: str
    num_requests: int = 200
    rate: float = 20.0
    seed: int = 0
    tenants: int = 4  # multi-tenant
    flood: float = 10.0  # multi-tenant: the flooding tenant's rate / each other tenant's
    num_prefixes: int = 8  # shared-prefix
    prefix_len: int = 512  # shared-prefix

    def validate(self) -> None:
        if self.workload not in WORKLOADS:
            raise TraceError(f"--workload: invalid value {self.workload!r}; one of {', '.join(WORKLOADS)}")
        for name, ok, accepted in (
            ("num_requests", self.num_requests >= 1, ">= 1"), ("rate", self.rate > 0, "> 0"),
            ("tenants", self.tenants >= 2, ">= 2"), ("flood", self.flood >= 1, ">= 1"),
            ("num_prefixes", self.num_prefixes >= 1, ">= 1"), ("prefix_len", self.prefix_len >= 1, ">= 1"),
        ):
            if not ok:
                raise TraceError(f"--{name.replace('_', '-')}: invalid value {getattr(self, name)!r}; must be {accepted}")


def generate_workload(spec: WorkloadSpec) -> Trace:
    spec.validate()
    rng = random.Random(f"paged-workload:{spec.workload}:{spec.seed}")
    make = {"multi-tenant": _multi_tenant, "shared-prefix": _shared_prefix, "heavy-tail": _heavy_tail,
            "deadline": _deadline}[spec.workload]
    requests = make(spec, rng)
    requests.sort(key=lambda r: r.arrival_s)
    for i, request in enumerate(requests):
        request.id = f"r{i}"
    return Trace(requests, {"source": "paged lab gen", "seed": spec.seed, "params": asdict(spec)})


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 6))
        t += rng.expovariate(rate)
    return out


def _multi_tenant(spec: WorkloadSpec, rng: random.Random) -> list[TraceRequest]:
    weights = [spec.flood] + [1.0] * (spec.tenants - 1)
    out = []
    for t in _arrivals(rng, spec.num_requests, spec.rate):
        tenant = rng.choices(range(spec.tenants), weights)[0]
        out.append(TraceRequest(arrival_s=t, tenant=f"t{tenant}", prompt_len=lognormal_int(rng, 128, 0.6, 8, 1024),
                                max_tokens=lognormal_int(rng, 64, 0.6, 4, 256)))
    return out


def _shared_prefix(spec: WorkloadSpec, rng: random.Random) -> list[TraceRequest]:
    out = []
    for t in _arrivals(rng, spec.num_requests, spec.rate):
        prefix = {"id": rng.randrange(spec.num_prefixes), "len": spec.prefix_len}
        own = lognormal_int(rng, 32, 0.5, 4, 256)
        out.append(TraceRequest(arrival_s=t, prompt_len=spec.prefix_len + own, prefix=prefix,
                                max_tokens=lognormal_int(rng, 32, 0.5, 4, 128)))
    return out


def _heavy_tail(spec: WorkloadSpec, rng: random.Random) -> list[TraceRequest]:
    out = []
    for t in _arrivals(rng, spec.num_requests, spec.rate):
        if rng.random() < 0.1:  # the tail: long prompts, long outputs
            prompt, output = lognormal_int(rng, 1024, 0.5, 256, 4096), lognormal_int(rng, 512, 0.5, 128, 1024)
        else:
            prompt, output = lognormal_int(rng, 64, 0.6, 4, 512), lognormal_int(rng, 24, 0.6, 2, 128)
        out.append(TraceRequest(arrival_s=t, prompt_len=prompt, max_tokens=output))
    return out


def _deadline(spec: WorkloadSpec, rng: random.Random) -> list[TraceRequest]:
    out = []
    for t in _arrivals(rng, spec.num_requests, spec.rate):
        if rng.random() < 0.6:  # interactive: short, tight deadline
            prompt, output = lognormal_int(rng, 96, 0.5, 8, 512), lognormal_int(rng, 24, 0.5, 4, 96)
            deadline = round(rng.uniform(1.0, 3.0), 3)
            priority = 0
        else:  # batch: longer, loose deadline
            prompt, output = lognormal_int(rng, 256, 0.5, 32, 1024), lognormal_int(rng, 128, 0.5, 16, 512)
            deadline = round(rng.uniform(10.0, 30.0), 3)
            priority = 1
        out.append(TraceRequest(arrival_s=t, prompt_len=prompt, max_tokens=output, deadline_s=deadline,
                                priority=priority))
    return out
