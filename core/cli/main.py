"""The ``paged`` command: run, serve, bench, plugins, config.

Engine settings are flags generated from the typed config (``paged config --help`` lists them);
``--config FILE`` and ``PAGED_*`` variables set the same fields with lower precedence.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from paged.core.cli.flags import (
    Parser,
    add_engine_flags,
    add_sampling_flags,
    add_structured_output_flags,
    engine_config_from_args,
    sampling_overrides,
    structured_output_from_args,
)
from paged.core.cli.show_config import cmd_config
from paged.core.config import EngineConfig
from paged.core.errors import PagedError
from paged.core.loading import startup_times


# --- paged plugins --------------------------------------------------------------------------
def cmd_plugins(args: argparse.Namespace) -> int:
    from paged.core.registry import get_registry

    registry = get_registry()
    infos = [p.to_dict() for p in registry.plugins]
    if args.json:
        print(json.dumps({"plugins": infos}, indent=2))
        return 0
    for p in infos:
        dist = f"{p['distribution']} {p['version']}" if p["distribution"] else p["module"]
        print(f"{p['name']}  [{p['status']}]  ({dist})")
        for kind, names in p["provides"].items():
            print(f"    {kind}: {', '.join(names)}")
        for conflict in p["conflicts"]:
            print(f"    conflict: {conflict}; commands that select it fail until one plugin is disabled")
        if p["error"]:
            print(f"    error: {p['error']}")
            if args.verbose and p["traceback"]:
                print("    " + p["traceback"].rstrip().replace("\n", "\n    "))
    if not args.verbose and any(p["traceback"] for p in infos):
        print("(paged plugins --verbose shows the tracebacks)")
    return 0


# --- paged run ------------------------------------------------------------------------------
def add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts (default: --prompts-file, else stdin lines)")
    parser.add_argument("--prompts-file", help="one prompt per line, or JSONL objects with 'prompt' or "
                        "'messages' and per-prompt sampling fields, 'priority' and 'lora'")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument("--priority", type=int, default=0, help="priority of every prompt (lower runs first)")
    parser.add_argument("--lora", metavar="NAME", help="run every prompt with this LoRA adapter of --lora-modules "
                        "(JSONL prompts may name their own: 'lora')")
    parser.add_argument("--record-trace", metavar="PATH", help="write what was served as a lab trace (JSONL; "
                        "see `paged lab replay`)")
    add_sampling_flags(parser, "sampling (defaults: greedy, 128 tokens; see README: Sampling defaults)")
    add_structured_output_flags(parser)


def _read_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each item: {"prompt" or "messages", optional sampling fields, optional "priority"}."""
    items: list[dict[str, Any]] = [{"prompt": p} for p in args.prompts]
    lines: list[str] = []
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    elif not items and not sys.stdin.isatty():
        lines = sys.stdin.read().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PagedError(f"prompts line {number}: invalid JSON ({e})") from None
            if "prompt" not in obj and "messages" not in obj:
                raise PagedError(f"prompts line {number}: needs a 'prompt' or 'messages' field")
            items.append(obj)
        else:
            items.append({"prompt": line})
    if not items:
        raise PagedError("no prompts: give them as arguments, with --prompts-file, or on stdin")
    return items


def _is_torchrun_worker(config: EngineConfig) -> bool:
    """Under torchrun: a rank that is not the first of its engine core's tensor-parallel group."""
    from paged.core.engine.torchrun_env import torchrun_placement

    placement = torchrun_placement(config)
    return placement is not None and placement[1] != 0


