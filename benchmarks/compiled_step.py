"""Does a compiled step pay on this CPU? The dense part of the forward under ``torch.compile``
(inductor), attention an opaque custom op, against the eager forward, side by side.

The engine runs with its defaults (bfloat16 + int4/int8 from the GGUF on an AMX CPU). The
model's dense forward (embedding, norms, projections, rotary, MLP) is re-traced as one function
in which each layer's attention is ``torch.ops.paged_bench.attention(q, k, v, layer)``, a
``torch.library.custom_op`` with a fake implementation that calls the engine's backend with the
step's KV caches and metadata (so dynamo never sees the paged cache or the metadata object).
Only steps of at most ``--max-rows`` tokens are compiled: larger ones take oneDNN's packed dense
weights, which inductor cannot lower (``mkldnn._linear_pointwise`` on a packed weight), and run
eager. Eager and compiled alternate over ``--rounds`` rounds in one process (B requests decoding
together, decode steps only); the figure is the median step time and the ratio eager/compiled.

    python benchmarks/compiled_step.py                       # default inductor settings
    python benchmarks/compiled_step.py --freezing --cpp-wrapper

Not a test: the greedy ids of the compiled path may differ from eager in bfloat16 (fused
elementwise ops round once, eager rounds after every op), so they are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import Tensor


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-rows", type=int, default=2, help="steps of up to this many tokens are compiled")
    parser.add_argument("--freezing", action="store_true", help="torch._inductor.config.freezing")
    parser.add_argument("--cpp-wrapper", action="store_true", help="torch._inductor.config.cpp_wrapper")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from paged import LLM, SamplingParams

    llm = LLM()
    runner = llm.engine.core.runner
    model, backend = runner.model.model, runner.backend
    step_state: dict = {}

    @torch.library.custom_op("paged_bench::attention", mutates_args=())
    def attention(q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
        return backend.forward(q, k, v, step_state["kv_caches"][layer], step_state["metadata"]).contiguous()

    @attention.register_fake
    def _(q, k, v, layer):
        return q.new_empty(q.shape)

    def dense_forward(input_ids: Tensor, positions: Tensor) -> Tensor:  # LlamaModel.forward, attention opaque
        hidden = model.embed_tokens(input_ids)
        cos_sin = model.rotary_emb.lookup(positions, hidden.dtype)
        residual = None
        for i, layer in enumerate(model.layers):
            if residual is None:
                residual, hidden = hidden, layer.input_layernorm(hidden)
            else:
                hidden, residual = layer.input_layernorm(hidden, residual)
            attn, n = layer.self_attn, hidden.shape[0]
            q, k, v = attn.qkv_proj(hidden).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, k = attn.rotary(positions, q.view(n, attn.num_heads, attn.head_dim),
                               k.view(n, attn.num_kv_heads, attn.head_dim), cos_sin)  # fmt: skip
            out = torch.ops.paged_bench.attention(q, k, v.view(n, attn.num_kv_heads, attn.head_dim), i)
            hidden = attn.o_proj(out.reshape(n, attn.q_size))
            hidden, residual = layer.post_attention_layernorm(hidden, residual)
            hidden = layer.mlp(hidden)
        hidden, _ = model.norm(hidden, residual)
        return hidden

    import torch._inductor.config as inductor_config

    inductor_config.freezing = args.freezing
    inductor_config.cpp_wrapper = args.cpp_wrapper
    compiled = torch.compile(dense_forward, dynamic=True, fullgraph=True)
    eager_forward = model.forward
    use_compiled = {"on": False}

    def forward(input_ids, positions, kv_caches, metadata):
        if not use_compiled["on"] or input_ids.shape[0] > args.max_rows:
            return eager_forward(input_ids, positions, kv_caches, metadata)
        step_state["kv_caches"], step_state["metadata"] = kv_caches, metadata
        return compiled(input_ids, positions)

    model.forward = forward
    step_times: list[tuple[int, float]] = []
    run_forward = runner._forward

    def timed(inputs):
        start = time.perf_counter()
        out = run_forward(inputs)
        step_times.append((len(inputs.input_ids), time.perf_counter() - start))
        return out

    runner._forward = timed
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    def decode_steps(batch: int) -> tuple[float, list[list[int]]]:
        prompts = [list(range(1000 + 300 * b, 1128 + 300 * b)) for b in range(batch)]
        step_times.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return statistics.median(t for n, t in step_times if n == batch), [list(o.outputs[0].token_ids) for o in outs]

    use_compiled["on"] = True
    start = time.perf_counter()
    for batch in args.batches:
        decode_steps(batch)  # compiles (dynamic batch: one graph for 2+ rows, one for 1)
    compile_s = time.perf_counter() - start
    results = {}
    for batch in args.batches:
        eager, comp = [], []
        for _ in range(args.rounds):
            for on, sink in ((False, eager), (True, comp)):
                use_compiled["on"] = on
                sink.append(decode_steps(batch))
        same = sum(a == b for a, b in zip(eager[0][1], comp[0][1]))
        results[batch] = {"eager_ms": 1e3 * statistics.median(t for t, _ in eager),
                          "compiled_ms": 1e3 * statistics.median(t for t, _ in comp),
                          "identical_outputs": f"{same}/{batch}"}  # fmt: skip
        results[batch]["speedup"] = results[batch]["eager_ms"] / results[batch]["compiled_ms"]
    report = {"compile_s": compile_s, "freezing": args.freezing, "cpp_wrapper": args.cpp_wrapper, "batches": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"first compiled generate (compiles): {compile_s:.1f} s (freezing {args.freezing}, cpp_wrapper {args.cpp_wrapper})")
    for batch, r in results.items():
        print(f"B={batch}: decode step eager {r['eager_ms']:.2f} ms, compiled {r['compiled_ms']:.2f} ms "
              f"({r['speedup']:.2f}x); greedy outputs identical {r['identical_outputs']}")


if __name__ == "__main__":
    main()
