"""The scheduling-policy contract: the decision points a policy plugin owns.

The scheduler (paged.core.engine.scheduler) owns the mechanism: token budget, chunked prefill,
block allocation, prefix lookup, preemption by recompute, and every invariant of the KV cache. A
policy only *decides*, through the methods below; each has a default (in ``BasePolicy``, and the
scheduler falls back to it for a policy that does not define the method), so a policy written
against the first contract (``sort_key`` + ``select_victim`` + ``displaces_running``) works unchanged.

1. **order** - ``sort_key(request)``, lower first. The waiting queue and the running list are
   kept in this order: it decides who is admitted first, who gets budget first and (by default)
   who is preempted. Two kinds, declared by the class attribute ``dynamic``:

   - static (``dynamic = False``, the default): ``sort_key(request)`` is computed once, when the
     request enters the queue, and kept for its life (also across preemption). Aging can be
     written statically when every request ages at the same rate (see the priority policy).
   - dynamic (``dynamic = True``): ``sort_key(request, now)`` is recomputed at every step for the
     running requests, and for the waiting ones whenever the scheduler is about to admit (seats
     and budget are free) or to displace. ``now`` is the scheduler's clock (seconds; the same
     clock as ``arrival_time`` and ``deadline``). Keep it cheap: at 256 running it is called 256
     times per step. A policy whose waiting requests keep their relative order while they wait
     (e.g. keys that age uniformly) sets ``dynamic_waiting = False``: only the running ones are
     re-keyed, and a waiting request keeps the key it got when it (re-)entered the queue.
   - grouped waiting (dynamic policies, for long queues): a policy whose key orders the waiting
     requests of one group the same way at every step (one tenant's requests by arrival, say)
     defines ``waiting_group(request) -> (group, order)``: a hashable group and a static key
     within it. The scheduler then keeps one queue per group in ``order`` and re-keys only the
     first ``waiting_window`` requests of each group (default 1: the heads), so a step costs
     O(groups x window) key calls instead of O(waiting). With window 1 and a key consistent with
     ``order`` inside each group, the admission order is exactly that of a full re-key; a larger
     window bounds how far a request can move ahead of its group's order (cache-aware does this).

2. **admission** - ``admit(request, now) -> Admission``: called when a request arrives (a
   rejection then raises ``RequestRejectedError`` to the caller: HTTP 429 or 503 with the reason)
   and again each time it reaches the head of the waiting queue with room to run (a rejection
   then finishes it with finish reason ``"rejected"``; a deferral leaves it waiting and lets the
   next one try; at most ``MAX_DEFERRALS_PER_STEP`` deferrals per step). Default: accept.

3. **budget split** - ``split_budget(state) -> BudgetSplit | None``, once per step: how many of
   the step's tokens prefill chunks may take (decodes, one token each, are never capped) and the
   largest prefill chunk one request gets this step. Default ``None``: prefill takes whatever
   decodes leave, chunks are capped by ``scheduler.long_prefill_token_threshold``. Without chunked
   prefill the split is not applied (a prompt must be admitted whole).

4. **victim** - ``select_victim(candidates)`` when blocks run out: default the largest key.
   **displacement** - ``displaces_running``: may a better waiting request preempt a running one
   when the batch is full.

5. **feedback** - ``on_step(stats: StepStats)``, once per step after scheduling, with what the step
   did (for policies that adapt: service counters, step-time estimates, feedback control).

What a policy sees of a request is a ``RequestView``: read-only properties, no access to the
token lists the mechanism mutates or to the block table. Fields: ``request_id``,
``num_prompt_tokens``, ``num_output_tokens``, ``num_tokens``, ``num_computed_tokens``,
``num_cached_tokens`` (prefix-cache hit at first admission, -1 before), ``prefix_hit_tokens``
(the tokens the prefix cache holds for it now: for waiting requests, when the policy sets
``uses_prefix_hits = True``, refreshed before each dynamic re-key), ``arrival_time``,
``priority``, ``tenant``, ``deadline`` (absolute, scheduler clock; None = none), ``max_tokens``,
``is_running``, ``is_finished``, ``num_preemptions``, ``num_service_tokens`` (tokens computed for it so far,
recomputation included) and ``service_s(now)`` (seconds it has spent running). What the engine's
``Request`` offered a policy under the first contract is there too, read-only:
``sampling_params`` (a read-only view: fields only, lists as tuples), ``prompt_token_ids``,
``output_token_ids`` and ``all_token_ids`` (tuples; the last two are copied at each read, so a
policy keyed every step should use the counts instead), ``block_hashes`` (tuple), ``status``,
``cache_salt``, ``eos_token_id``, ``first_scheduled_time``, ``first_token_time`` and
``finished_time``. Anything else, and any assignment, raises an AttributeError that says what a
policy can use instead (per-request state belongs in the policy, keyed by ``request_id``). The
view reads the fields listed in ``RequestFields`` and nothing else; the engine's ``Request``
provides them, so this contract imports no engine module.

Invariants a policy cannot break whatever it returns: the token budget, ``max_num_seqs``, block
accounting, prefix-cache correctness, and liveness (a budget split gives prefill at least one
token; keys only order, they never skip a request forever unless the policy keeps deferring it).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Hashable, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from paged.core.sampling_params import SamplingParams

# A policy that keeps deferring stops admission for the step after this many deferrals: the
# scheduler never scans an unbounded queue.
MAX_DEFERRALS_PER_STEP = 32


class ReadOnlyView:
    """A read-only window on a plain object (a request's ``SamplingParams``): fields read
    through, lists as tuples, dicts as mapping proxies, nested objects as views; nothing can be
    set and no method can be called (a policy must not change what the request asked for)."""

    __slots__ = ("_target", "_path")

    def __init__(self, target: object, path: str) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str):
        value = getattr(self._target, name)  # AttributeError names the missing field
        if value is None or isinstance(value, (bool, int, float, str, bytes, tuple, frozenset)):
            return value
        if isinstance(value, list):
            return tuple(value)
        if isinstance(value, dict):
            return MappingProxyType(value)
        if callable(value):
            raise AttributeError(f"{self._path}.{name}: a policy sees the fields only (read-only view), not methods")
        return ReadOnlyView(value, f"{self._path}.{name}")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"{self._path}.{name}: read-only; a policy cannot change what a request asked for")

    def __repr__(self) -> str:
        return f"ReadOnlyView({self._target!r})"


def _tuple_of(name: str):
    return property(lambda self: tuple(getattr(self._request, name)))


# Names a policy may reach for that are not offered, and what to use instead.
_NOT_OFFERED = {
    "block_ids": "the KV cache manager owns the blocks; use num_computed_tokens or prefix_hit_tokens",
    "block_table": "the KV cache manager owns the blocks; use num_computed_tokens or prefix_hit_tokens",
    "grammar": "the structured-output matcher is the engine's; use sampling_params.structured_output",
    "append_output_token": "a policy cannot change a request; the scheduler appends tokens",
}


class StatusFlags(Protocol):
    """What the view needs of a request's status (the engine's ``RequestStatus`` members)."""

    finished: bool


@runtime_checkable
class RequestFields(Protocol):
    """Everything a ``RequestView`` reads of the request it wraps, by name. The contract is
    defined here and the engine's ``Request`` (paged.core.engine.request) satisfies it, so the
    contract depends on no engine class; a field renamed there must be renamed here too (a test
    checks that the view reads nothing else and that ``Request`` has all of it)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    all_token_ids: Sequence[int]  # prompt + output
    block_hashes: Sequence[bytes]
    sampling_params: "SamplingParams"
    num_computed_tokens: int
    num_cached_tokens: int
    prefix_hit_tokens: int
    arrival_time: float
    priority: int
    tenant: str | None
    deadline: float | None
    max_tokens: int
    num_preemptions: int
    num_service_tokens: int
    sort_key: tuple
    status: StatusFlags
    cache_salt: str | None
    eos_token_id: int | None
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    running_s: float  # seconds spent running before the current run
    running_since: float | None  # start of the current run; None while not running


