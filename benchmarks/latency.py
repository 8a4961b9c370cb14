"""Batch-1 decode latency against the memory-bandwidth bound.

One request decodes --output-tokens tokens; the decode time per token (first token excluded)
is compared with the bound ``weight bytes / measured copy bandwidth`` (a decode step must read
every weight once; the KV cache read is added too, small at this context).

    python benchmarks/latency.py --dtype float32
    python benchmarks/latency.py --dtype bfloat16 --quantization auto     # GGUF Q4_1 kept as int4
    python benchmarks/latency.py --dtype bfloat16 --quantization auto --compile     # model.compile
    python benchmarks/latency.py --dtype bfloat16 --quantization int4 --quantization-option dense_copy=false

The bound uses the weight bytes as the engine holds them (quantized codes and scales; a dense
copy for large batches is not read by a batch-1 step, so it is left out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _bench  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--quantization", default="none", help="none, int8, int4, auto or a plugin's method")
    parser.add_argument("--quantization-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--compile", action="store_true", help="model.compile: the step through torch.compile")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from paged import LLM, SamplingParams

    options = dict(item.split("=", 1) for item in args.quantization_option)
    llm = LLM(args.model, device="cpu", dtype=args.dtype, attention="torch", max_num_seqs=1,
              quantization=args.quantization, quantization_options=options, compile=args.compile)
    runner = llm.engine.core.runner
    hf_config = llm.engine.core.model_config.hf_config
    itemsize = runner.dtype.itemsize
    label = f"{str(runner.dtype).removeprefix('torch.')}, quantization {args.quantization}{', compiled' if args.compile else ''}"
    prompt = np.random.default_rng(0).integers(1000, 20000, args.prompt_tokens).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    llm.generate([prompt[:8]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    per_token = []
    for _ in range(args.repeats):
        llm.engine.kv_cache_manager.reset_prefix_cache()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        m = out.metrics
        per_token.append(m.decode_time / (len(out.token_ids) - 1))
    best = min(per_token)
    bandwidth = _bench.measure_bandwidth()
    weights = _bench.read_bytes_per_step(runner.model)
    kv = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * (hf_config.hidden_size // hf_config.num_attention_heads) \
        * itemsize * (args.prompt_tokens + args.output_tokens / 2)
    bound = (weights + kv) / bandwidth
    result = {"dtype": args.dtype, "quantization": args.quantization, "compile": args.compile, "options": options, "decode_ms_per_token": best * 1e3, "median_ms_per_token": float(np.median(per_token)) * 1e3,
              "bandwidth_gbs": bandwidth / 1e9, "weight_mb": weights / 1e6, "bound_ms_per_token": bound * 1e3,
              "ratio_to_bound": best / bound}
    print(f"batch-1 decode ({label}): {best * 1e3:.1f} ms/token (best of {args.repeats}; median "
          f"{result['median_ms_per_token']:.1f}); bound {bound * 1e3:.1f} ms/token = ({weights / 1e6:.0f} MB weights + "
          f"{kv / 1e6:.1f} MB KV) / {bandwidth / 1e9:.1f} GB/s measured copy bandwidth -> {best / bound:.2f}x the bound")
    _bench.RESULTS.mkdir(exist_ok=True)
    (_bench.RESULTS / f"latency-{args.dtype}-{args.quantization}{'-compiled' if args.compile else ''}.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