def _torchrun_node(config: EngineConfig) -> EngineConfig:
    """Under torchrun with data parallelism (WORLD_SIZE = data parallel x tensor parallel), the
    first rank of engine core g's group is node g: the API server with core 0 (g = 0, which also
    hosts the groups' rendezvous store) or a headless node with core g, both over
    ``data_parallel_address`` (default MASTER_ADDR)."""
    from paged.core.config import ParallelConfig
    from paged.core.engine.torchrun_env import torchrun_placement

    placement = torchrun_placement(config)
    parallel = config.parallel
    if placement is None or parallel.data_parallel_size == 1:
        return config
    from paged.core.engine.tp_ranks import host_group_store
    group = placement[0]
    node = {**parallel.model_dump(), "data_parallel_size_local": 1, "data_parallel_start_rank": group,
            "headless": group > 0, "data_parallel_address": parallel.data_parallel_address or os.environ["MASTER_ADDR"]}
    config = config.model_copy(update={"parallel": ParallelConfig.model_validate(node)})
    if group == 0:
        host_group_store()
    return config


def _run_torchrun_worker(config: EngineConfig) -> int:
    """Under torchrun every process runs the same command; the ranks other than 0 serve rank 0's
    engine core as tensor-parallel workers instead."""
    from paged.core.engine.tp_ranks import run_worker_from_env

    return run_worker_from_env(config)


def cmd_run(args: argparse.Namespace) -> int:
    with startup_times.phase("imports"):  # the engine's modules, torch and transformers among them
        from paged.core.frontend.llm_engine import LLMEngine

    with startup_times.phase("config"):
        config = engine_config_from_args(args)
    if _is_torchrun_worker(config):
        return _run_torchrun_worker(config)
    items = _read_prompts(args)
    defaults: dict[str, Any] = {"temperature": 0.0, "max_tokens": 128}
    defaults.update(sampling_overrides(args))
    structured = structured_output_from_args(args)
    if structured is not None:
        defaults["structured_output"] = structured
    _sampling_params(items, defaults)  # bad sampling flags fail before the model loads
    with startup_times.phase("engine"):  # what the phases timed inside (load, quantize, ...) leave
        engine = LLMEngine(config)
    try:
        # greedy unless --temperature; the model's generation_config fills the fields nobody set
        params = _sampling_params(items, {**engine.default_sampling, **defaults})
        return _run_prompts(args, engine, items, params)
    finally:
        engine.shutdown()


def _sampling_params(items: list[dict[str, Any]], defaults: dict[str, Any]) -> list[Any]:
    from paged.core.errors import InvalidRequestError
    from paged.core.sampling_params import SamplingParams

    out = []
    for number, item in enumerate(items, 1):
        fields = {k: v for k, v in item.items() if k not in ("prompt", "messages", "priority", "lora")}
        try:
            out.append(SamplingParams.from_dict({**defaults, **fields}))
        except (InvalidRequestError, TypeError) as e:
            where = f"prompt {number}: " if fields else ""
            raise PagedError(f"{where}{e}") from None
    return out


def _run_prompts(args: argparse.Namespace, engine, items: list[dict[str, Any]], params_list: list[Any]) -> int:
    from paged.core.frontend.outputs import RequestOutputKind

    ids, prompts, served = [], [], []  # served: (params, priority) per request, for --record-trace
    adapters = {r.lora_name: r for r in engine.config.lora.module_requests()}
    for number, (item, params) in enumerate(zip(items, params_list), 1):
        priority = item.get("priority", args.priority)
        lora = item.get("lora", args.lora)
        if lora is not None and lora not in adapters:
            where = "--lora" if "lora" not in item else f"prompt {number}: lora"
            raise PagedError(f"{where}: no adapter {lora!r} in --lora-modules ({', '.join(adapters) or 'none given'})")
        if "messages" in item:
            prompt = engine.apply_chat_template(item["messages"])
            special = False
        else:
            prompt = item["prompt"]
            if args.chat:
                prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
            special = not args.chat
        ids.append(engine.add_request(None, prompt, params, priority=priority, add_special_tokens=special,
                                      output_kind=RequestOutputKind.FINAL_ONLY,  # only the end is printed
                                      lora_request=adapters[lora] if lora is not None else None))
        prompts.append(prompt)
        served.append((params, priority))

    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = engine.run_until_finished(ids)
    elapsed = time.perf_counter() - start
    if startup_times.enabled:  # the generation's CPU seconds are not split: all go to "other tokens"
        ttft = min((c.metrics.time_to_first_token for o in outputs for c in o.outputs
                    if c.metrics and c.metrics.time_to_first_token), default=0.0)
        startup_times.record("first token", ttft, float("nan"))
        startup_times.record("other tokens", elapsed - ttft, time.process_time() - start_cpu)
    if args.record_trace:
        from paged.core.lab.trace import trace_from_outputs, write_trace

        write_trace(args.record_trace, trace_from_outputs(outputs, *zip(*served), prompts))
    summary = run_summary(engine, outputs, elapsed)

    if args.json:
        doc = {
            "requests": [
                {
                    "prompt": o.prompt,
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "index": c.index,
                    "num_prompt_tokens": len(o.prompt_token_ids),
                    "ttft_s": c.metrics.time_to_first_token if c.metrics else None,
                    **({"logprobs": [_logprob_json(lp) for lp in c.logprobs]} if c.logprobs is not None else {}),
                }
                for o in outputs
                for c in o.outputs
            ],
            "summary": summary,
        }
        print(json.dumps(doc, indent=2, ensure_ascii=False))
        return 0
    for o in outputs:
        for c in o.outputs:
            label = "" if len(o.outputs) == 1 else f" [{c.index}]"
            print(f"--- {o.request_id}{label} ({c.finish_reason}, {len(c.token_ids)} tokens)")
            print(c.text)
    print("---", file=sys.stderr)
    for key, value in summary.items():
        print(f"{key}: {value}", file=sys.stderr)
    return 0