class RequestView:
    """A read-only window on a request for policies (one per request, made once)."""

    __slots__ = ("_request", "_prompt", "_params")

    def __init__(self, request: RequestFields) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "_request", request)
        setattr_(self, "_prompt", None)  # the prompt as a tuple, made on first read
        setattr_(self, "_params", None)

    def __repr__(self) -> str:
        return f"RequestView({self._request.request_id!r})"

    request_id = property(attrgetter("_request.request_id"))
    num_prompt_tokens = property(lambda self: len(self._request.prompt_token_ids))
    num_output_tokens = property(lambda self: len(self._request.output_token_ids))
    num_tokens = property(lambda self: len(self._request.all_token_ids))
    num_computed_tokens = property(attrgetter("_request.num_computed_tokens"))
    num_cached_tokens = property(attrgetter("_request.num_cached_tokens"))
    prefix_hit_tokens = property(attrgetter("_request.prefix_hit_tokens"))
    arrival_time = property(attrgetter("_request.arrival_time"))
    priority = property(attrgetter("_request.priority"))
    tenant = property(attrgetter("_request.tenant"))
    deadline = property(attrgetter("_request.deadline"))
    max_tokens = property(attrgetter("_request.max_tokens"))
    num_preemptions = property(attrgetter("_request.num_preemptions"))
    num_service_tokens = property(attrgetter("_request.num_service_tokens"))
    sort_key = property(attrgetter("_request.sort_key"))
    # What the engine's Request offered a policy under the first contract (README at 402312c).
    status = property(attrgetter("_request.status"))
    cache_salt = property(attrgetter("_request.cache_salt"))
    eos_token_id = property(attrgetter("_request.eos_token_id"))
    first_scheduled_time = property(attrgetter("_request.first_scheduled_time"))
    first_token_time = property(attrgetter("_request.first_token_time"))
    finished_time = property(attrgetter("_request.finished_time"))
    output_token_ids = _tuple_of("output_token_ids")
    all_token_ids = _tuple_of("all_token_ids")
    block_hashes = _tuple_of("block_hashes")

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        if self._prompt is None:  # the prompt never changes: one copy
            object.__setattr__(self, "_prompt", tuple(self._request.prompt_token_ids))
        return self._prompt

    @property
    def sampling_params(self) -> ReadOnlyView:
        if self._params is None:
            object.__setattr__(self, "_params", ReadOnlyView(self._request.sampling_params, "sampling_params"))
        return self._params

    @property
    def is_finished(self) -> bool:
        return self._request.status.finished

    @property
    def is_running(self) -> bool:
        return self._request.running_since is not None

    def service_s(self, now: float) -> float:
        r = self._request
        return r.running_s + (now - r.running_since if r.running_since is not None else 0.0)

    def __getattr__(self, name: str):
        # Only reached for names the view does not define.
        if name.startswith("__"):
            raise AttributeError(name)
        hint = _NOT_OFFERED.get(name)
        offered = ", ".join(sorted(n for n in dir(RequestView) if not n.startswith("_")))
        raise AttributeError(
            f"RequestView has no attribute {name!r}: a policy sees a read-only view of each request "
            f"(paged.core.policy.RequestView). " + (f"Instead: {hint}. " if hint else "") + f"It offers: {offered}"
        )

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(
            f"RequestView.{name}: read-only; a policy cannot change a request. Keep per-request state in the "
            f"policy, keyed by request.request_id (and drop it in on_step when the view is_finished)"
        )


