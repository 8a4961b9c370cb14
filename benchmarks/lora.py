"""LoRA adapters (#30): what serving many adapters over one base model costs, on the default model
(SmolLM2-135M-Instruct, bfloat16 with its GGUF weights kept quantized, as ``paged run`` runs it).

Adapters: random rank-16 PEFT adapters on all seven projections of every layer (what a typical
fine-tune trains), made here with PEFT from the default model's weights (``pip install peft``).

1. **Mixed workload** (``--requests`` prompts of ``--prompt-len`` random token ids, each
   ``--output-len`` new tokens, all submitted at once, greedy, ``ignore_eos``), output tok/s:

   * ``base, LoRA off``: the engine without ``--enable-lora``;
   * ``base, LoRA on``: the same requests, none naming an adapter (the cost of having the slots);
   * ``k adapters, batched``: the requests spread round robin over k = 1, 4, 16 adapters, on one
     engine with ``max_loras`` 16 (requests of every adapter batch together);
   * ``k adapters, merged, one batch per adapter``: the alternative without batched LoRA, a model
     with one adapter merged into its weights serving that adapter's requests, the adapters one
     after another. A merged model is a dense model of the base's shape, so each adapter's batch is
     timed on the base model itself (same kernels, same speed), plus the time to merge an adapter
     (``W + s B A`` for every projection, in bfloat16; re-quantizing the merged weights, which a
     quantized server would also pay, is not counted).

2. **Decode step cost** at batch 1 and 64 (``--step-batches``): the median step of that many
   requests decoding together, LoRA off, on without adapters, every row on one adapter, and rows
   spread over 16 adapters.

3. **Kernels**: microseconds per layer (the four projections at the default model's shapes, rank
   16, bfloat16) of the bundled ``cpu`` and ``torch`` kernels, for T rows over k adapters.

``--save-adapter DIR`` writes one random adapter for the default model and exits (the README's
LoRA example uses it). Each figure is one run; rounds of the whole table alternate
(``--rounds``), and the medians are printed; ``--only`` runs one table. Measure alone: the machine has 2
cores.

    python benchmarks/lora.py                      # the table (a few minutes)
    python benchmarks/lora.py --save-adapter my-adapter --rank 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(base_dir: str, out: Path, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter (A and B both random: ``init_lora_weights=False``) on every
    projection of the model in ``base_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                  init_lora_weights=False))
    peft_model.save_pretrained(out)


def merge_seconds(adapter_dir: Path) -> float:
    """Time to merge one adapter into dense bfloat16 weights of the base's shapes (``W += s B A``
    for every projection it holds)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    pairs = [(tensors[k], tensors[k.replace("lora_A", "lora_B")]) for k in tensors if "lora_A" in k]
    weights = [torch.zeros(b.shape[0], a.shape[1], dtype=torch.bfloat16) for a, b in pairs]
    start = time.perf_counter()
    for (a, b), w in zip(pairs, weights):
        w.add_((b.to(torch.bfloat16) @ a.to(torch.bfloat16)) * scale)
    return time.perf_counter() - start


def run_workload(llm, prompts: list[list[int]], output_len: int, loras: list) -> float:
    """Seconds to finish every request, all submitted at once."""
    from paged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return time.perf_counter() - start


def kernel_table(rank: int, repeats: int = 7) -> list[dict]:
    """Microseconds per layer (its four projections at the default model's shapes, bfloat16) of
    the bundled kernels, for T rows spread over k adapters."""
    import torch

    from paged.core.lora import LoRABatch, LoRALayerWeights
    from paged.plugins.lora import CpuLoRAKernel, TorchLoRAKernel

    torch.manual_seed(0)
    shapes = {"qkv": (576, 960, 3), "o": (576, 576, 1), "gate_up": (576, 3072, 2), "down": (1536, 576, 1)}
    slots = 16
    layers = {n: LoRALayerWeights(torch.randn(slots, p * rank, i).to(torch.bfloat16),
                                  torch.randn(slots, p * rank, o).to(torch.bfloat16),
                                  torch.full((slots,), rank, dtype=torch.int32), p, n)
              for n, (i, o, p) in shapes.items()}
    kernels = {"cpu": CpuLoRAKernel(), "torch": TorchLoRAKernel()}
    rows = []
    for step, (t, k) in enumerate([(1, 1), (4, 4), (16, 1), (16, 16), (64, 1), (64, 16), (256, 1), (256, 16),
                                   (1024, 1), (1024, 16)]):
        token_slots = torch.tensor([i % k for i in range(t)], dtype=torch.int32)
        used = sorted(set(token_slots.tolist()))
        batch = LoRABatch(token_slots, used, [torch.nonzero(token_slots == s).flatten() for s in used], step)
        row = {"rows": t, "adapters": k}
        for name, kernel in kernels.items():
            total = 0.0
            for layer, (i, o, _) in shapes.items():
                x, y = torch.randn(t, i).to(torch.bfloat16), torch.zeros(t, o, dtype=torch.bfloat16)
                kernel.apply(y, x, layers[layer], batch)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    kernel.apply(y, x, layers[layer], batch)
                    times.append(time.perf_counter() - start)
                total += statistics.median(times)
            row[name] = 1e6 * total
        rows.append(row)
    return rows


