"""Scale out: tokens/s with tensor parallelism 1 vs 2 and data parallelism 1 vs 2, in one run.

Same model (the embedded default unless --model), dtype, seeded random-token prompts and greedy
decoding (ignore EOS), each configuration in fresh processes one after the other:

  tensor parallelism, offline (``LLM``, all prompts at once):
    tp1/1t  one rank with one thread: what one core does alone (the reference for efficiency)
    tp1     one rank with every thread (the normal configuration)
    tp2     two ranks (``--tensor-parallel-size 2``), the threads shared between them
  data parallelism, served (``paged serve`` + the streaming load generator of benchmarks/serve.py,
  --max-concurrency requests in flight):
    dp1     one engine core with every thread
    dp2     two engine cores (``--data-parallel-size 2``), the threads shared between them

Prints output tokens/s per configuration, the ratios tp2/tp1 and dp2/dp1, and the scaling
efficiency against one thread (tokens/s / (processes x tp1/1t)). On a machine with few cores the
ranks and cores only divide the same cores: see the README for a reading of the figures.

    python benchmarks/scale_out.py [--dtype float32] [--num-prompts 32] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _bench  # noqa: E402

HERE = Path(__file__).resolve()


# --- offline phase (its own process) ---------------------------------------------------------
def phase_offline(args) -> dict:
    from paged import LLM, SamplingParams

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    prompts, outputs = _bench.random_workload(args.num_prompts, args.seed, tuple(args.prompt_range), tuple(args.output_range))
    with LLM(args.model, device="cpu", dtype=args.dtype, tensor_parallel_size=args.tp, max_num_seqs=args.max_num_seqs,
             num_kv_blocks=args.num_kv_blocks) as llm:
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
        llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
        steps0 = llm.engine.core.snapshot_stats().num_steps
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        steps = llm.engine.core.snapshot_stats().num_steps - steps0
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    assert produced == sum(outputs), (produced, sum(outputs))
    return {"output_tokens": produced, "input_tokens": sum(map(len, prompts)), "elapsed_s": elapsed,
            "tokens_per_s": produced / elapsed, "steps": steps, "ms_per_step": 1000 * elapsed / steps,
            "token_ids": [r.outputs[0].token_ids for r in results]}


# --- served phase (a server process + the load generator here) --------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(args, dp: int) -> dict:
    import httpx

    import serve as serve_bench

    port = _free_port()
    cmd = [sys.executable, "-m", "paged.core.cli", "serve", "--port", str(port), "--quiet", "--dtype", args.dtype,
           "--device", "cpu", "--data-parallel-size", str(dp), "--max-num-seqs", str(args.max_num_seqs),
           "--num-kv-blocks", str(args.num_kv_blocks)]
    if args.model:
        cmd += ["--model", args.model]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGED_")}
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"server (dp={dp}) exited: {server.stderr.read()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server (dp={dp}) not healthy after 300 s")
            time.sleep(0.5)
        load = serve_bench.build_parser().parse_args([
            "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--input-len", str(args.serve_input_len),
            "--output-len", str(args.serve_output_len), "--range-ratio", "0.5", "--seed", str(args.seed),
        ])
        summary = asyncio.run(serve_bench.run(load))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    if summary["failed_requests"]:
        raise RuntimeError(f"dp={dp}: {summary['failed_requests']} requests failed: {summary.get('errors')}")
    return {"tokens_per_s": summary["output_token_throughput"], "elapsed_s": summary["duration_s"],
            "output_tokens": summary["total_output_tokens"], "ttft_ms_median": summary["ttft_ms"]["median"],
            "tpot_ms_median": summary["tpot_ms"]["median"]}


# --- driver ------------------------------------------------------------------------------------
def _offline_args(args, tp: int, threads: int | None) -> list[str]:
    out = ["--phase", "offline", "--tp", str(tp), "--dtype", args.dtype, "--num-prompts", str(args.num_prompts),
           "--seed", str(args.seed), "--max-num-seqs", str(args.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks),
           "--prompt-range", *map(str, args.prompt_range), "--output-range", *map(str, args.output_range)]
    if threads:
        out += ["--threads", str(threads)]
    if args.model:
        out += ["--model", args.model]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--output-range", type=int, nargs=2, default=[16, 128])
    parser.add_argument("--serve-input-len", type=int, default=128)
    parser.add_argument("--serve-output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], choices=["tp", "dp"], help="leave out a part")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--phase", choices=["offline"], help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.phase == "offline":
        print(json.dumps(phase_offline(args)))
        return

    cores = os.cpu_count() or 1
    print(f"machine: {cores} CPU cores; dtype {args.dtype}; {args.num_prompts} prompts", flush=True)
    results: dict[str, dict] = {}
    if "tp" not in args.skip:
        for name, tp, threads in (("tp1/1t", 1, 1), ("tp1", 1, None), ("tp2", 2, None)):
            results[name] = _bench.run_phase(str(HERE), _offline_args(args, tp, threads))
            print(f"  {name:7s} {results[name]['tokens_per_s']:8.1f} output tok/s  "
                  f"({results[name]['ms_per_step']:.1f} ms/step, {results[name]['steps']} steps)", flush=True)
        same = results["tp2"].pop("token_ids") == results["tp1"].pop("token_ids")
        results["tp1/1t"].pop("token_ids")
        results["tp_same_tokens"] = same
    if "dp" not in args.skip:
        for name, dp in (("dp1", 1), ("dp2", 2)):
            results[name] = served(args, dp)
            print(f"  {name:7s} {results[name]['tokens_per_s']:8.1f} output tok/s  (served, median TTFT "
                  f"{results[name]['ttft_ms_median']:.0f} ms, TPOT {results[name]['tpot_ms_median']:.1f} ms)", flush=True)

    print("\nratios (same run):")
    if "tp2" in results:
        one = results["tp1/1t"]["tokens_per_s"]
        print(f"  tp2 / tp1 = {results['tp2']['tokens_per_s'] / results['tp1']['tokens_per_s']:.2f}x   "
              f"(tp1 / tp1-one-thread = {results['tp1']['tokens_per_s'] / one:.2f}x; "
              f"tp2 efficiency vs 2 x one thread = {results['tp2']['tokens_per_s'] / (2 * one):.0%}); "
              f"greedy tokens identical: {results['tp_same_tokens']}")
    if "dp2" in results:
        print(f"  dp2 / dp1 = {results['dp2']['tokens_per_s'] / results['dp1']['tokens_per_s']:.2f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    if results.get("tp_same_tokens") is False:
        raise SystemExit("tp2 produced other greedy tokens than tp1: the TP figures measure wrong outputs")


if __name__ == "__main__":
    main()
