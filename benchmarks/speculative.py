"""Speculative decoding (``ngram``, ``suffix``) against plain decoding, side by side in one run.

Workloads on the default model (its GGUF, paged's defaults otherwise; raw text prompts, greedy):

(a) input-copying: a 300-line Python file to repeat with one name changed, a document to
    summarise with quotes, a JSON object to rewrite;
(b) free text: a story, an explanation, an essay.

Batch 1: each prompt's decode tok/s (new tokens after the first / the time after the first
token) for paged without speculation, with ``ngram``, with ``suffix`` matching the request's own
tokens only (``suffix_decoding_max_cached_requests=0``) and with ``suffix`` as it comes (its cache
of earlier outputs: the rounds repeat the prompts, so from round 2 on it has seen each answer
once, as a repeated task would), and llama.cpp's own C++ tools on the
same GGUF when they are found (``llama-lookup``, built by ``../shared/tools/build-llamacpp.sh``
with that target: ``llama-plain`` is it with ``--spec-draft-n-max 0``, plain decoding;
``llama-lookup`` its n-gram lookup decoding with drafts of up to k), alternated prompt by prompt for ``--rounds``
rounds; medians. Acceptance rate and mean accepted length (1 + accepted drafts per verified
step) per workload. Batches (``--batches``, default 4,16,64): the prompts cycled to B requests,
all at once, total time with and without speculation, alternated.

    python benchmarks/speculative.py                  # ~10 min on 2 cores; run it alone
    python benchmarks/speculative.py --quick          # a smoke test
    python benchmarks/speculative.py --k 3 --batches 16 --rounds 5
    python benchmarks/speculative.py --methods ngram  # only ngram beside plain
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
LLAMACPP = Path(os.environ.get("PAGED_LLAMACPP_DIR", Path.home() / ".cache" / "paged-peers" / "llama.cpp" / "bin"))


def python_file(lines: int = 300) -> str:
    out, i = [], 0
    while len(out) < lines:
        out += [f"def compute_total_{i}(values, scale={i % 5 + 1}):",
                f'    """Sum of the values times {i % 5 + 1}, plus {i}."""',
                "    total = 0",
                "    for value in values:",
                "        total += value * scale",
                f"    return total + {i}", ""]
        i += 1
    return "\n".join(out[:lines])


DOCUMENT = " ".join(
    f"In {1900 + 7 * i}, the town council of Millbrook voted {i + 3} to {i % 4} to build a new {thing}, "
    f"which the mayor called \"a promise kept to the people of Millbrook\"."
    for i, thing in enumerate(["bridge", "library", "school", "hospital", "market", "railway station", "park",
                               "theatre", "museum", "harbour", "town hall", "water tower"]))

RECORD = json.dumps({f"field_{i}": {"name": f"item {i}", "count": i * 3, "tags": ["a", "b", str(i)]} for i in range(16)},
                    indent=2)

WORKLOADS = {
    "copy": {
        "edit file": f"Here is a file:\n```python\n{python_file()}\n```\nThe same file with compute_total renamed "
                     "to sum_values:\n```python\n",
        "summarise with quotes": f"{DOCUMENT}\n\nA summary of the text above, quoting it:\n\"In 1900,",
        "rewrite JSON": f"{RECORD}\n\nThe same JSON with every count doubled:\n{{\n  \"field_0\": {{",
    },
    "free": {
        "story": "Write a story about a dragon who learns to bake bread.\n\nOnce upon a time,",
        "explanation": "Explain how a bicycle works, part by part.\n\nA bicycle",
        "essay": "An essay on why people enjoy gardening.\n\nGardening",
    },
}


def decode_tok_s(output) -> float:
    c = output.outputs[0]
    n = len(c.token_ids)
    after_first = c.metrics.finished_time - c.metrics.first_token_time
    return (n - 1) / after_first if after_first > 0 else float("nan")


def llamacpp_decode(gguf: str, prompt: str, tokens: int, threads: int, k: int) -> tuple[float, float | None]:
    """llama.cpp's ``llama-lookup`` (n-gram lookup drafts of up to ``k`` tokens; ``k = 0``: plain
    decoding): (decode tok/s after the prompt, acceptance rate or None), from its own report."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMACPP))
    args = [str(LLAMACPP / "llama-lookup"), "-m", gguf, "-f", f.name, "-n", str(tokens), "-t", str(threads),
            "--temp", "0", "--spec-draft-n-max", str(k), "-c", "8192", "-b", "8192"]
    run = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    os.unlink(f.name)
    text = run.stdout + run.stderr
    speed = re.findall(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", text)
    if run.returncode != 0 or not speed:
        raise RuntimeError(f"llama-lookup failed ({run.returncode}): {text[-1500:]}")
    accept = re.findall(r"accept\s+=\s+([\d.]+)%", text)
    return float(speed[-1]), float(accept[-1]) / 100 if accept and k else None


def print_batch1(args, modes: list[str], methods: list[str], speeds: dict, accept: dict, llama_accept: dict) -> None:
    print(f"\nbatch 1, decode tok/s (median of {args.rounds} alternated rounds), {args.max_tokens} new tokens, "
          f"k = {args.k}, {args.threads} threads; ratios > 1: speculation faster")
    tools = [m for m in modes if m.startswith("llama")]
    print(f"{'prompt':<24}" + "".join(f"{m:>14}" for m in modes) + "".join(f"{m + '/plain':>18}" for m in methods)
          + (f"{'ngram/llama':>13}{'ngram/lookup':>14}" if tools else ""))
    for workload, prompts in WORKLOADS.items():
        for name in prompts:
            med = {m: statistics.median(speeds[(name, m)]) for m in modes}
            row = f"{name:<24}" + "".join(f"{med[m]:>14.1f}" for m in modes)
            row += "".join(f"{med[m] / med['plain']:>17.2f}x" for m in methods)
            if tools and "ngram" in med:
                row += f"{med['ngram'] / med['llama-plain']:>12.2f}x{med['ngram'] / med['llama-lookup']:>13.2f}x"
            print(row)
        for method in methods:
            d = accept.get((workload, method), [])
            drafts, drafted, accepted = (sum(x[i] for x in d) for i in range(3))
            print(f"  {workload}, {method}: acceptance {accepted / max(drafted, 1):.1%}, mean accepted length "
                  f"{1 + accepted / max(drafts, 1):.2f}")
        if llama_accept.get(workload):
            print(f"  {workload}, llama-lookup acceptance {statistics.mean(llama_accept[workload]):.1%}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (and llama-lookup's draft size)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="2,4,8,16,64")
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--only-batches", action="store_true", help="skip the batch-1 table")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--methods", default="ngram,suffix-own,suffix",
                        help="beside plain: ngram, suffix-own (suffix without its cache of outputs), suffix")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.rounds, args.batches, args.batch_tokens = 24, 1, "4", 16

    import torch

    from paged import LLM, SamplingParams
    from paged.core.loading.gguf import default_gguf_path

    torch.set_num_threads(args.threads)
    specs = {"ngram": {"method": "ngram"}, "suffix": {"method": "suffix"},
             "suffix-own": {"method": "suffix", "suffix_decoding_max_cached_requests": 0}}
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in specs]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {sorted(specs)}")
    engines = {"plain": LLM()}
    for method in methods:
        engines[method] = LLM(speculative_config={**specs[method], "num_speculative_tokens": args.k})
    gguf = str(default_gguf_path())
    tools = [] if args.no_llamacpp or not (LLAMACPP / "llama-lookup").is_file() else ["llama-plain", "llama-lookup"]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up: kernels, scratch buffers
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)

    speeds: dict[tuple[str, str], list[float]] = {}
    accept: dict[str, list[tuple[int, int, int]]] = {}
    llama_accept: dict[str, list[float]] = {}
    for _ in range(0 if args.only_batches else args.rounds):
        for workload, prompts in WORKLOADS.items():
            for name, prompt in prompts.items():
                for mode, llm in engines.items():
                    core = llm.engine.core
                    before = (core.speculator.stats.num_drafts, core.speculator.stats.num_draft_tokens,
                              core.speculator.stats.num_accepted_tokens) if core.speculator else None
                    (out,) = llm.generate([prompt], params, use_tqdm=False)
                    speeds.setdefault((name, mode), []).append(decode_tok_s(out))
                    if before is not None:
                        s = core.speculator.stats
                        accept.setdefault((workload, mode), []).append(
                            (s.num_drafts - before[0], s.num_draft_tokens - before[1], s.num_accepted_tokens - before[2]))
                for tool in tools:
                    tok_s, rate = llamacpp_decode(gguf, prompt, args.max_tokens, args.threads,
                                                  args.k if tool == "llama-lookup" else 0)
                    speeds.setdefault((name, tool), []).append(tok_s)
                    if rate is not None:
                        llama_accept.setdefault(workload, []).append(rate)

    if not args.only_batches:
        print_batch1(args, list(engines) + tools, methods, speeds, accept, llama_accept)

    all_prompts = [p for prompts in WORKLOADS.values() for p in prompts.values()]
    batch_params = SamplingParams(temperature=0, max_tokens=args.batch_tokens, ignore_eos=True)
    print(f"\nbatches: the 6 prompts cycled to B requests, {args.batch_tokens} new tokens each, all at once; "
          f"total s (median of {args.rounds}); speculation off in steps of more than speculative.disable_by_batch_size "
          f"({engines['plain'].config.speculative.disable_by_batch_size}) decoding requests")
    print(f"{'B':>4}" + "".join(f"{m:>12}" for m in engines) + "".join(f"{'plain/' + m:>18}" for m in methods))
    for b in [int(x) for x in args.batches.split(",") if x]:
        prompts = [all_prompts[i % len(all_prompts)] for i in range(b)]
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for mode, llm in engines.items():
                t = time.perf_counter()
                llm.generate(prompts, batch_params, use_tqdm=False)
                times.setdefault(mode, []).append(time.perf_counter() - t)
        med = {m: statistics.median(v) for m, v in times.items()}
        print(f"{b:>4}" + "".join(f"{med[m]:>12.2f}" for m in engines)
              + "".join(f"{med['plain'] / med[m]:>17.2f}x" for m in methods))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