def _logprob_json(lp) -> dict[str, Any]:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": [list(t) for t in lp.top]}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(values, q))


def run_summary(engine, outputs, elapsed: float) -> dict[str, Any]:
    completions = [c for o in outputs for c in o.outputs]
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for c in completions)
    ttfts = [c.metrics.time_to_first_token for c in completions if c.metrics and c.metrics.time_to_first_token]
    stats = engine.kv_cache_manager.prefix_cache_stats
    core_stats = engine.core.snapshot_stats()
    return {
        "requests": len(outputs),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(output_tokens / elapsed, 2) if elapsed else None,
        "total_tokens_per_s": round((input_tokens + output_tokens) / elapsed, 2) if elapsed else None,
        "ttft_p50_s": _round(_percentile(ttfts, 50)),
        "ttft_p99_s": _round(_percentile(ttfts, 99)),
        "prefix_cache_hit_rate": round(stats.hit_rate, 4),
        "preemptions": core_stats.num_preemptions,
        "peak_kv_usage": round(core_stats.peak_kv_usage, 4),
        "kv_blocks": engine.model_info.num_blocks,
        **_speculative_summary(engine),
    }


def _speculative_summary(engine) -> dict[str, Any]:
    speculator = getattr(engine.core, "speculator", None)
    if speculator is None:
        return {}
    return {"speculative": {"method": speculator.method, **speculator.stats.to_dict()}}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


# --- paged serve ----------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from paged.core.server import run_server

    config = engine_config_from_args(args)
    if _is_torchrun_worker(config):
        return _run_torchrun_worker(config)
    config = _torchrun_node(config)
    if config.parallel.headless:  # engine cores only, for the API server on another node
        from paged.core.ipc.headless import run_headless

        return run_headless(config, "WARNING" if args.quiet else "INFO")
    if config.parallel.multi_node:
        from paged.core.ipc.nodes import check_node_security

        check_node_security(config.parallel)  # before anything binds or loads
    make_recorder = None
    if args.record_trace:
        from paged.core.lab.trace import TraceRecorder

        def make_recorder() -> TraceRecorder:
            logging.getLogger("paged").info("recording the served requests as a lab trace in %s", args.record_trace)
            return TraceRecorder(args.record_trace, "paged serve")

    return run_server(config, access_log=args.access_log, log_level="warning" if args.quiet else "info",
                      make_trace_recorder=make_recorder)