@dataclass(frozen=True, slots=True)
class Admission:
    """An admission decision. ``http_status`` (429 or 503) is what a rejected client gets."""

    decision: str  # "accept" | "defer" | "reject"
    reason: str = ""
    http_status: int = 429

    ACCEPT: ClassVar["Admission"]

    @staticmethod
    def defer(reason: str = "") -> "Admission":
        return Admission("defer", reason)

    @staticmethod
    def reject(reason: str, http_status: int = 429) -> "Admission":
        if http_status not in (429, 503):
            raise ValueError(f"Admission.reject: http_status {http_status!r}; one of 429, 503")
        return Admission("reject", reason, http_status)


Admission.ACCEPT = Admission("accept")


@dataclass(frozen=True, slots=True)
class BudgetState:
    """What ``split_budget`` sees at the start of a step."""

    now: float
    token_budget: int  # max_num_batched_tokens
    num_running: int
    num_waiting: int
    num_decoding: int  # running requests past their prompt (each wants one token)
    kv_free_fraction: float


@dataclass(frozen=True, slots=True)
class BudgetSplit:
    """``prefill_tokens``: tokens prefill chunks may take this step (None: what decodes leave);
    ``chunk_tokens``: the largest chunk one request gets (None: long_prefill_token_threshold)."""

    prefill_tokens: int | None = None
    chunk_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step did, for ``on_step``. ``scheduled``: (request, prefill tokens, decode
    tokens) for each scheduled request."""

    now: float
    token_budget: int  # max_num_batched_tokens
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    num_deferred: int
    num_rejected: int
    kv_usage: float
    scheduled: tuple[tuple[RequestView, int, int], ...]


@runtime_checkable
class SchedulingPolicy(Protocol):
    """The minimum a policy defines; the other decision points are optional (see BasePolicy)."""

    name: str
    displaces_running: bool

    def sort_key(self, request: RequestView) -> tuple: ...

    def select_victim(self, candidates: Sequence[RequestView]) -> RequestView: ...


class BasePolicy:
    """Convenience base with every decision point's default: subclasses define ``sort_key``."""

    name = "base"
    displaces_running = False
    dynamic = False  # True: sort_key(request, now), recomputed every step
    dynamic_waiting = True  # with dynamic: re-key the waiting queue too (False: running only)
    uses_prefix_hits = False  # True: waiting requests' prefix_hit_tokens refreshed before re-keying
    waiting_window = 1  # with waiting_group: requests per group re-keyed each step

    def __init__(self, options=None) -> None:
        self.options = options

    def sort_key(self, request: RequestView) -> tuple:
        raise NotImplementedError

    def select_victim(self, candidates: Sequence[RequestView]) -> RequestView:
        # Among equal keys the last one (candidates are in running order): a request never
        # preempts itself while an equal one behind it keeps running.
        return max(reversed(candidates), key=lambda r: r.sort_key)

    def waiting_group(self, request: RequestView) -> tuple[Hashable, tuple] | None:
        # Not called unless a subclass defines it (the scheduler checks with ``overrides``).
        return None

    def admit(self, request: RequestView, now: float) -> Admission:
        return Admission.ACCEPT

    def split_budget(self, state: BudgetState) -> BudgetSplit | None:
        return None

    def on_step(self, stats: StepStats) -> None:
        return None


def overrides(policy, method: str) -> bool:
    """Whether ``policy`` defines ``method`` other than BasePolicy's default (so the scheduler
    skips calling a default that does nothing)."""
    impl = getattr(type(policy), method, None)
    return impl is not None and impl is not getattr(BasePolicy, method)
