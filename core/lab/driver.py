"""The driver loop of a replay: arrivals, steps, the clock, and what each step did."""

from __future__ import annotations

import hashlib
import time
from typing import Sequence

from paged.core.errors import ConfigError, PagedError, RequestRejectedError
from paged.core.engine.request import Request
from paged.core.lab.cost import CostModel, batch_shape
from paged.core.lab.records import LabRequest, ReplayResult, RequestRecord, StepRecord


# --- the driver loop ----------------------------------------------------------------------------------------
def run_replay(requests: Sequence[LabRequest], executor, *, cost: CostModel | None = None, label: str = "",
               policy: str = "", options: dict | None = None) -> ReplayResult:
    """Replay ``requests`` (sorted by arrival) on ``executor``; ``cost`` drives the clock in the
    ``sim`` and ``steps`` modes."""
    mode = executor.mode
    if mode in ("sim", "steps") and cost is None:
        raise ConfigError(f"lab: mode {mode!r} needs a cost model (or a fixed step time)")
    for request in requests:
        try:
            executor.check(request)
        except PagedError as e:
            raise PagedError(f"trace request {request.id!r} cannot be replayed: {e}") from None
    records = {
        r.id: RequestRecord(r.id, r.priority, r.arrival, len(r.prompt_token_ids), r.output_len, tenant=r.tenant,
                            deadline_s=r.deadline_s)
        for r in requests
    }
    last_arrival = requests[-1].arrival if requests else 0.0
    live: dict[str, tuple[Request, RequestRecord]] = {}
    steps: list[StepRecord] = []
    digest = hashlib.sha256()
    perf, cpu = time.perf_counter, time.process_time
    wall_t0 = perf()
    now = 0.0
    i, n = 0, len(requests)
    empty_steps = 0
    last_end: float | None = None  # end of the previous step, unless the engine went idle since
    while i < n or executor.busy():
        if mode == "wall":
            now = perf() - wall_t0
        executor.now = now
        while i < n and requests[i].arrival <= now:
            try:
                core = executor.add(requests[i])
                live[requests[i].id] = (core, records[requests[i].id])
            except RequestRejectedError as e:
                records[requests[i].id].rejected = str(e)
            i += 1
        if not executor.busy():
            if i >= n:
                break
            target = requests[i].arrival
            if mode == "wall":
                time.sleep(max(0.0, target - (perf() - wall_t0)))
            else:
                now = target
            last_end = None
            continue
        # Back to back steps touch (in wall mode the bookkeeping between them counts to the next).
        t_start = now if last_end is None else last_end
        w0, c0 = perf(), cpu()
        executor.now = t_start
        out, (running, waiting, kv_usage) = executor.step()
        w1, c1 = perf(), cpu()
        shape = batch_shape(out)
        if mode == "wall":
            now = w1 - wall_t0
        elif mode == "cpu":
            now += c1 - c0
        else:
            now += cost.predict(shape)
        finished = 0
        for rejected in getattr(out, "rejected", ()):
            entry = live.pop(rejected.request_id, None)
            if entry is not None and entry[0] is rejected:
                entry[1].rejected = rejected.reject_reason
        for s in out.scheduled:
            core = s.request
            digest.update(f"{core.request_id}:{s.num_computed_tokens}:{s.num_new_tokens};".encode())
            entry = live.get(core.request_id)
            if entry is None or entry[0] is not core:
                continue
            record = entry[1]
            if now <= last_arrival:
                record.service_tokens += s.num_new_tokens
            if record.first_scheduled is None:
                record.first_scheduled = t_start
            generated = core.num_output_tokens
            if generated > record.num_generated:
                record.num_generated = generated
                if record.first_token is None:
                    record.first_token = now
            if core.is_finished:
                record.finished = now
                record.num_cached_tokens = max(core.num_cached_tokens, 0)
                record.num_preemptions = core.num_preemptions
                del live[core.request_id]
                finished += 1
        digest.update(b"|")
        last_end = now
        steps.append(
            StepRecord(len(steps), t_start, now, shape.num_seqs, shape.prefill_tokens, shape.decode_tokens,
                       shape.context_tokens, shape.prefill_attention, shape.prefill_seqs, running, waiting, kv_usage,
                       len(out.preempted_request_ids), finished,
                       (w1 - w0) if mode != "sim" else None, (c1 - c0) if mode != "sim" else None)
        )
        empty_steps = empty_steps + 1 if not out.scheduled else 0
        if empty_steps > 1000:
            raise PagedError("lab: the scheduler scheduled nothing for 1000 steps in a row with requests left")
    stats = executor.prefix_stats
    return ReplayResult(label or policy, policy, dict(options or {}), mode, steps, list(records.values()),
                        digest.hexdigest(), stats.hit_rate, perf() - wall_t0, spec_decode=executor.spec_decode)