def cmd_keys(args: argparse.Namespace) -> int:
    from paged.core.ipc.nodes import create_keys

    for path in create_keys(args.folder):
        print(path)
    print(f"copy {args.folder} to every node (a channel you trust: it holds secret keys) and pass "
          f"--data-parallel-keys {args.folder} to paged serve on each", file=sys.stderr)
    return 0


# --- paged bench -----------------------------------------------------------------------------
def benchmark_script(name: str, root: Path | None = None) -> Path:
    """``benchmarks/NAME.py`` of a source checkout: the ``paged`` package's own directory (the
    repository root, in an editable install). An install from a wheel has no benchmarks."""
    import paged

    root = Path(paged.__file__).resolve().parent if root is None else root
    script = root / "benchmarks" / f"{name}.py"
    if not script.is_file():
        raise PagedError(
            f"paged bench {name}: {script} does not exist; the benchmarks are part of a source checkout, "
            "not of the installed package: clone the repository and `pip install -e .` there (or run "
            f"`python benchmarks/{name}.py` in a checkout)"
        )
    return script


def cmd_bench(args: argparse.Namespace) -> int:
    import runpy

    module = runpy.run_path(str(benchmark_script(args.bench)), run_name="paged_bench")
    return module["main"](args.bench_args) or 0


# --- entry point -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    parser = Parser(prog="paged", description="A plugin-first LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", parents=[common], help="generate completions for prompts with the offline engine",
                         usage="paged run [options] [prompts ...]  (paged run --help lists the options)")
    add_run_flags(run)
    add_engine_flags(run)
    run.set_defaults(func=cmd_run)

    plugins = sub.add_parser("plugins", parents=[common], help="list discovered plugins and what they provide")
    plugins.add_argument("--json", action="store_true", help="one JSON document (with tracebacks)")
    plugins.add_argument("-v", "--verbose", action="store_true", help="show the traceback of each failed plugin")
    plugins.set_defaults(func=cmd_plugins)

    serve = sub.add_parser("serve", parents=[common], usage="paged serve [options]  (paged serve --help lists them)",
                           help="run the OpenAI-compatible HTTP server (engine core in its own process)")
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request")
    serve.add_argument("--record-trace", metavar="PATH",
                       help="append every finished request to a lab trace (JSONL) for `paged lab replay`")
    add_engine_flags(serve, skip=())
    serve.set_defaults(func=cmd_serve)

    keys = sub.add_parser("keys", parents=[common], help="create the CurveZMQ keys of engine cores on several nodes")
    keys.add_argument("folder", help="where to write them (copy it to every node; --data-parallel-keys FOLDER)")
    keys.set_defaults(func=cmd_keys)

    bench = sub.add_parser("bench", parents=[common], help="benchmarks (paged bench serve --help)")
    bench.add_argument("bench", choices=["serve"], help="serve: load-test a running server")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(func=cmd_bench)

    config = sub.add_parser("config", parents=[common], usage="paged config [options]  (paged config --help lists them)",
                            help="print the effective configuration and what it resolves to here")
    config.add_argument("--json", action="store_true")
    add_engine_flags(config, skip=())
    config.set_defaults(func=cmd_config)  # core/cli/show_config.py

    from paged.core.cli.lab import add_lab_parser  # paged lab: gen, replay, calibrate, validate, policies

    add_lab_parser(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    age = startup_times.process_age() if startup_times.enabled else None
    cpu = time.process_time()
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if startup_times.enabled:  # PAGED_STARTUP_TIMES=1: benchmarks/startup.py reads these lines
        startup_times.logger.setLevel(logging.DEBUG)
        startup_times.record("interpreter, CLI imports, flags", age or 0.0, cpu)
    try:
        code = args.func(args) or 0
    except PagedError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    profiled = sys.getprofile() is not None or sys.gettrace() is not None  # cProfile, coverage: let them write
    if argv is None and args.func is cmd_run and not profiled:  # a `paged run` process, not a caller in Python
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process without the interpreter's teardown of torch's and transformers' modules
    (about 1 s, and nothing after a run needs it). The engine has shut down by now; the atexit
    handlers still run (they stop helper processes), then the output is flushed."""
    import atexit

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say to it
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
