"""Scheduler + KV-cache simulation with a model that costs nothing.

Measures what the scheduler itself costs per engine step, how well the paged KV cache is filled,
and what the prefix cache finds on a shared-system-prompt workload.

Workload 1 (throughput): ``--num-requests`` seeded requests, all arriving at t=0, with
ShareGPT-like lengths drawn from log-normal fits:
  prompt tokens ~ LogNormal(ln 200, 1.0), clipped to [4, 2048]   (median 200)
  output tokens ~ LogNormal(ln 200, 0.8), clipped to [1, 1024]   (median 200)
Prompts are random token ids (vocabulary 32000), so they share nothing. ``ignore_eos`` and
``max_tokens`` = the drawn output length, so every request generates exactly that many tokens.
The KV pool is sized so that ``max_num_seqs`` requests of the mean full length fit at once.

Workload 2 (prefix cache): ``--shared-requests`` requests, each = the same ``--system-tokens``
system prompt + a unique question (LogNormal(ln 50, 0.8), clipped to [1, 512] tokens), outputs as
above. The hit rate the scheduler reaches (prefix_cache_stats: tokens found / prompt tokens looked
up at admission) is printed next to the best possible one, computed from the workload alone: every
request but the first can reuse the full blocks of the system prompt,
``(n - 1) * floor(system / block_size) * block_size / sum(prompt tokens)``.

Each step: ``schedule()``, then ``update_from_output()`` with a dummy token for every scheduled
request whose prefill completes. The overhead measured is the time of those two calls.

    python benchmarks/scheduler_sim.py [--num-requests 10000] [--seed 0] [--json] [--profile]
        [--policy NAME[:K=V,...]]   # e.g. --policy fair or srpt (dynamic keys: re-keyed every step)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import random
import statistics
import sys
import time

from paged.core.engine.kv_cache_manager import KVCacheManager, cdiv
from paged.core.engine.request import Request
from paged.core.sampling_params import SamplingParams
from paged.core.engine.scheduler import Scheduler

VOCAB = 32000


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def sharegpt_lengths(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(lognormal_int(rng, 200, 1.0, 4, 2048), lognormal_int(rng, 200, 0.8, 1, 1024)) for _ in range(n)]


def make_request(i: int, tokens: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(f"req-{i}", tokens, params, arrival_time=float(i), max_tokens=max_tokens)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def simulate(sched: Scheduler, requests: list[Request], profile: bool = False) -> dict:
    """Run every request to completion; collect per-step overhead and KV utilization."""
    for r in requests:
        sched.add_request(r)
    kv = sched.kv
    bs = kv.block_size
    full = sched.max_num_seqs
    step_us: list[float] = []  # schedule + update, every step (wall clock)
    full_step_us: list[float] = []  # steps with max_num_seqs requests running
    full_step_cpu_us: list[float] = []  # the same steps in CPU time (robust to a busy machine)
    per_req_us: list[float] = []  # step overhead / scheduled requests
    peak_blocks, peak_util, min_full_util = 0, 0.0, 1.0
    num_steps = 0
    profiler = cProfile.Profile() if profile else None
    perf, cpu = time.perf_counter, time.thread_time
    t_start = perf()
    while sched.has_unfinished_requests():
        if profiler:
            profiler.enable()
        c0, t0 = cpu(), perf()
        out = sched.schedule()
        t1, c1 = perf(), cpu()
        if profiler:
            profiler.disable()
        sampled = {s.request.request_id: 1 for s in out.scheduled if s.is_sampled}  # "the model"
        # KV utilization after allocation: tokens held / slots in the blocks in use.
        blocks_in_use = kv.num_blocks - kv.num_free_blocks
        util = 0.0
        if blocks_in_use:
            util = sum(r.num_computed_tokens for r in sched.running) / (blocks_in_use * bs)
        n_running = len(sched.running)
        if profiler:
            profiler.enable()
        c2, t2 = cpu(), perf()
        sched.update_from_output(out, sampled)
        t3, c3 = perf(), cpu()
        if profiler:
            profiler.disable()
        num_steps += 1
        us = ((t1 - t0) + (t3 - t2)) * 1e6
        step_us.append(us)
        if out.scheduled:
            per_req_us.append(us / len(out.scheduled))
        if n_running >= full:
            full_step_us.append(us)
            full_step_cpu_us.append(((c1 - c0) + (c3 - c2)) * 1e6)
            min_full_util = min(min_full_util, util)
        if blocks_in_use > peak_blocks:
            peak_blocks, peak_util = blocks_in_use, util
    wall = perf() - t_start
    result = {
        "steps": num_steps,
        "steps_at_max_num_seqs": len(full_step_us),
        "step_us_median": statistics.median(step_us),
        "step_us_p99": percentile(step_us, 99),
        "full_step_us_median": statistics.median(full_step_us) if full_step_us else float("nan"),
        "full_step_us_p99": percentile(full_step_us, 99),
        "full_step_cpu_us_median": statistics.median(full_step_cpu_us) if full_step_cpu_us else float("nan"),
        "full_step_cpu_us_p99": percentile(full_step_cpu_us, 99),
        "per_request_us_median": statistics.median(per_req_us),
        "per_request_us_p99": percentile(per_req_us, 99),
        "peak_blocks_in_use": peak_blocks,
        "kv_utilization_at_peak": peak_util,
        "kv_utilization_min_at_max_num_seqs": min_full_util if full_step_us else float("nan"),
        "preemptions": sched.num_preemptions,
        "prefix_hit_rate": kv.prefix_cache_stats.hit_rate,
        "wall_s": wall,
    }
    if profiler:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
        result["profile"] = buf.getvalue()
    return result


def make_scheduler(args, num_blocks: int) -> Scheduler:
    from paged.core.lab.records import PolicyRun

    policy = PolicyRun.parse(args.policy).build()[2]  # any registered policy, NAME[:K=V,...]
    kv = KVCacheManager(num_blocks, args.block_size, enable_caching=not args.no_prefix_caching)
    return Scheduler(
        policy,
        kv,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )


def throughput_workload(args) -> dict:
    rng = random.Random(args.seed)
    lengths = sharegpt_lengths(rng, args.num_requests)
    requests = [make_request(i, [rng.randrange(VOCAB) for _ in range(p)], o) for i, (p, o) in enumerate(lengths)]
    mean_blocks = statistics.fmean(cdiv(p + o, args.block_size) for p, o in lengths)
    num_blocks = args.num_blocks or math.ceil(args.max_num_seqs * mean_blocks)
    sched = make_scheduler(args, num_blocks)
    result = simulate(sched, requests, profile=args.profile)
    result.update(
        num_requests=args.num_requests,
        num_blocks=num_blocks,
        prompt_tokens_median=statistics.median(p for p, _ in lengths),
        prompt_tokens_mean=statistics.fmean(p for p, _ in lengths),
        output_tokens_median=statistics.median(o for _, o in lengths),
        output_tokens_mean=statistics.fmean(o for _, o in lengths),
    )
    return result


def shared_prefix_workload(args) -> dict:
    rng = random.Random(args.seed + 1)
    system = [rng.randrange(VOCAB) for _ in range(args.system_tokens)]
    requests, prompt_tokens = [], 0
    for i in range(args.shared_requests):
        question = [rng.randrange(VOCAB) for _ in range(lognormal_int(rng, 50, 0.8, 1, 512))]
        output = lognormal_int(rng, 200, 0.8, 1, 1024)
        requests.append(make_request(i, system + question, output))
        prompt_tokens += len(system) + len(question)
    bs = args.block_size
    cacheable = (args.system_tokens // bs) * bs
    possible = (args.shared_requests - 1) * cacheable / prompt_tokens
    mean_blocks = statistics.fmean(cdiv(r.num_prompt_tokens + r.max_tokens, bs) for r in requests)
    num_blocks = args.num_blocks or math.ceil(args.max_num_seqs * mean_blocks)
    sched = make_scheduler(args, num_blocks)
    result = simulate(sched, requests)
    stats = sched.kv.prefix_cache_stats
    return {
        "num_requests": args.shared_requests,
        "system_tokens": args.system_tokens,
        "num_blocks": num_blocks,
        "hit_rate": stats.hit_rate,
        "possible_hit_rate": possible,
        "admissions": stats.requests,
        "preemptions": result["preemptions"],
        "step_us_median": result["step_us_median"],
        "wall_s": result["wall_s"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--profile", action="store_true", help="cProfile schedule + update (throughput run)")
    ap.add_argument("--policy", default="fcfs", metavar="NAME[:K=V,...]",
                    help="any registered policy, e.g. srpt:aging_tokens_per_s=10 or fair (dynamic keys)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=0, help="KV pool size (0: fit max-num-seqs mean requests)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--shared-requests", type=int, default=2000)
    ap.add_argument("--system-tokens", type=int, default=1000)
    args = ap.parse_args(argv)

    tp = throughput_workload(args)
    sp = shared_prefix_workload(args) if args.shared_requests > 0 else None
    targets = {
        "overhead_le_1ms_at_max_num_seqs": tp["full_step_us_median"] <= 1000.0,
        "kv_utilization_ge_95pct": tp["kv_utilization_at_peak"] >= 0.95,
    }
    if args.json:
        profile = tp.pop("profile", None)
        print(json.dumps({"args": vars(args), "throughput": tp, "shared_prefix": sp, "targets": targets}, indent=2))
        if profile:
            print(profile, file=sys.stderr)
        return 0

    print(f"workload: {tp['num_requests']} requests, seed {args.seed}; prompt median {tp['prompt_tokens_median']:.0f} "
          f"(mean {tp['prompt_tokens_mean']:.0f}), output median {tp['output_tokens_median']:.0f} "
          f"(mean {tp['output_tokens_mean']:.0f}) tokens")
    print(f"config: max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
          f"block_size {args.block_size}, num_blocks {tp['num_blocks']}, policy {args.policy}, "
          f"prefix caching {'off' if args.no_prefix_caching else 'on'}")
    print(f"steps: {tp['steps']} ({tp['steps_at_max_num_seqs']} at {args.max_num_seqs} running); "
          f"preemptions {tp['preemptions']}; simulated in {tp['wall_s']:.1f} s")
    print(f"overhead per step at {args.max_num_seqs} running (schedule + update): "
          f"median {tp['full_step_us_median']:.0f} us, p99 {tp['full_step_us_p99']:.0f} us "
          f"(CPU time: median {tp['full_step_cpu_us_median']:.0f} us, p99 {tp['full_step_cpu_us_p99']:.0f} us)")
    print(f"overhead per step, all steps: median {tp['step_us_median']:.0f} us, p99 {tp['step_us_p99']:.0f} us")
    print(f"overhead per scheduled request: median {tp['per_request_us_median']:.2f} us, "
          f"p99 {tp['per_request_us_p99']:.2f} us")
    print(f"KV utilization at peak ({tp['peak_blocks_in_use']} blocks in use): {tp['kv_utilization_at_peak']:.2%}; "
          f"lowest while {args.max_num_seqs} run: {tp['kv_utilization_min_at_max_num_seqs']:.2%}")
    if sp:
        print(f"shared system prompt ({sp['system_tokens']} tokens, {sp['num_requests']} requests, "
              f"{sp['num_blocks']} blocks): prefix-cache hit rate {sp['hit_rate']:.2%} "
              f"(possible {sp['possible_hit_rate']:.2%}); {sp['preemptions']} preemptions")
    print("targets: " + ", ".join(f"{k} {'OK' if v else 'MISSED'}" for k, v in targets.items()))
    if "profile" in tp:
        print(tp["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
