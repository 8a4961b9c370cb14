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
    dp2/2n  the same two cores on two "nodes": the second a ``paged serve --headless`` process tree
            connecting over 127.0.0.1 with CurveZMQ keys (tcp instead of ipc, encryption)
    dp4, dp4/2n  four cores, on one node or two of two each
  the front-end's own costs (``nodes``): the router's microseconds per request at 2, 8 and 64
  cores, the front-end's CPU microseconds per streamed output token, and from them and dp1 an
  estimate for 8-64 cores, one per machine: min(N x one core's tok/s, the front-end's tok/s).

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


def served(args, dp: int, nodes: int = 1) -> dict:
    """``dp`` engine cores behind one ``paged serve``; with ``nodes`` 2, half of them in a second
    process tree (``paged serve --headless``) connecting over 127.0.0.1 with CurveZMQ keys, as
    another machine's would."""
    import tempfile

    import httpx

    import serve as serve_bench

    port = _free_port()
    common = ["--quiet", "--dtype", args.dtype, "--device", "cpu", "--data-parallel-size", str(dp), "--max-num-seqs",
              str(args.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks)]
    if args.model:
        common += ["--model", args.model]
    if nodes == 2:
        keys = Path(tempfile.mkdtemp(prefix="paged-keys-")) / "keys"
        subprocess.run([sys.executable, "-m", "paged.core.cli", "keys", str(keys)], check=True, capture_output=True)
        common += ["--data-parallel-size-local", str(dp // 2), "--data-parallel-address", "127.0.0.1",
                   "--data-parallel-rpc-port", str(_free_port()), "--data-parallel-keys", str(keys)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGED_")}
    if nodes == 2:  # two "machines" on this one: each core gets its share of the CPU, as one node's cores do
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // dp))
    node1 = None
    if nodes == 2:
        node1 = subprocess.Popen([sys.executable, "-m", "paged.core.cli", "serve", "--headless", *common,
                                  "--data-parallel-start-rank", str(dp // 2)], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
    cmd = [sys.executable, "-m", "paged.core.cli", "serve", "--port", str(port), *common]
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
        if node1 is not None:
            os.killpg(node1.pid, signal.SIGTERM)
            node1.wait(30)
    if summary["failed_requests"]:
        raise RuntimeError(f"dp={dp}: {summary['failed_requests']} requests failed: {summary.get('errors')}")
    return {"tokens_per_s": summary["output_token_throughput"], "elapsed_s": summary["duration_s"],
            "output_tokens": summary["total_output_tokens"], "ttft_ms_median": summary["ttft_ms"]["median"],
            "tpot_ms_median": summary["tpot_ms"]["median"]}


# --- the front-end's own costs, and a scale-out estimate ------------------------------------------
def routing_us(num_cores: int, prompt_len: int = 512, block_size: int = 16, requests: int = 2000) -> float:
    """Microseconds the data-parallel router takes per request (hashing the prompt's blocks with
    the prefix cache's keys, choosing, remembering, and the finish), prompts of random tokens."""
    import random

    from paged.core.frontend.dp_router import DataParallelRouter

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(prompt_len)] for _ in range(requests)]
    router = DataParallelRouter(num_cores, block_size, max_hashes=num_cores * 8192)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        router.route(f"r{i}", prompt)
        if i >= 4 * num_cores:  # a steady state: as many finish as arrive
            router.finish(f"r{i - 4 * num_cores}")
    return 1e6 * (time.perf_counter() - start) / requests


def front_end_us_per_token(batch: int = 16, length: int = 128) -> float:
    """CPU microseconds the front-end spends per streamed output token (AsyncLLM's output handler,
    detokenizer and a stream consumer per request; ``benchmarks/frontend_output.py``)."""
    import frontend_output

    tokenizer = frontend_output.load_tokenizer()
    from paged.core.frontend.outputs import RequestOutputKind

    return min(1e6 * frontend_output.run_async(tokenizer, batch, length, False, RequestOutputKind.DELTA)
               / (batch * length) for _ in range(3))


def scale_out_estimate(one_core_tok_s: float, per_token_us: float, routing: dict[int, float], output_len: int,
                       cores=(8, 16, 32, 64)) -> list[dict]:
    """Served output tok/s for N cores, each on a machine of its own: the cores' capacity (N x one
    core's, measured; they share nothing but the front-end) against the one front-end's, which
    spends ``per_token_us`` of its single thread per output token and the routing per request."""
    rows = []
    for n in cores:
        route = routing.get(n) or max(routing.values())
        front_end = 1e6 / (per_token_us + route / output_len)
        rows.append({"cores": n, "cores_tok_s": n * one_core_tok_s, "front_end_tok_s": front_end,
                     "served_tok_s": min(n * one_core_tok_s, front_end)})
    return rows


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
    parser.add_argument("--skip", nargs="*", default=[], choices=["tp", "dp", "nodes"], help="leave out a part")
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
        for name, dp, nodes in (("dp1", 1, 1), ("dp2", 2, 1), ("dp2/2n", 2, 2), ("dp4", 4, 1), ("dp4/2n", 4, 2)):
            results[name] = served(args, dp, nodes)
            print(f"  {name:7s} {results[name]['tokens_per_s']:8.1f} output tok/s  (served, median TTFT "
                  f"{results[name]['ttft_ms_median']:.0f} ms, TPOT {results[name]['tpot_ms_median']:.1f} ms)", flush=True)
    if "nodes" not in args.skip:
        routing = {n: routing_us(n) for n in (2, 8, 64)}
        per_token = front_end_us_per_token()
        results["routing_us_per_request"] = routing
        results["front_end_us_per_token"] = per_token
        print(f"\nfront-end: routing {', '.join(f'{n} cores {us:.1f} us' for n, us in routing.items())} per request "
              f"(512-token prompts); {per_token:.2f} us per streamed output token", flush=True)
        if "dp1" in results:
            rows = scale_out_estimate(results["dp1"]["tokens_per_s"], per_token, routing, args.serve_output_len)
            results["scale_out_estimate"] = rows
            print("estimated, one core per machine:  cores | cores' tok/s | front-end's tok/s | served")
            for row in rows:
                print(f"  {row['cores']:5d} | {row['cores_tok_s']:12.0f} | {row['front_end_tok_s']:17.0f} | "
                      f"{row['served_tok_s']:.0f}")

    print("\nratios (same run):")
    if "tp2" in results:
        one = results["tp1/1t"]["tokens_per_s"]
        print(f"  tp2 / tp1 = {results['tp2']['tokens_per_s'] / results['tp1']['tokens_per_s']:.2f}x   "
              f"(tp1 / tp1-one-thread = {results['tp1']['tokens_per_s'] / one:.2f}x; "
              f"tp2 efficiency vs 2 x one thread = {results['tp2']['tokens_per_s'] / (2 * one):.0%}); "
              f"greedy tokens identical: {results['tp_same_tokens']}")
    if "dp2" in results:
        one = results["dp1"]["tokens_per_s"]
        print("  " + ", ".join(f"{name} / dp1 = {results[name]['tokens_per_s'] / one:.2f}x"
                               for name in ("dp2", "dp2/2n", "dp4", "dp4/2n") if name in results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    if results.get("tp_same_tokens") is False:
        raise SystemExit("tp2 produced other greedy tokens than tp1: the TP figures measure wrong outputs")


if __name__ == "__main__":
    main()
