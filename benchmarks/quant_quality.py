"""Quality of the quantized model against the unquantized one on the same checkpoint.

Greedy agreement: a fixed set of chat prompts, each continued greedily (ignore EOS) by the
reference (default: bfloat16, quantization none) and by the candidate (default: bfloat16,
quantization auto). Reported: per prompt the first position where the tokens differ, and the
top-1 agreement of the candidate over the reference's own continuation (teacher-forced: the
candidate's argmax at each position of the reference's tokens, so one early divergence does not
count every later token as a miss; computed with one prefill through the engine's model). Perplexity: of both models on a short fixed text.

    python benchmarks/quant_quality.py                     # ~1,000 tokens: 8 prompts x 128
    python benchmarks/quant_quality.py --quick             # 2 prompts x 16 tokens (smoke test)
    python benchmarks/quant_quality.py --candidate-quantization int4 --reference-dtype float32
    python benchmarks/quant_quality.py --max-num-seqs 1     # decode one row at a time
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _bench  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Give me three tips for learning a new language.",
    "How do plants make their food?",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.",
]

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a screw press adapted from wine making. Books "
    "that had been copied by hand for months could now be produced in days, and the price of the "
    "written word fell sharply. Within fifty years presses were at work in more than two hundred "
    "cities across Europe, spreading news, scholarship and religious debate faster than any "
    "authority could control."
)


def _llm(args, dtype: str, quantization: str, options: dict | None = None):
    from paged import LLM

    return LLM(args.model, device="cpu", dtype=dtype, quantization=quantization, attention="torch",
               quantization_options=options or {}, max_num_seqs=args.max_num_seqs or len(PROMPTS),
               enable_prefix_caching=False)


def _all_logits(llm, ids: list[int]):
    """Float32 logits at every position of ``ids`` from one prefill through the engine's own
    model and KV cache (blocks from the front of the cache: nothing else runs meanwhile)."""
    import torch

    runner = llm.engine.core.runner
    blocks = list(range(-(-len(ids) // runner.block_size)))
    batch, _, positions = runner._dummy_batch([len(ids)], [blocks])
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), positions, runner.kv_caches, runner.backend.build_metadata(batch))
        return runner.model.compute_logits(hidden)


def _nll(llm, ids: list[int]) -> float:
    """Mean negative log-likelihood of ``ids[1:]``."""
    import torch

    logp = torch.log_softmax(_all_logits(llm, ids)[:-1], dim=-1)
    return float(-logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean())


def _argmax_along(llm, ids: list[int], prompt_len: int) -> list[int]:
    """The model's greedy choice for each of ``ids[prompt_len:]`` given the tokens before it
    (teacher-forced, one prefill)."""
    return _all_logits(llm, ids)[prompt_len - 1 : -1].argmax(dim=-1).tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--reference-dtype", default="bfloat16")
    parser.add_argument("--reference-quantization", default="none")
    parser.add_argument("--candidate-dtype", default="bfloat16")
    parser.add_argument("--candidate-quantization", default="auto")
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--candidate-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the candidate's quantization method (e.g. int8_activations=false)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="prompts decoded at once (default: all; 1 = one-row decode steps, the kernels' few-rows path)")
    parser.add_argument("--quick", action="store_true", help="2 prompts x 16 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens = 2, 16
    from paged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    for role in ("reference", "candidate"):
        options = dict(kv.split("=", 1) for kv in args.candidate_option) if role == "candidate" else None
        llm = _llm(args, getattr(args, f"{role}_dtype"), getattr(args, f"{role}_quantization"), options)
        tok = llm.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p in PROMPTS[: args.num_prompts]]
        prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        text_ids = tok(TEXT)["input_ids"]
        nll = _nll(llm, text_ids)
        results[role] = {"prompts": prompts, "outputs": outs, "ppl": math.exp(nll), "llm": llm}
    ref, cand = results["reference"], results["candidate"]
    first_div, agree, total = [], 0, 0
    for prompt, r, c in zip(ref["prompts"], ref["outputs"], cand["outputs"]):
        first_div.append(next((i for i, (a, b) in enumerate(zip(r, c)) if a != b), None))
        forced = _argmax_along(cand["llm"], list(prompt) + list(r), len(prompt))
        agree += sum(a == b for a, b in zip(forced, r))
        total += len(r)
    summary = {
        "reference": f"{args.reference_dtype}/{args.reference_quantization}",
        "candidate": f"{args.candidate_dtype}/{args.candidate_quantization}"
                     + "".join(f" {o}" for o in args.candidate_option),
        "first_divergence": first_div, "top1_agreement": agree / total, "tokens": total,
        "ppl_reference": ref["ppl"], "ppl_candidate": cand["ppl"], "ppl_delta": cand["ppl"] - ref["ppl"],
    }
    print(f"{summary['candidate']} vs {summary['reference']}: top-1 agreement {agree / total:.3f} over {total} tokens "
          f"(teacher-forced); first divergence per prompt {first_div} (None = identical); "
          f"perplexity {ref['ppl']:.3f} -> {cand['ppl']:.3f} ({summary['ppl_delta']:+.3f})")
    _bench.RESULTS.mkdir(exist_ok=True)
    (_bench.RESULTS / "quant_quality.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
