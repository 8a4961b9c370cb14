"""Serving benchmark: load-test a running OpenAI-compatible server (``paged serve``) through
``/v1/completions`` with streamed responses.

Workload (seeded): ``--num-prompts`` prompts of random token ids (so tokenization plays no
part), prompt lengths uniform in ``input_len * [1 - range_ratio, 1 + range_ratio]``, and as many
output tokens (``max_tokens`` with ``ignore_eos``, greedy). Requests are sent at a Poisson rate
(``--request-rate`` per second; ``inf`` = all at once) and/or with at most ``--max-concurrency``
in flight.

Per request, measured at the client: TTFT (send -> first token), inter-token latencies (gaps
between streamed chunks), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency.
Goodput = requests per second that meet every SLO given (``--slo-ttft-ms``, ``--slo-tpot-ms``).

``--endpoint /v1/embeddings`` (a ``paged serve --runner pooling`` server) sends the same prompts
as embedding requests instead, ``--batch-size`` inputs each (not streamed: a request's latency
is its TTFT; no output tokens).

    paged serve --port 8000 &
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 8 \\
        --input-len 64 --output-len 64 [--slo-ttft-ms 2000 --slo-tpot-ms 200] [--json]
    paged bench serve --num-prompts 64 ...      # the same
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def make_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                  vocab: tuple[int, int] = (1000, 20000)) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        lo = max(1, int(mean * (1 - range_ratio)))
        hi = max(lo, int(mean * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, num_prompts)

    ins, outs = lengths(input_len), lengths(output_len)
    return [(rng.integers(vocab[0], vocab[1], n).tolist(), int(m)) for n, m in zip(ins, outs)]


async def send_one(client, url: str, model: str, prompt: list[int], max_tokens: int, headers: dict) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = Result(prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = obj["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if obj.get("usage"):
                    result.output_tokens = obj["usage"]["completion_tokens"]
                choices = obj.get("choices") or []
                if not any(c.get("text") for c in choices):
                    continue
                chunks += 1
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        result.error = f"{type(e).__name__}: {e}"
    return result


async def send_embeddings(client, url: str, model: str, prompts: list[list[int]], headers: dict) -> Result:
    body = {"model": model, "input": prompts, "encoding_format": "base64"}
    result = Result(prompt_tokens=sum(len(p) for p in prompts))
    start = time.perf_counter()
    try:
        response = await client.post(url, json=body, headers=headers)
        result.latency = result.ttft = time.perf_counter() - start
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:200]}"
            return result
        data = response.json()["data"]
        result.ok = len(data) == len(prompts)
        if not result.ok:
            result.error = f"{len(data)} embeddings for {len(prompts)} inputs"
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        result.error = f"{type(e).__name__}: {e}"
    return result


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


async def run(args: argparse.Namespace) -> dict:
    import httpx

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get(f"{base}/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        url = f"{base}{args.endpoint}"
        workload = make_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
        embed = args.endpoint == "/v1/embeddings"
        if embed:  # batch_size prompts per request
            prompts = [p for p, _ in workload]
            workload = [(prompts[i:i + args.batch_size], 0) for i in range(0, len(prompts), args.batch_size)]

        def send(prompt, n):
            if embed:
                return send_embeddings(client, url, model, prompt, headers)
            return send_one(client, url, model, prompt, n, headers)

        for prompt, n in workload[: args.warmup]:
            await send([prompt[0][:8]] if embed else prompt[:8], 2)

        rng = np.random.default_rng(args.seed + 1)
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(prompt, n):
            if semaphore is None:
                return await send(prompt, n)
            async with semaphore:
                return await send(prompt, n)

        start = time.perf_counter()
        tasks = []
        for prompt, n in workload:
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        results: list[Result] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    summary = {
        "model": model,
        "endpoint": args.endpoint,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "successful_requests": len(ok),
        "failed_requests": len(failed),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
    }
    if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        def good(r: Result) -> bool:
            if args.slo_ttft_ms is not None and r.ttft * 1000 > args.slo_ttft_ms:
                return False
            if args.slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1000 > args.slo_tpot_ms:
                return False
            return True

        n_good = sum(1 for r in ok if good(r))
        summary["slo"] = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
        summary["good_requests"] = n_good
        summary["goodput"] = n_good / duration
    if failed:
        summary["errors"] = sorted({r.error for r in failed})[:5]
    return summary


def print_summary(s: dict) -> None:
    def line(label: str, value) -> None:
        if isinstance(value, float):
            value = f"{value:.2f}"
        print(f"{label:<40}{value:>14}")

    print("=" * 18 + " Serving Benchmark Result " + "=" * 18)
    line("Successful requests:", s["successful_requests"])
    line("Failed requests:", s["failed_requests"])
    line("Maximum request concurrency:", s["max_concurrency"] or "-")
    line("Request rate (req/s):", s["request_rate"])
    line("Benchmark duration (s):", s["duration_s"])
    line("Total input tokens:", s["total_input_tokens"])
    line("Total generated tokens:", s["total_output_tokens"])
    line("Request throughput (req/s):", s["request_throughput"])
    line("Output token throughput (tok/s):", s["output_token_throughput"])
    line("Total token throughput (tok/s):", s["total_token_throughput"])
    if "goodput" in s:
        line("Request goodput (req/s):", s["goodput"])
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        print(f"{'-' * 16}{title:^30}{'-' * 16}")
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p99"):
            v = s[key][stat]
            line(f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms):", "-" if v is None else v)
    print("=" * 62)
    for error in s.get("errors", []):
        print(f"error: {error}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name (default: the server's first /v1/models entry)")
    p.add_argument("--endpoint", choices=["/v1/completions", "/v1/embeddings"], default="/v1/completions",
                   help="/v1/embeddings: embedding requests to a --runner pooling server")
    p.add_argument("--batch-size", type=int, default=1, help="with /v1/embeddings: inputs per request")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="tiny requests sent first, not measured")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--json-out", default=None, help="also write the JSON results to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    import logging

    args = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    summary = asyncio.run(run(args))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0 if summary["successful_requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
