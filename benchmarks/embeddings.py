"""Embedding throughput: paged's pooling runner against HF transformers on the same inputs.

The same seeded prompts, new ones each round (random token ids, lengths uniform in --min-len..--max-len) are embedded
(last-token pooling, normalised) by

- ``paged offline``: ``LLM(runner="pooling").embed`` with the defaults (what runs without flags);
- ``paged served``: ``paged serve --runner pooling`` driven by ``paged bench serve --endpoint
  /v1/embeddings`` (--concurrency requests of --batch-size inputs in flight), with --serve;
- ``HF float32`` and ``HF bfloat16``: ``AutoModel`` on the same weights in padded batches of
  --hf-batch-size (right padding, the last real token's hidden state), the way a
  sentence-transformers pipeline runs it.

Rounds alternate between the engines (a slow spell of the machine falls on all of them); the
table shows median prompt tokens per second and the ratio to HF float32, and the cosine
between paged's and HF float32's vectors (the check that both computed the same thing).

    python benchmarks/embeddings.py [--model DIR] [--num-prompts 256] [--rounds 3] [--serve]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/serve.py, for --serve


def workload(args, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_prompts)
    return [rng.integers(1000, 20000, n).tolist() for n in lengths]


class HFEmbedder:
    def __init__(self, model_dir: str, dtype: str, batch_size: int) -> None:
        import torch
        from transformers import AutoModel

        self.torch = torch
        self.model = AutoModel.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.batch_size = batch_size

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        torch = self.torch
        out = []
        with torch.inference_mode():
            for i in range(0, len(prompts), self.batch_size):
                batch = prompts[i:i + self.batch_size]
                width = max(len(p) for p in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for j, p in enumerate(batch):
                    ids[j, :len(p)] = torch.tensor(p)
                    mask[j, :len(p)] = 1
                hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
                last = hidden[torch.arange(len(batch)), mask.sum(1) - 1].float()
                out.append(torch.nn.functional.normalize(last, dim=-1).numpy())
        return np.concatenate(out)


class PagedEmbedder:
    def __init__(self, model_dir: str) -> None:
        from paged import LLM

        self.llm = LLM(model_dir, runner="pooling")  # the defaults: what runs without flags

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        return np.stack([o.outputs.data for o in self.llm.embed(prompts, use_tqdm=False)])


def served(args, prompts: list[list[int]], model_dir: str) -> dict:
    """Start ``paged serve --runner pooling``, then ``benchmarks/serve.py --endpoint /v1/embeddings``
    over the same prompt lengths (its own seeded token ids)."""
    import asyncio
    import tempfile

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from helpers.server import free_port, serve  # the tests' launcher: start, wait for /health, SIGTERM

    import serve as bench_serve  # benchmarks/serve.py

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, \
            serve(["--model", model_dir, "--runner", "pooling", "--port", str(port), "-q"], Path(tmp), port) as server:
        results = []
        for k in range(args.rounds):
            ns = bench_serve.build_parser().parse_args([
                "--base-url", server.url, "--endpoint", "/v1/embeddings", "--num-prompts", str(len(prompts)),
                "--batch-size", str(args.batch_size), "--max-concurrency", str(args.concurrency),
                "--input-len", str((args.min_len + args.max_len) // 2),
                "--range-ratio", str((args.max_len - args.min_len) / (args.min_len + args.max_len)),
                "--seed", str(args.seed + 1 + k)])  # new ids each round: no prefix-cache hit
            results.append(asyncio.run(bench_serve.run(ns)))
    return {"tok_s": float(np.median([r["total_input_tokens"] / r["duration_s"] for r in results])),
            "failed": sum(r["failed_requests"] for r in results)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M, converted)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve", action="store_true", help="also the served figure (paged serve + bench serve)")
    p.add_argument("--batch-size", type=int, default=8, help="--serve: inputs per /v1/embeddings request")
    p.add_argument("--concurrency", type=int, default=4, help="--serve: requests in flight")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from paged.core.loading.gguf import default_model_dir

    model_dir = args.model or str(default_model_dir())
    # each round its own prompts (same lengths' distribution): paged's prefix cache would otherwise
    # hold a repeated prompt, and a last-token pooler would compute one token of it
    prompts = workload(args, args.seed)
    rounds = [workload(args, args.seed + 1 + k) for k in range(args.rounds)]
    tokens = sum(len(q) for q in prompts)
    engines = {"paged offline": PagedEmbedder(model_dir),
               "HF float32": HFEmbedder(model_dir, "float32", args.hf_batch_size),
               "HF bfloat16": HFEmbedder(model_dir, "bfloat16", args.hf_batch_size)}
    vectors = {}
    for name, engine in engines.items():  # warm-up, and the vectors compared
        vectors[name] = engine.embed(prompts)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for batch in rounds:
        batch_tokens = sum(len(q) for q in batch)
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.embed(batch)
            runs[name].append(batch_tokens / (time.perf_counter() - start))
    result = {name: {"tok_s": float(np.median(r)), "runs": r} for name, r in runs.items()}
    for name in engines:
        result[name]["cosine_to_hf_float32"] = float(np.mean(np.sum(vectors[name] * vectors["HF float32"], axis=1)))
    del engines
    if args.serve:
        result["paged served"] = served(args, prompts, model_dir)
    base = result["HF float32"]["tok_s"]
    meta = {"num_prompts": args.num_prompts, "tokens": tokens, "lengths": [args.min_len, args.max_len],
            "hf_batch_size": args.hf_batch_size, "rounds": args.rounds}
    if args.json:
        print(json.dumps({"meta": meta, "results": result}, indent=2))
        return 0
    print(f"{args.num_prompts} prompts, {tokens} tokens (lengths {args.min_len}-{args.max_len}), "
          f"medians of {args.rounds} alternated rounds")
    print(f"{'engine':<16}{'tok/s':>10}{'vs HF fp32':>12}{'cosine':>10}")
    for name, r in result.items():
        cos = r.get("cosine_to_hf_float32")
        print(f"{name:<16}{r['tok_s']:>10.0f}{r['tok_s'] / base:>11.2f}x{'' if cos is None else f'{cos:>10.4f}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
