"""Where one request's decode step goes: the engine's phases per token, and what a GGUF product
of one row streams from memory as a function of the weight's size.

    python benchmarks/decode_step.py                  # both parts, the default model
    python benchmarks/decode_step.py --only phases --tokens 512
    python benchmarks/decode_step.py --only calls --kind q8_0

``phases``: ``LLM.generate`` of one greedy request (a short prompt, ``--tokens`` new tokens, after
a warm-up request) with the engine's methods timed where they are called (wrapped on the
instances, nothing else changed): the core's step, the runner's ``execute`` and within it the
inputs, the model (the decoder layers: one ``DecoderPlan.run`` a step on CPUs with the C++ layer
ops), the LM head (``compute_logits``) and the sampler; ms per token.

``calls``: the few-rows product (the interleaved layout, one x row) on copies of one weight shape
that together hold ``--megabytes`` MB, each call's weight read from memory (the copies do not fit
in the caches); GB/s of the weight's bytes and us per call, per shape. The default model's
projections are the first three shapes (q/k/v together, o, gate and up together); the last is its
LM head's size.

Measured on the 2-core AMD EPYC (AVX-512 BF16, no AMX), 2026-12-06, quiet, the default model's Q4_1
file, one run: 215.1 tok/s, 4.65 ms a token = the core's step 4.61 (the runner's ``execute`` 4.55:
decoder layers 3.19, LM head 1.00, inputs 0.11, sampler 0.10; schedule and update 0.04). The LM
head's 30 MB of weights stream at ~30 GB/s; the layers' 66 MB at ~27 within their products (README:
the rest of a layer's time is its norms and attention). ``calls``: 960x576 (0.35 MB) 14.7 us a call
= 23.5 GB/s, 576x576 8.7 us = 23.8 GB/s, 3072x576 32.6 us = 33.9 GB/s, 12288x576 38.8 GB/s,
49152x576 41.6 GB/s (another run: 26.5 / 20.8 / 32.2 / 36.2 / 36.4). A decode step's products are
small calls: each pays a parallel region (~1.7 us: 576x576 in cache 8.2 us on one thread, 6.1 on
two; 32x576 2.0 against 2.8) and the stream's start. Prefetching the o-projection's weights before
the attention, in a parallel region of its own, took the o product from 10.0 to 7-7.8 us a layer
and added 6.5 us to the attention (the prefetches wait for the memory as the loads did): no gain;
nor did prefetching the next weight at a barrier, in the README's trial of one parallel region for
a step's products (1.14x from the region alone).
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPT = "Hello there, tell me a story"
SHAPES = [(960, 576), (576, 576), (3072, 576), (12288, 576), (49152, 576)]


def phases(tokens: int) -> None:
    from paged import LLM, SamplingParams

    spent: collections.Counter = collections.Counter()

    def timed(owner, name: str, label: str) -> None:
        method = getattr(owner, name)

        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start

        setattr(owner, name, wrapper)  # on the instance: the class stays as it is

    with LLM() as llm:
        core = llm.engine.core
        runner = core.runner
        timed(core, "step", "core step")
        timed(runner, "execute", "  runner execute")
        timed(runner, "_prepare_inputs", "    inputs")
        timed(runner, "forward_model", "    decoder layers")
        timed(runner.model, "compute_logits", "    LM head")
        timed(runner.sampler, "sample", "    sampler")
        timed(core.scheduler, "schedule", "  schedule")
        timed(core.scheduler, "update_from_output", "  update_from_output")
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        spent.clear()
        start = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    print(f"phases: {tokens / elapsed:.1f} tok/s, {elapsed / tokens * 1e3:.3f} ms a token, of which (ms a token):")
    for label in ("core step", "  runner execute", "    decoder layers", "    LM head", "    inputs", "    sampler",
                  "  schedule", "  update_from_output"):
        print(f"  {label:<24} {spent[label] / tokens * 1e3:7.3f}")


def calls(kind: str, megabytes: int, rounds: int) -> None:
    import torch

    from helpers.gguf_blocks import block_scales, gguf_dequantized, random_blocks
    from paged.plugins import gguf_kernels

    kernels = gguf_kernels.load()
    if kernels is None:
        raise SystemExit("the GGUF kernels are not available here (no AVX-512 BF16, or no compiler)")
    print(f"calls: {kind}, one x row, {torch.get_num_threads()} threads, copies holding {megabytes} MB, "
          f"median of {rounds} passes")
    for n, k in SHAPES:
        blocks = random_blocks(kind, n, k, seed=0)
        weight = torch.from_numpy(gguf_dequantized(blocks, kind, n, k))
        packed, fmt = gguf_kernels.pack(block_scales(blocks, kind, n, k), weight, interleave=True)
        nbytes = packed.numel() * packed.element_size()
        copies = [packed.clone() for _ in range(max(2, megabytes * 2**20 // nbytes))]
        x = torch.randn(1, k).bfloat16()

        def one_pass() -> float:
            start = time.perf_counter()
            for w in copies:
                kernels.gemm(x, w, *fmt, 0, False, False, gguf_kernels.X16_ROWS)
            return time.perf_counter() - start

        one_pass()
        seconds = statistics.median(one_pass() for _ in range(rounds))
        print(f"  {n:>5}x{k:<5} {nbytes / 1e6:7.3f} MB x {len(copies):>4} calls: {seconds / len(copies) * 1e6:7.1f} us "
              f"a call, {len(copies) * nbytes / seconds / 1e9:5.1f} GB/s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["phases", "calls"])
    parser.add_argument("--tokens", type=int, default=256, help="phases: new tokens of the timed request")
    parser.add_argument("--kind", default="q4_1", help="calls: the GGUF type")
    parser.add_argument("--megabytes", type=int, default=64, help="calls: what the copies of a shape hold")
    parser.add_argument("--rounds", type=int, default=7, help="calls: passes over the copies")
    args = parser.parse_args(argv)
    if args.only in (None, "phases"):
        phases(args.tokens)
    if args.only in (None, "calls"):
        calls(args.kind, args.megabytes, args.rounds)


if __name__ == "__main__":
    main()
