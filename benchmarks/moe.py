"""Decode speed of a small sparse MoE against a dense model of the same active size (#26 item 6).

Two random bfloat16 models with the default model's tokenizer (vocabulary 49152), built once
in a temporary folder, with the same attention (Llama's: hidden 512, 8 heads over 2 KV heads,
4 layers):

* ``moe``: ``MixtralForCausalLM``, 8 experts of width 1024, top-2 (``paged.models.moe.FusedMoE``):
  2 x 1024 = 2048 intermediate columns per token, 8 x 1024 held;
* ``dense``: ``LlamaForCausalLM``, intermediate 2048: the same active parameters per token.

For each batch size (1 and 16 requests of 16-token prompts, ``--tokens`` new tokens each, EOS
ignored) both models run in this process through ``paged.LLM``, alternating model by model for
``--rounds`` rounds, and the median tok/s and the ratio moe / dense are printed. What to expect:
at batch 1 the MoE reads its two experts' weights, the dense model its one MLP of the same size
(about equal; the MoE pays a router, a sort and a second GEMM pair per layer); at 16 requests
nearly every expert is active, so the MoE reads up to 4x the MLP bytes of the dense model.

    python benchmarks/moe.py                  # 3 rounds, 64 tokens
    python benchmarks/moe.py --rounds 5 --tokens 128 --json

The machine this was written on has 2 cores shared with other jobs: figures are indicative.
Measured there (#26), moe / dense tok/s, 32-48 new tokens:
    --forward --threads 1 (idle machine):   B=1 64.5 / 72.1 (0.89x);   B=16 533 / 1031 (0.52x)
    --forward (2 threads, idle machine):    B=1 132 / 228 (0.58x);     B=16 1174 / 2584 (0.45x)
    through paged.LLM (load 5-10):          B=1 0.48-0.90x;            B=16 0.39-0.99x (load-bound)
At B=16 nearly every expert runs, reading 4x the dense MLP's bytes in 8 small GEMM pairs.
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

COMMON = dict(vocab_size=49152, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=True)


def build_models(folder: Path) -> dict[str, Path]:
    import transformers

    configs = {
        "moe": transformers.MixtralConfig(**COMMON, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2,
                                          architectures=["MixtralForCausalLM"]),
        "dense": transformers.LlamaConfig(**COMMON, intermediate_size=2048, architectures=["LlamaForCausalLM"]),
    }
    return _bench.save_random_models(folder, configs)


def _decode_tok_s(llm, batch: int, tokens: int) -> float:
    from paged import SamplingParams

    prompts = [[1 + (7 * i + j) % 4000 for j in range(16)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
    return batch * tokens / elapsed


def _forward_runner(path: Path, factory, batch: int, context: int, steps: int):
    """A decode loop over the model alone (no engine): ``batch`` sequences of ``context`` cached
    tokens (random KV), ``steps`` greedy-free steps (the same token fed back); returns a
    callable giving tok/s (``batch * steps / seconds``)."""
    import torch

    from paged.backends.torch_attention import TorchAttentionBackend
    from paged.core.attention import AttentionLayout, BatchInputs
    from paged.core.loading import loader

    config = loader.load_hf_config(path)
    shape = factory.attention_shape(config)
    block = 16
    layout = AttentionLayout(*shape, block, torch.bfloat16, torch.device("cpu"))
    backend = TorchAttentionBackend(layout)
    model = loader.build_model(path, config, factory, backend, torch.bfloat16, "cpu")
    model.prepack_weights()
    per_seq = (context + steps + block - 1) // block
    kv = backend.allocate_kv_cache(batch * per_seq + 1)
    for k, v in kv:
        k.normal_(0, 0.5)
        v.normal_(0, 0.5)
    table = torch.arange(1, batch * per_seq + 1, dtype=torch.int32).view(batch, per_seq)

    def step(pos: int) -> None:
        slots = table[:, pos // block].long() * block + pos % block
        qsl = torch.arange(batch + 1, dtype=torch.int32)
        seq_lens = torch.full((batch,), pos + 1, dtype=torch.int32)
        inputs = BatchInputs(num_reqs=batch, num_tokens=batch, num_decodes=batch, max_query_len=1, max_seq_len=pos + 1,
                             query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                             query_start_loc_cpu=qsl.clone(), seq_lens_cpu=seq_lens.clone())
        ids = torch.full((batch,), 100, dtype=torch.long)
        hidden = model(ids, torch.full((batch,), pos, dtype=torch.long), kv, backend.build_metadata(inputs))
        model.compute_logits(hidden)

    @torch.inference_mode()
    def run() -> float:
        step(context)  # warm
        start = time.perf_counter()
        for s in range(steps):
            step(context + s)
        return batch * steps / (time.perf_counter() - start)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--forward", action="store_true",
                        help="time the models' decode forward alone (no engine: no scheduler, sampler, detokenizer)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from paged import LLM

    with tempfile.TemporaryDirectory(prefix="paged-moe-bench-") as tmp:
        paths = build_models(Path(tmp))
        if args.forward:
            from paged.models.llama import LlamaForCausalLM
            from paged.models.mixtral import MixtralForCausalLM

            factories = {"moe": MixtralForCausalLM, "dense": LlamaForCausalLM}
            results = {}
            for batch in args.batches:
                runners = {name: _forward_runner(paths[name], factories[name], batch, 64, args.tokens) for name in paths}
                runs = {name: [] for name in runners}
                for _ in range(args.rounds):
                    for name, run in runners.items():
                        runs[name].append(run())
                results[batch] = runs
            return _report(results, args)
        llms = {name: LLM(str(path), device="cpu", dtype="bfloat16", max_num_seqs=max(args.batches))
                for name, path in paths.items()}
        results = _bench.alternated_rounds(llms, args.batches, args.rounds, args.tokens, _decode_tok_s)
        for llm in llms.values():
            llm.shutdown()
    return _report(results, args)


def _report(results: dict[int, dict[str, list[float]]], args: argparse.Namespace) -> int:
    summary = {}
    for batch, runs in results.items():
        moe, dense = statistics.median(runs["moe"]), statistics.median(runs["dense"])
        summary[batch] = {"moe_tok_s": round(moe, 1), "dense_tok_s": round(dense, 1), "ratio": round(moe / dense, 3),
                          "runs": {k: [round(v, 1) for v in vs] for k, vs in runs.items()}}
    if args.json:
        print(json.dumps({"tokens": args.tokens, "rounds": args.rounds, "forward_only": args.forward,
                          "batches": summary}, indent=2))
    else:
        what = "model forward only" if args.forward else "through paged.LLM"
        print(f"decode tok/s ({what}), median of {args.rounds} alternated rounds, {args.tokens} new tokens per request")
        for batch, s in summary.items():
            print(f"  B={batch:>3}: moe {s['moe_tok_s']:>8.1f}  dense {s['dense_tok_s']:>8.1f}  moe/dense {s['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
