"""Prefix caching: a shared system prompt + many short questions, with caching on and off.

Every request = the same --system-tokens system prompt + its own short question. All requests
arrive at once. Prints time to first token (mean, p50, p99) and total time with prefix caching
on and off in the same run, their ratios, and the prefix-cache hit rate.

    python benchmarks/prefix_caching.py --dtype float32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _bench  # noqa: E402


def run(args, caching: bool) -> dict:
    from paged import LLM, SamplingParams

    rng = np.random.default_rng(args.seed)
    system = rng.integers(1000, 20000, args.system_tokens).tolist()
    prompts = [system + rng.integers(1000, 20000, rng.integers(8, 33)).tolist() for _ in range(args.num_questions)]
    llm = LLM(args.model, device="cpu", dtype=args.dtype, attention="torch", enable_prefix_caching=caching,
              max_num_seqs=args.num_questions, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_gib=args.kv_cache_memory_gib)
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    ttft = [o.outputs[0].metrics.time_to_first_token for o in outputs]
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    return {"caching": caching, "total_s": total, "ttft_mean_s": float(np.mean(ttft)),
            "ttft_p50_s": float(np.median(ttft)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "hit_rate": stats.hit_rate, "prompt_tokens": sum(map(len, prompts))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--num-questions", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    on = run(args, True)
    off = run(args, False)
    result = {"on": on, "off": off, "ttft_speedup": off["ttft_mean_s"] / on["ttft_mean_s"],
              "total_speedup": off["total_s"] / on["total_s"]}
    for r in (on, off):
        print(f"prefix caching {'on ' if r['caching'] else 'off'}: total {r['total_s']:6.2f} s, TTFT mean "
              f"{r['ttft_mean_s']:.3f} s p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, hit rate {r['hit_rate']:.3f}")
    print(f"caching on vs off: TTFT {result['ttft_speedup']:.1f}x faster, total {result['total_speedup']:.1f}x faster "
          f"({args.num_questions} questions after a {args.system_tokens}-token system prompt, {args.dtype})")
    _bench.RESULTS.mkdir(exist_ok=True)
    (_bench.RESULTS / f"prefix-caching-{args.dtype}.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
