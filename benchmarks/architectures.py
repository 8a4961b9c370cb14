"""Decode speed of each bundled dense architecture against Llama of the same size (#26 item 6).

The new architectures are meant to run on the same fused CPU kernels and quantized paths as
Llama (no per-architecture slow path); this shows it. One random bfloat16 model per
architecture with the default model's tokenizer (vocabulary 49152), built once in a temporary
folder from a ``transformers`` config, all of the same size: hidden 512, 8 heads over 2 KV
heads of head_dim 64, intermediate 1536, 4 layers, tied embeddings:

* ``llama`` (the reference): ``LlamaForCausalLM``;
* ``qwen2``: q/k/v biases;
* ``qwen3``: per-head q/k RMSNorm;
* ``mistral``: a sliding window of ``WINDOW`` (16) tokens, shorter than the sequence
  (16-token prompts + ``--tokens``);
* ``phi3``: fused qkv and gate/up projections;
* ``gemma2``: local/global layers (window 4096, HF's default), attention and final soft-caps
  (50, 30), GeGLU, Gemma norms, scaled embeddings;
* ``gemma3``: Gemma 3 text, q/k norms, three local layers then a global one (two rope bases).

For each batch size (1 and 16 requests of 16-token prompts, ``--tokens`` new tokens each, EOS
ignored) every model runs in this process through ``paged.LLM`` (torch attention backend),
alternating model by model for ``--rounds`` rounds; printed: the median tok/s and the ratio to
Llama's, ratios below 0.85 flagged. ``--quantization int4`` (or int8) runs every model
quantized (default: not passed, the engine's default for a safetensors folder, i.e. none).
``--profile`` adds, per architecture, the functions that take the most time per decode step
(``cProfile`` over one ``generate`` at the first batch size, divided by its steps).

    python benchmarks/architectures.py                        # 3 rounds, 64 tokens
    python benchmarks/architectures.py --rounds 3 --tokens 32 --quantization int4 --json
    python benchmarks/architectures.py --archs llama gemma2 --batches 1 --profile

The machine this was written on has 2 cores shared with other jobs: figures are indicative.
Measured there (#26), through paged.LLM, median of 3 rounds, 32 new tokens, tok/s (x Llama), no test
run at the time (/proc/loadavg 1-min before/after: bfloat16 1.96/1.75, int4 1.61/1.52):
                bfloat16 B=1   bfloat16 B=16   int4 B=1       int4 B=16
    llama       108.2 (1.00)   1431 (1.00)     333.5 (1.00)   1484 (1.00)
    qwen2       105.8 (0.98)   1391 (0.97)     309.3 (0.93)   1451 (0.98)
    qwen3        92.8 (0.86)   1346 (0.94)     207.1 (0.62!)  1436 (0.97)
    mistral     112.1 (1.04)   1413 (0.99)     330.1 (0.99)   1263 (0.85)
    phi3        114.1 (1.06)   1527 (1.07)     327.6 (0.98)   1328 (0.90)
    gemma2      109.7 (1.01)    950 (0.66!)    295.4 (0.89)   1273 (0.86)
    gemma3      108.3 (1.00)   1271 (0.89)     311.0 (0.93)   1391 (0.94)
The two flagged cells did not reproduce (reruns of llama + that arch alone: gemma2 bfloat16 B=16
0.89, 0.88; qwen3 int4 B=1 0.96 idle, 1.00 and 0.76 with test runs going). ``--profile``: every
arch calls the same kernels as Llama (mkldnn linear or int4_gemm, write_and_decode, the fused
norm/activation/rotary kernels) as many times per step; the same kernel's time moves with the
machine's load. What Gemma 2 adds: the final logit soft-cap (divide, tanh, multiply) on the
[B, 49152] logits, about 1.1 ms a step at B=16 (7% of Llama's 15.6 ms step); Qwen3: its q/k
RMSNorm, 8 more rms_norm calls a step (under 0.5 ms at B=1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _bench  # noqa: E402

WINDOW = 16  # Mistral's sliding window: shorter than 16 prompt tokens + the new ones
FLAG_BELOW = 0.85

COMMON = dict(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
              bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
HEAD_DIM = 64


def _configs() -> dict:
    import transformers

    gemma = dict(head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, hidden_activation="gelu_pytorch_tanh")
    return {
        "llama": transformers.LlamaConfig(**COMMON, head_dim=HEAD_DIM, architectures=["LlamaForCausalLM"]),
        "qwen2": transformers.Qwen2Config(**COMMON, architectures=["Qwen2ForCausalLM"]),
        "qwen3": transformers.Qwen3Config(**COMMON, head_dim=HEAD_DIM, architectures=["Qwen3ForCausalLM"]),
        "mistral": transformers.MistralConfig(**COMMON, head_dim=HEAD_DIM, sliding_window=WINDOW,
                                              architectures=["MistralForCausalLM"]),
        "phi3": transformers.Phi3Config(**COMMON, sliding_window=None, architectures=["Phi3ForCausalLM"]),
        "gemma2": transformers.Gemma2Config(**COMMON, **gemma, architectures=["Gemma2ForCausalLM"]),
        "gemma3": transformers.Gemma3TextConfig(
            **COMMON, **gemma, layer_types=["sliding_attention"] * 3 + ["full_attention"],
            architectures=["Gemma3ForCausalLM"]),
    }


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"]


def build_models(folder: Path, names: list[str]) -> dict[str, Path]:
    configs = _configs()
    for name in names:
        config = configs[name]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        assert head_dim == HEAD_DIM, (name, head_dim)
    return _bench.save_random_models(folder, {name: configs[name] for name in names})


def _params(tokens: int):
    from paged import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)


def _prompts(batch: int) -> list[list[int]]:
    return [[1 + (7 * i + j) % 4000 for j in range(16)] for i in range(batch)]


def _decode_tok_s(llm, batch: int, tokens: int) -> float:
    prompts = _prompts(batch)
    start = time.perf_counter()
    outputs = llm.generate(prompts, _params(tokens), use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
    return batch * tokens / elapsed


def _profile(llm, batch: int, tokens: int, top: int) -> list[dict]:
    """The ``top`` functions by own time over one ``generate`` (prefill included), per decode
    step. ``cProfile``, not ``torch.profiler``: the fused CPU kernels are pybind functions that
    ``torch.profiler`` does not see, and cProfile times every C function called from Python
    (those kernels, the torch ops, the int4/int8 GEMMs); Python code is slowed by the tracing."""
    import cProfile
    import pstats

    prompts = _prompts(batch)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, _params(tokens), use_tqdm=False)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    total = sum(v[2] for v in stats.values())
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]

    def label(key) -> str:
        file, line, name = key
        return name if file == "~" else f"{Path(file).name}:{line}({name})"

    return [{"op": label(k), "ms_per_step": round(v[2] * 1e3 / tokens, 3), "share": round(v[2] / total, 3),
             "calls_per_step": round(v[0] / tokens, 1)} for k, v in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--archs", nargs="+", default=ARCHS, choices=ARCHS, help="llama is always included")
    parser.add_argument("--quantization", default=None,
                        help="passed to paged.LLM (e.g. int8, int4); default: not passed (the engine's default)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--profile", action="store_true",
                        help="also print each model's top functions per decode step (cProfile, first batch size)")
    parser.add_argument("--profile-top", type=int, default=12)
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    names = ["llama"] + [n for n in args.archs if n != "llama"]

    from paged import LLM

    settings = dict(device="cpu", dtype="bfloat16", attention="torch", max_num_seqs=max(args.batches),
                    kv_cache_memory_gib=0.125)
    if args.quantization is not None:
        settings["quantization"] = args.quantization
    profiles: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="paged-arch-bench-") as tmp:
        paths = build_models(Path(tmp), names)
        llms = {name: LLM(str(path), **settings) for name, path in paths.items()}
        results = _bench.alternated_rounds(llms, args.batches, args.rounds, args.tokens, _decode_tok_s)
        if args.profile:
            for name, llm in llms.items():
                profiles[name] = _profile(llm, args.batches[0], args.tokens, args.profile_top)
        for llm in llms.values():
            llm.shutdown()
    return _report(results, profiles, args)


def _report(results: dict[int, dict[str, list[float]]], profiles: dict[str, list[dict]],
            args: argparse.Namespace) -> int:
    summary: dict[str, dict] = {}
    for batch, runs in results.items():
        ref = statistics.median(runs["llama"])
        for name, vs in runs.items():
            tok_s = statistics.median(vs)
            summary.setdefault(name, {})[batch] = {"tok_s": round(tok_s, 1), "ratio": round(tok_s / ref, 3),
                                                   "runs": [round(v, 1) for v in vs]}
    slow = sorted({name for name, s in summary.items() for b in s.values() if b["ratio"] < FLAG_BELOW})
    if args.json:
        print(json.dumps({"tokens": args.tokens, "rounds": args.rounds, "quantization": args.quantization,
                          "flag_below": FLAG_BELOW, "archs": summary, "below": slow,
                          **({"profiles": profiles} if profiles else {})}, indent=2))
        return 0
    quant = args.quantization or "engine default"
    print(f"decode tok/s through paged.LLM (bfloat16, quantization {quant}), median of {args.rounds} alternated "
          f"rounds, {args.tokens} new tokens per request; ratio = arch / llama, '!' below {FLAG_BELOW}")
    header = f"  {'arch':<8}" + "".join(f"  {'B=' + str(b) + ' tok/s':>12} {'x llama':>8}" for b in results)
    print(header)
    for name, s in summary.items():
        cells = "".join(f"  {s[b]['tok_s']:>12.1f} {s[b]['ratio']:>7.3f}{'!' if s[b]['ratio'] < FLAG_BELOW else ' '}"
                        for b in results)
        print(f"  {name:<8}{cells}")
    if slow:
        print(f"below {FLAG_BELOW}x llama: {', '.join(slow)}")
    for name, rows in profiles.items():
        print(f"\n{name}: top functions by own time per decode step (B={args.batches[0]})")
        for r in rows:
            print(f"  {r['ms_per_step']:>8.3f} ms  {100 * r['share']:>5.1f}%  {r['calls_per_step']:>6.1f} calls  {r['op']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
