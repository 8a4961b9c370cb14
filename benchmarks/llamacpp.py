"""paged against llama.cpp on the same GGUF, side by side in one run.

llama.cpp's own C++ tools (not the Python binding, whose per-token overhead hides its speed)
are found through ``--llamacpp-dir``, ``$PAGED_LLAMACPP_DIR`` or
``~/.cache/paged-peers/llama.cpp/bin`` (built by ``../shared/tools/build-llamacpp.sh``; its
shared libraries are found through ``LD_LIBRARY_PATH``, set here to the same folder):

1. one request: ``llama-bench -t T -p P -n N`` (pp P and tg N tok/s) against paged's prefill
   (P-token prompt, time to first token) and decode (N new tokens, first excluded) tok/s. The
   decode starts where llama-bench's tg does, on an empty cache (a 1-token prompt), not after the
   P-token prompt: ``--decode-depth D`` decodes after D tokens on both sides (llama-bench ``-d D``);
2. batched: ``llama-batched-bench -npp 128 -ntg 64 -npl 1,4,16,64`` (B requests of 128 random
   prompt tokens + 64 new tokens, all at once; total time) against paged on the same workload.

Each paged variant (``--variants DTYPE:QUANTIZATION[:KEY=VALUE+...],...``, e.g.
``bfloat16:gguf:int8_panels=true``; a list value's items separated by ``/``, e.g.
``bfloat16:gguf:interleave_types=q4_0/q4_1/q8_0``) runs in its own process. Ratios > 1
mean paged is faster. Run on a quiet machine; ``--quick`` is a smoke test at tiny sizes.

    python benchmarks/llamacpp.py                     # the issue's tables (~10 min on 2 cores)
    python benchmarks/llamacpp.py --quick
    python benchmarks/llamacpp.py --variants bfloat16:none,bfloat16:auto,bfloat16:int4 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _bench  # noqa: E402

HERE = Path(__file__).resolve()
DEFAULT_DIR = Path.home() / ".cache" / "paged-peers" / "llama.cpp" / "bin"


def find_tools(setting: str | None) -> Path | None:
    for candidate in (setting, os.environ.get("PAGED_LLAMACPP_DIR"), str(DEFAULT_DIR)):
        if candidate and (Path(candidate) / "llama-bench").is_file() and (Path(candidate) / "llama-batched-bench").is_file():
            return Path(candidate)
    return None


def _run_tool(tools: Path, name: str, args: list[str]) -> list[dict]:
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tools}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    proc = subprocess.run([str(tools / name), *args], capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def llamacpp_single(tools: Path, gguf: str, args) -> dict:
    common = ["-m", gguf, "-t", str(args.threads), "-r", str(args.repeats), "-o", "jsonl"]
    if args.decode_depth == 0:
        rows = _run_tool(tools, "llama-bench", [*common, "-p", str(args.prompt_tokens), "-n", str(args.new_tokens)])
    else:  # -d applies to pp and tg alike: the prompt's test stays at depth 0
        rows = (_run_tool(tools, "llama-bench", [*common, "-p", str(args.prompt_tokens), "-n", "0"])
                + _run_tool(tools, "llama-bench", [*common, "-p", "0", "-n", str(args.new_tokens),
                                                   "-d", str(args.decode_depth)]))
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    return {"prefill_tok_s": pp, "decode_tok_s": tg}


def llamacpp_batched(tools: Path, gguf: str, args) -> dict[int, float]:
    rows = _run_tool(tools, "llama-batched-bench", [
        "-m", gguf, "-t", str(args.threads), "-c", "16384", "-b", "2048", "-ub", "512", "-npp", str(args.batch_prompt),
        "-ntg", str(args.batch_new), "-npl", ",".join(map(str, args.batches)), "--output-format", "jsonl"])
    return {int(r["pl"]): float(r["t"]) for r in rows}


# --- paged phases (own process each) ---------------------------------------------------------
def parse_variant(variant: str) -> tuple[str, str, dict[str, str]]:
    """``DTYPE:QUANTIZATION[:KEY=VALUE+KEY=VALUE...]`` (options of the quantization method; in a
    value, ``/`` stands for the comma that separates variants: a list's items; so no value can hold
    a ``/`` of its own, which none of the bundled methods' options needs)."""
    dtype, quantization, *rest = variant.split(":", 2)
    options = {k: v.replace("/", ",") for k, v in (kv.split("=", 1) for kv in rest[0].split("+"))} if rest else {}
    return dtype, quantization, options


def phase_paged(args) -> dict:
    import numpy as np
    import torch

    from paged import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    dtype, quantization, options = parse_variant(args.variant)
    llm = LLM(args.gguf, device="cpu", dtype=dtype, quantization=quantization, attention=args.attention,
              quantization_options=options, max_num_seqs=max(args.batches), enable_prefix_caching=False,
              max_num_batched_tokens=2048)
    rng = np.random.default_rng(0)
    warm = rng.integers(1000, 20000, 16).tolist()
    llm.generate([warm] * 2, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prefill, decode = [], []
    prompt = rng.integers(1000, 20000, args.prompt_tokens).tolist()
    # llama-bench's tg decodes from an empty cache (or after -d tokens): the same depth here. Its
    # own generator, so that the batches' ids stay those peers.py gives the other engines.
    decode_prompt = (prompt if args.decode_depth == args.prompt_tokens
                     else np.random.default_rng(1).integers(1000, 20000, max(1, args.decode_depth)).tolist())
    for _ in range(args.repeats):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        prefill.append(args.prompt_tokens / out.metrics.time_to_first_token)
        out = llm.generate([decode_prompt], SamplingParams(temperature=0, max_tokens=args.new_tokens,
                                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
        decode.append((len(out.token_ids) - 1) / out.metrics.decode_time)
    batched = {}
    for b in args.batches:
        prompts = [rng.integers(1000, 20000, args.batch_prompt).tolist() for _ in range(b)]
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.batch_new, ignore_eos=True), use_tqdm=False)
        batched[b] = time.perf_counter() - start
    return {"prefill_tok_s": max(prefill), "decode_tok_s": max(decode), "batched_s": batched,
            "weight_mib": llm.engine.core.runner.weight_bytes / 2**20}


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's flags (shared with ``benchmarks/peers.py``, which runs the same one)."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-prompt", type=int, default=128)
    parser.add_argument("--batch-new", type=int, default=64)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")


def quick_sizes(args) -> None:
    """``--quick``: the workload at tiny sizes."""
    if args.quick:
        args.prompt_tokens, args.new_tokens, args.repeats = 16, 8, 1
        args.batch_prompt, args.batch_new, args.batches = 16, 8, [1, 2]


def workload_argv(args) -> list[str]:
    """The workload's flags as a phase's command line."""
    return ["--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens), "--new-tokens",
            str(args.new_tokens), "--repeats", str(args.repeats), "--batch-prompt", str(args.batch_prompt),
            "--batch-new", str(args.batch_new), "--batches", ",".join(map(str, args.batches))]


def _phase_args(args, variant: str) -> list[str]:
    return ["--phase", "--variant", variant, "--gguf", args.gguf, *workload_argv(args), "--attention", args.attention,
            "--decode-depth", str(args.decode_depth)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp-dir", default=None, help="folder with llama-bench and llama-batched-bench")
    parser.add_argument("--gguf", default=None, help="default: the embedded SmolLM2-135M-Instruct Q4_1")
    parser.add_argument("--variants", default="bfloat16:none,bfloat16:auto",
                        help="paged DTYPE:QUANTIZATION[:KEY=VALUE+...] list (options of the quantization method)")
    add_workload_args(parser)
    parser.add_argument("--decode-depth", type=int, default=0,
                        help="tokens in the cache before the timed decode, on both sides (llama-bench -d)")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick_sizes(args)
    if args.gguf is None:
        from paged.core.loading.gguf import default_gguf_path

        args.gguf = str(default_gguf_path())
    if args.phase:
        print(json.dumps(phase_paged(args)))
        return

    tools = find_tools(args.llamacpp_dir)
    if tools is None:
        sys.exit("llama.cpp tools not found: pass --llamacpp-dir or set PAGED_LLAMACPP_DIR to the folder holding "
                 f"llama-bench and llama-batched-bench (default {DEFAULT_DIR}; ../shared/tools/build-llamacpp.sh builds them)")
    print(f"GGUF {args.gguf}; llama.cpp tools {tools}; {args.threads} threads", flush=True)
    ref_single = llamacpp_single(tools, args.gguf, args)
    ref_batched = llamacpp_batched(tools, args.gguf, args)
    depth = f" at depth {args.decode_depth}" if args.decode_depth else ""
    print(f"llama.cpp: pp{args.prompt_tokens} {ref_single['prefill_tok_s']:.1f} tok/s, tg{args.new_tokens}{depth} "
          f"{ref_single['decode_tok_s']:.1f} tok/s; batched total s: "
          + ", ".join(f"B={b}: {t:.2f}" for b, t in sorted(ref_batched.items())), flush=True)
    results = {"llamacpp": {"single": ref_single, "batched_s": ref_batched}, "paged": {}}
    for variant in args.variants.split(","):
        r = _bench.run_phase(str(HERE), _phase_args(args, variant))
        r["batched_s"] = {int(k): v for k, v in r["batched_s"].items()}
        results["paged"][variant] = r
        print(f"\npaged {variant} (weights {r['weight_mib']:.0f} MiB):")
        print(f"  batch 1: decode {r['decode_tok_s']:.1f} tok/s = {r['decode_tok_s'] / ref_single['decode_tok_s']:.2f}x "
              f"llama.cpp; prefill {r['prefill_tok_s']:.1f} tok/s = {r['prefill_tok_s'] / ref_single['prefill_tok_s']:.2f}x")
        print("  | B | llama.cpp s | paged s | paged / llama.cpp speed |")
        for b in args.batches:
            ref, got = ref_batched.get(b), r["batched_s"][b]
            ratio = f"{ref / got:.2f}x" if ref else "n/a"
            print(f"  | {b} | {ref if ref is not None else float('nan'):.2f} | {got:.2f} | {ratio} |")
    _bench.RESULTS.mkdir(exist_ok=True)
    (_bench.RESULTS / "llamacpp.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
