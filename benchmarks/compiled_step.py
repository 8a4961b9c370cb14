"""Does a compiled step pay on this CPU? ``model.compile``'s forward (``CompiledForward``:
``torch.compile``, attention the opaque ``paged::attention`` op) against the eager forward of
the same engine, side by side in one process.

The engine runs with its defaults (bfloat16 + int4/int8 from the GGUF on an AMX CPU) and
``compile=True``, which compiles at start-up with the engine's inductor options (freezing and
the C++ wrapper); ``--inductor-defaults`` compiles a second ``CompiledForward`` without them and
measures that instead. Steps of at most ``model.compile_max_tokens`` (2) tokens run compiled;
larger ones eager, as in the engine. Eager and compiled alternate over ``--rounds`` rounds (B
requests decoding together, decode steps only); the figure is the median step time of the
model forward plus logits and the ratio eager/compiled.

    python benchmarks/compiled_step.py
    python benchmarks/compiled_step.py --inductor-defaults

Not a test: the greedy ids of the compiled path may differ from eager in bfloat16 (fused
elementwise ops round once, eager rounds after every op), so they are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inductor-defaults", action="store_true",
                        help="compile without the engine's freezing + C++ wrapper options")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from paged import LLM, SamplingParams
    from paged.core.engine.compiled_step import CompiledForward

    start = time.perf_counter()
    llm = LLM(compile=True)  # compiles at start-up (the engine logs how long)
    runner = llm.engine.core.runner
    compiled = runner.forward_model
    options = dict(CompiledForward.DEFAULT_OPTIONS)
    if args.inductor_defaults:
        options = {}
        compiled = CompiledForward(runner.model, compiled.max_tokens, options)
        runner.forward_model = compiled
        start = time.perf_counter()
        compiled.warm_up(runner._dummy_forward)
    compile_s = time.perf_counter() - start
    if not isinstance(compiled, CompiledForward) or compiled.failed:
        raise SystemExit("model.compile did not compile here (see the warning above)")
    forwards = {False: runner.model, True: compiled}  # the model takes the real caches eagerly

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

    results = {}
    for batch in args.batches:
        eager, comp = [], []
        for _ in range(args.rounds):
            for on, sink in ((False, eager), (True, comp)):
                runner.forward_model = forwards[on]
                sink.append(decode_steps(batch))
        same = sum(a == b for a, b in zip(eager[0][1], comp[0][1]))
        results[batch] = {"eager_ms": 1e3 * statistics.median(t for t, _ in eager),
                          "compiled_ms": 1e3 * statistics.median(t for t, _ in comp),
                          "identical_outputs": f"{same}/{batch}"}
        results[batch]["speedup"] = results[batch]["eager_ms"] / results[batch]["compiled_ms"]
    report = {"compile_s": compile_s, "inductor_options": options, "batches": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"start-up with compilation: {compile_s:.1f} s (inductor options {options})")
    for batch, r in results.items():
        print(f"B={batch}: decode step eager {r['eager_ms']:.2f} ms, compiled {r['compiled_ms']:.2f} ms "
              f"({r['speedup']:.2f}x); greedy outputs identical {r['identical_outputs']}")


if __name__ == "__main__":
    main()