def decode_steps(llm, batch: int, loras: list, prompt_len: int = 16, new_tokens: int = 40) -> float:
    """The median step (ms) of ``batch`` requests decoding together (after their short prompts)."""
    from paged import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, [1000 + (i * 7 + j) % 20000 for j in range(prompt_len)], params,
                           lora_request=loras[i % len(loras)])
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[3:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save-adapter", metavar="DIR", help="write one random adapter for the default model and exit")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts of the mixed workload")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--step-batches", default="1,64")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", choices=["workload", "steps", "kernels"], help="one table alone")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from paged.core.loading.gguf import default_model_dir

    base_dir = str(default_model_dir())
    if args.save_adapter:
        save_random_adapter(base_dir, Path(args.save_adapter), args.rank, args.seed)
        print(f"saved a random rank-{args.rank} adapter for {base_dir} to {args.save_adapter}")
        return 0
    out: dict = {}
    if args.only in (None, "kernels"):
        out["kernels_us_per_layer"] = kernel_table(args.rank)
    if args.only != "kernels":
        out.update(engine_tables(args, base_dir))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    if "workload" in out:
        print(f"{args.requests} requests x ({args.prompt_len} + {args.output_len}) tokens, rank-{args.rank} adapters on "
              f"every projection, bfloat16 defaults; merging one adapter takes {1000 * out['merge_s']:.1f} ms")
        print("\n| run | total s | output tok/s | vs base, LoRA off |\n|---|---|---|---|")
        for name, row in out["workload"].items():
            print(f"| {name} | {row['seconds']:.2f} | {row['tok_s']:.1f} | {row['vs_base']:.2f}x |")
    if "step_ms" in out:
        print("\n| decode step, median ms | " + " | ".join(out["step_ms"]) + " |")
        print("|---" * (len(out["step_ms"]) + 1) + "|")
        batches = next(iter(out["step_ms"].values()))
        for b in batches:
            print(f"| B = {b} | " + " | ".join(f"{col[b]:.2f}" for col in out["step_ms"].values()) + " |")
    if "kernels_us_per_layer" in out:
        print("\n| rows | adapters | cpu, us per layer | torch, us per layer |\n|---|---|---|---|")
        for row in out["kernels_us_per_layer"]:
            print(f"| {row['rows']} | {row['adapters']} | {row['cpu']:.1f} | {row['torch']:.1f} |")
    return 0


def engine_tables(args, base_dir: str) -> dict:
    import random

    from paged import LLM, LoRARequest

    counts = [int(c) for c in args.adapters.split(",")]
    most = max(counts + [16])
    tmp = Path(tempfile.mkdtemp(prefix="paged-lora-bench-"))
    print(f"making {most} random rank-{args.rank} adapters in {tmp} ...", file=sys.stderr)
    adapters = []
    for i in range(most):
        save_random_adapter(base_dir, tmp / f"a{i}", args.rank, args.seed + i)
        adapters.append(LoRARequest(f"a{i}", i + 1, str(tmp / f"a{i}")))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 20000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    batches = [int(b) for b in args.step_batches.split(",")]
    seqs = max(args.requests, max(batches))
    results: dict[str, list[float]] = {}
    steps: dict[str, dict[int, list[float]]] = {}
    merge = statistics.median(merge_seconds(Path(a.lora_path)) for a in adapters[:4])
    # no prefix caching: the rounds repeat the prompts (and adapters share no blocks anyway)
    off = LLM(max_num_seqs=seqs, enable_prefix_caching=False)
    on = LLM(enable_lora=True, max_loras=most, max_lora_rank=args.rank, max_cpu_loras=most, max_num_seqs=seqs,
             enable_prefix_caching=False)
    for _ in range(args.rounds):  # every figure once per round, alternated
        if args.only in (None, "workload"):
            results.setdefault("base, LoRA off", []).append(run_workload(off, prompts, args.output_len, None))
            results.setdefault("base, LoRA on", []).append(run_workload(on, prompts, args.output_len, None))
            for k in counts:
                loras = [adapters[i % k] for i in range(args.requests)]
                results.setdefault(f"{k} adapters, batched", []).append(
                    run_workload(on, prompts, args.output_len, loras))
                # each adapter's requests as their own batch on a merged model (a dense model of the base's
                # shape, so timed on the base itself), plus merging it
                groups = [prompts[g::k] for g in range(k)]
                results.setdefault(f"{k} adapters, merged, one batch per adapter", []).append(
                    sum(run_workload(off, group, args.output_len, None) + merge for group in groups))
        if args.only in (None, "steps"):
            for b in batches:
                for name, llm, loras in (("LoRA off", off, [None]), ("LoRA on, no adapter", on, [None]),
                                         ("1 adapter", on, adapters[:1]), ("16 adapters", on, adapters[:16])):
                    steps.setdefault(name, {}).setdefault(b, []).append(decode_steps(llm, b, loras))
    off.shutdown()
    on.shutdown()
    out: dict = {}
    if results:
        total_tokens = args.requests * args.output_len
        base = statistics.median(results["base, LoRA off"])
        out["workload"] = {name: {"seconds": statistics.median(v), "tok_s": total_tokens / statistics.median(v),
                                  "vs_base": base / statistics.median(v)} for name, v in results.items()}
        out["merge_s"] = merge
    if steps:
        out["step_ms"] = {name: {b: statistics.median(v) for b, v in by_b.items()} for name, by_b in steps.items()}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
