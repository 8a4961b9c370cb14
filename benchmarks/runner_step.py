"""What the model runner costs on the host per step: building the step's inputs (block table,
slot mapping, positions, token ids) apart from the model forward, at decode batch 1 and 64.

Two measurements, both on the CPU with the default model:

* ``inputs``: ``ModelRunner.execute`` on synthetic decode steps with the model forward and the
  sampler replaced by stubs, so what is timed is the runner's own work per step (its batch
  update, the flattening, the host-to-tensor conversion and the backend's ``build_metadata``)
  and nothing else. Cases ``B x context``: 1 x 128, 64 x 128 and 64 x 2048 (block tables of 128
  ids a row, where copying held block ids shows).
* ``step``: whole decode steps of the real engine (``LLM.generate``, 128-token prompts): the
  median ``execute`` time, of which the model (the decoder layers, ``forward_model``, and the LM
  head, ``compute_logits``) and the sampler; ``host`` is execute minus those, per step.

``--runner PATH`` loads ``ModelRunner`` from that file in place of the package's (e.g. a copy of
an older ``core/engine/model_runner.py``), so two runners can be timed alternately:

    python benchmarks/runner_step.py --json
    python benchmarks/runner_step.py --runner /tmp/old/model_runner.py --json
    python benchmarks/runner_step.py --only inputs --steps 400

Measured (2 cores shared with other jobs, load 4-10; #25 item 4), ``inputs``, median us per
step, the per-request mirror runner (before) -> the persistent ``InputBatch`` (after):

    one process, old and new alternating, 5 rounds:  B=1 x 128: 56 -> 69;  B=64 x 128: 277 -> 117;
                                                     B=64 x 2048: 507 -> 123
    separate processes alternating, 3 rounds:        B=1 x 128: 90 -> 66;  B=64 x 128: 530 -> 124;
                                                     B=64 x 2048: 895 -> 114

Before, the cost grew with the block ids held (the mirror copied every one each step); after, it
does not. ``step`` figures (whole steps: 0.3-14 s at B=64 on that machine) followed the load of
the moment more than the runner, so they are no comparison there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

INPUT_CASES = [(1, 128), (64, 128), (64, 2048)]  # (requests, tokens of context)
STEP_BATCHES = [1, 64]


def _use_runner_from(path: str) -> None:
    """Make ``paged.core.engine.model_runner`` the module in ``path`` (the engine core imports
    it when it builds its runner, after this)."""
    name = "paged.core.engine.model_runner"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _stub_model_and_sampler(runner) -> None:
    """The forward returns zeros and the sampler token 0: ``execute`` then costs only the
    runner's host work (the backend still builds its metadata)."""
    import torch

    from paged.core.engine.sampler import SamplerOutput

    runner.forward_model = lambda input_ids, positions, kv_caches, metadata: torch.zeros(input_ids.shape[0], 1)
    runner.model.compute_logits = lambda hidden: hidden
    runner.sampler.sample = lambda logits, requests: SamplerOutput([0] * len(requests), [None] * len(requests))


