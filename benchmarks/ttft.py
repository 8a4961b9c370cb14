"""Time to first token for a long prompt with ``LLM()``'s defaults (prefix caching off).

Uses only the public API (``LLM``, ``SamplingParams``, ``enable_prefix_caching``), so the same
file runs against an older checkout's install, for a before/after ratio in one session:

    python benchmarks/ttft.py [--prompt-tokens 1000] [--repeats 5]
    /path/to/old-checkout/.venv/bin/python benchmarks/ttft.py     # alternate the two

Prints one JSON line: the installed package's path, best and median TTFT over ``--repeats``
fresh random prompts (after a short warm-up).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import paged
    from paged import LLM, SamplingParams

    llm = LLM(enable_prefix_caching=False)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([[rng.randrange(100, 40000) for _ in range(64)]], params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(args.repeats):
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    print(json.dumps({"package": paged.__file__, "prompt_tokens": args.prompt_tokens,
                      "ttft_best_s": min(times), "ttft_median_s": statistics.median(times)}))


if __name__ == "__main__":
    main()
