"""Structured outputs: throughput with 0%, 50% and 100% of the requests constrained by a JSON
schema (16 concurrent by default), and schema compile time, per grammar backend.

Every request generates exactly --max-tokens tokens: the unconstrained ones ignore EOS, and the
schema (an array of at least 1000 people) cannot end sooner, so the constrained ones finish
with "length" too; the fractions differ only in the masking work. The schema is compiled before
the timed runs (the compile cost is measured on its own, on a set of varied schemas, cold: each
schema once, with a fresh backend). The fractions are run alternately, --repeats times each; the
median is reported, with the ratio to 0%.

    python benchmarks/structured_output.py                # default model, both backends
    python benchmarks/structured_output.py --quick        # a smoke run (seconds of work)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _bench  # noqa: E402

PEOPLE = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
                    "role": {"enum": ["admin", "user", "guest"]},
                },
                "required": ["name", "age", "email", "role"],
            },
        }
    },
    "required": ["people"],
}


def compile_schemas(n: int) -> list[dict]:
    """Varied schemas (different keys, nesting, bounds, patterns, enums) for the compile timing."""
    out = []
    for i in range(n):
        props = {
            f"id_{i}": {"type": "integer", "minimum": i, "maximum": 1000 + i},
            f"name_{i}": {"type": "string", "minLength": 1, "maxLength": 8 + i % 20},
            f"tags_{i}": {"type": "array", "items": {"type": "string", "pattern": f"^[a-z]{{{1 + i % 5}}}$"}, "maxItems": 4},
            f"kind_{i}": {"enum": [f"k{j}" for j in range(2 + i % 6)]},
            f"nested_{i}": {"type": "object", "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}},
                            "required": ["x"]},
        }
        out.append({"type": "object", "properties": props, "required": sorted(props)[: 2 + i % 4]})
    return out


def measure_compile(backend: str, model_dir: str, num_schemas: int) -> dict:
    from paged.core.loading.model_config import eos_token_ids
    from paged.core.loading.loader import load_hf_config, load_tokenizer
    from paged.core.registry import get_registry
    from paged.core.structured_output import StructuredOutputParams

    spec = get_registry().structured_output_backend(backend)
    tokenizer = load_tokenizer(model_dir)
    hf_config = load_hf_config(model_dir)
    start = time.perf_counter()
    instance = spec.factory(tokenizer, int(hf_config.vocab_size), eos_token_ids(model_dir, hf_config), None)
    setup_s = time.perf_counter() - start
    times = []
    for schema in [PEOPLE, *compile_schemas(num_schemas)]:
        start = time.perf_counter()
        instance.matcher(instance.compile(StructuredOutputParams(json_schema=schema)))
        times.append(time.perf_counter() - start)
    return {"backend_setup_s": setup_s, "first_compile_s": times[0], "compile_median_s": statistics.median(times[1:]),
            "compile_max_s": max(times[1:])}


def measure_throughput(backend: str, args) -> dict:
    from paged.core.frontend.llm import LLM
    from paged.core.sampling_params import SamplingParams

    llm = LLM(args.model, structured_output={"backend": backend}, max_num_seqs=args.concurrency,
              max_model_len=args.prompt_len + args.max_tokens + 16, dtype=args.dtype)
    try:
        prompts, _ = _bench.random_workload(args.num_prompts, args.seed, (args.prompt_len, args.prompt_len), (1, 1))
        plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                     structured_output={"json_schema": PEOPLE})
        llm.generate(prompts[:2], [plain, constrained], use_tqdm=False)  # warm-up, and the schema compiled
        runs: dict[float, list[float]] = {f: [] for f in args.fractions}
        for _ in range(args.repeats):
            for fraction in args.fractions:  # alternating, so load drifts hit every fraction alike
                k = round(fraction * len(prompts))
                params = [constrained] * k + [plain] * (len(prompts) - k)
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                assert tokens == len(prompts) * args.max_tokens, "every request must generate max_tokens"
                runs[fraction].append(tokens / elapsed)
        base = statistics.median(runs[args.fractions[0]])
        return {f"{int(f * 100)}%": {"tok_s": statistics.median(v), "vs_first": statistics.median(v) / base}
                for f, v in runs.items()}
    finally:
        llm.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.0, 0.5, 1.0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-schemas", type=int, default=20)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.concurrency, args.max_tokens, args.repeats, args.num_schemas = 4, 4, 8, 1, 3
    from paged.core.loading.loader import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    result = {"settings": {k: v for k, v in vars(args).items()}, "backends": {}}
    for backend in args.backends:
        result["backends"][backend] = {"compile": measure_compile(backend, model_dir, args.num_schemas),
                                       "throughput": measure_throughput(backend, args)}
    print(json.dumps(result, indent=2))
    print("\nbackend      setup   1st compile  compile p50/max    " + "  ".join(f"{int(f * 100):>3}% tok/s" for f in args.fractions))
    for backend, r in result["backends"].items():
        c, t = r["compile"], r["throughput"]
        cells = "  ".join(f"{t[f'{int(f * 100)}%']['tok_s']:>6.1f} ({t[f'{int(f * 100)}%']['vs_first']:.2f})" for f in args.fractions)
        print(f"{backend:<11} {c['backend_setup_s']:>5.2f}s  {c['first_compile_s']:>9.3f}s  "
              f"{c['compile_median_s'] * 1e3:>6.1f}/{c['compile_max_s'] * 1e3:<7.1f}ms  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