def time_inputs(runner, num_reqs: int, context: int, steps: int, seed: int = 0) -> dict:
    """Admit ``num_reqs`` requests with ``context``-token prompts in one (untimed) step, then
    time ``steps`` decode steps of all of them; each request gets a new block when its last one
    is full, as the scheduler would hand it out."""
    import numpy as np

    from paged.core.engine.request import Request
    from paged.core.engine.scheduler import ScheduledRequest, SchedulerOutput

    bs = runner.block_size
    rng = np.random.default_rng(seed)
    # Ids drawn at random from the (small) cache: the stubbed forward reads no slot.
    free_ids = iter(rng.integers(0, runner.num_blocks, num_reqs * (-(-(context + steps + 1) // bs))).tolist())
    requests = [Request(f"r{i}", rng.integers(1000, 20000, context).tolist(), max_tokens=steps + 1)
                for i in range(num_reqs)]
    held = {r.request_id: [next(free_ids) for _ in range(-(-context // bs))] for r in requests}
    admit = SchedulerOutput([ScheduledRequest(r, 0, context, list(held[r.request_id])) for r in requests])
    runner.execute(admit)
    for r in requests:
        r.append_output_token(0)
    times = []
    for _ in range(steps):
        scheduled = []
        for r in requests:
            computed = r.num_tokens - 1
            new_ids = [next(free_ids)] if computed % bs == 0 else []
            scheduled.append(ScheduledRequest(r, computed, 1, new_ids))
        output = SchedulerOutput(scheduled)
        start = time.perf_counter()
        runner.execute(output)
        times.append(time.perf_counter() - start)
        for r in requests:
            r.append_output_token(0)
    runner.execute(SchedulerOutput(finished_request_ids=[r.request_id for r in requests]))
    return {"requests": num_reqs, "context": context, "steps": steps,
            "median_us": statistics.median(times) * 1e6, "p90_us": sorted(times)[int(0.9 * len(times))] * 1e6}


def time_steps(llm, batch: int, new_tokens: int) -> dict:
    """Real decode steps of ``batch`` requests: execute, model (forward + logits), sampler."""
    from paged import SamplingParams

    runner = llm.engine.core.runner
    laps: dict[str, float] = {}
    rows: list[dict] = []

    def timing(name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            laps[name] = laps.get(name, 0.0) + time.perf_counter() - start
            return out
        return timed

    forward, logits, sample, execute = (runner.forward_model, runner.model.compute_logits, runner.sampler.sample,
                                        runner.execute)
    runner.forward_model = timing("layers", forward)
    runner.model.compute_logits = timing("lm_head", logits)
    runner.sampler.sample = timing("sample", sample)

    def timed_execute(output):
        laps.clear()
        start = time.perf_counter()
        result = execute(output)
        total = time.perf_counter() - start
        if len(output.scheduled) == batch and all(s.num_new_tokens == 1 for s in output.scheduled):
            layers, lm_head = laps.get("layers", 0.0), laps.get("lm_head", 0.0)
            rows.append({"execute": total, "model": layers + lm_head, "layers": layers, "lm_head": lm_head,
                         "sample": laps.get("sample", 0.0)})
        return result

    runner.execute = timed_execute
    try:
        prompts = [list(range(1000 + 300 * b, 1128 + 300 * b)) for b in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        runner.forward_model, runner.model.compute_logits, runner.sampler.sample = forward, logits, sample
        del runner.execute
    med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in ("execute", "model", "layers", "lm_head", "sample")}
    med["host"] = statistics.median((r["execute"] - r["model"] - r["sample"]) for r in rows) * 1e3
    return {"batch": batch, "steps": len(rows), **{f"{k}_ms": v for k, v in med.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runner", help="load ModelRunner from this file (an older model_runner.py)")
    parser.add_argument("--only", choices=["inputs", "step"])
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per inputs case")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens per request in the step measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.runner:
        _use_runner_from(args.runner)

    from paged import LLM

    results: dict = {"runner": args.runner or "paged"}
    if args.only != "step":
        # The ids in the synthetic steps are never read through: a small cache is enough.
        llm = LLM(device="cpu", num_blocks=64, max_num_seqs=64)
        runner = llm.engine.core.runner
        _stub_model_and_sampler(runner)
        results["inputs"] = [time_inputs(runner, b, c, args.steps) for b, c in INPUT_CASES]
        del llm, runner
    if args.only != "inputs":
        llm = LLM(device="cpu", max_num_seqs=64)
        results["step"] = [time_steps(llm, b, args.new_tokens) for b in STEP_BATCHES]
    if args.json:
        print(json.dumps(results))
        return
    for row in results.get("inputs", []):
        print(f"inputs  B={row['requests']:<3} context {row['context']:>5}: median {row['median_us']:8.1f} us "
              f"(p90 {row['p90_us']:.1f}) over {row['steps']} steps")
    for row in results.get("step", []):
        print(f"step    B={row['batch']:<3}: execute {row['execute_ms']:7.2f} ms = model {row['model_ms']:7.2f} "
              f"(layers {row['layers_ms']:.2f} + LM head {row['lm_head_ms']:.2f}) + sampler {row['sample_ms']:5.2f} "
              f"+ host {row['host_ms']:5.2f} (median of {row['steps']} steps)")


if __name__ == "__main__":
    main()
