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
from typing import Any, Sequence

from paged.core.config import EngineConfig, config_flags, dump_config, load_config, parse_key_values
from paged.core.errors import PagedError

_CFG = "cfg:"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine settings (also settable by --config FILE or PAGED_* env)")
    group.add_argument("--config", dest="config_file", metavar="FILE", help="TOML or YAML config file")
    for flag in config_flags():
        dest = f"{_CFG}{flag.section or ''}.{flag.field}"
        help_text = flag.help or f"{flag.section}.{flag.field}" if flag.section else flag.help
        if flag.annotation is bool:
            group.add_argument(f"--{flag.name}", dest=dest, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(f"--{flag.name}", dest=dest, default=argparse.SUPPRESS, help=help_text)
    group.add_argument("--policy-option", action="append", metavar="KEY=VALUE",
                       help="an option of the selected policy, e.g. aging_s=5 (repeatable)")
    group.add_argument("--attention-option", action="append", metavar="KEY=VALUE",
                       help="an option of the selected attention backend (repeatable)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides: dict[str, Any] = {}
    for key, value in vars(args).items():
        if not key.startswith(_CFG):
            continue
        section, _, field = key[len(_CFG):].partition(".")
        if section:
            overrides.setdefault(section, {})[field] = value
        else:
            overrides[field] = value
    policy_options = parse_key_values(args.policy_option, "policy-option")
    if policy_options:
        overrides.setdefault("scheduler", {})["policy_options"] = policy_options
    attention_options = parse_key_values(args.attention_option, "attention-option")
    if attention_options:
        overrides.setdefault("attention", {})["options"] = attention_options
    return load_config(args.config_file, overrides)


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
        if p["error"]:
            print(f"    error: {p['error']}")
    return 0


# --- paged config ---------------------------------------------------------------------------
def cmd_config(args: argparse.Namespace) -> int:
    from paged.core.config import resolve_plugins

    config = engine_config_from_args(args)
    resolve_plugins(config, device=_device_for_check(config))
    print(dump_config(config, "json" if args.json else "yaml"), end="" if not args.json else "\n")
    return 0


def _device_for_check(config: EngineConfig) -> str:
    if config.device != "auto":
        return config.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# --- paged run ------------------------------------------------------------------------------
SAMPLING_FLAGS = {
    # flag: (SamplingParams field, type)
    "temperature": ("temperature", float),
    "top-p": ("top_p", float),
    "top-k": ("top_k", int),
    "min-p": ("min_p", float),
    "max-tokens": ("max_tokens", int),
    "min-tokens": ("min_tokens", int),
    "seed": ("seed", int),
    "n": ("n", int),
    "logprobs": ("logprobs", int),
    "presence-penalty": ("presence_penalty", float),
    "frequency-penalty": ("frequency_penalty", float),
    "repetition-penalty": ("repetition_penalty", float),
}


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts (default: --prompts-file, else stdin lines)")
    parser.add_argument("--prompts-file", help="one prompt per line, or JSONL objects with 'prompt' or "
                        "'messages' and per-prompt sampling fields and 'priority'")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument("--priority", type=int, default=0, help="priority of every prompt (lower runs first)")
    parser.add_argument("--record-trace", metavar="PATH", help="write what was served as a lab trace (JSONL; "
                        "see `paged lab replay`)")
    sampling = parser.add_argument_group("sampling (defaults: greedy, 128 tokens)")
    for flag, (field, typ) in SAMPLING_FLAGS.items():
        sampling.add_argument(f"--{flag}", dest=f"sp:{field}", type=typ, default=argparse.SUPPRESS)
    sampling.add_argument("--stop", dest="sp:stop", action="append", default=argparse.SUPPRESS,
                          help="stop string (repeatable)")
    sampling.add_argument("--stop-token-ids", dest="sp:stop_token_ids", type=lambda s: [int(x) for x in s.split(",")],
                          default=argparse.SUPPRESS, help="comma-separated token ids")
    sampling.add_argument("--ignore-eos", dest="sp:ignore_eos", action="store_true", default=argparse.SUPPRESS)


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


def _is_torchrun_worker() -> bool:
    from paged.core.engine.distributed import rendezvous_from_env

    launched = rendezvous_from_env()
    return launched is not None and launched[0] != 0


def _run_torchrun_worker(config: EngineConfig) -> int:
    """Under torchrun every process runs the same command; the ranks other than 0 serve rank 0's
    engine core as tensor-parallel workers instead."""
    from paged.core.engine.tp_ranks import run_worker_from_env

    return run_worker_from_env(config)


def cmd_run(args: argparse.Namespace) -> int:
    from paged.core.frontend.llm_engine import LLMEngine

    config = engine_config_from_args(args)
    if _is_torchrun_worker():
        return _run_torchrun_worker(config)
    items = _read_prompts(args)
    defaults: dict[str, Any] = {"temperature": 0.0, "max_tokens": 128}
    defaults.update({k[3:]: v for k, v in vars(args).items() if k.startswith("sp:")})
    engine = LLMEngine(config)
    try:
        return _run_prompts(args, engine, items, defaults)
    finally:
        engine.shutdown()


def _run_prompts(args: argparse.Namespace, engine, items: list[dict[str, Any]], defaults: dict[str, Any]) -> int:
    from paged.core.sampling_params import SamplingParams

    ids, prompts, served = [], [], []  # served: (params, priority) per request, for --record-trace
    for item in items:
        item = dict(item)
        priority = item.pop("priority", args.priority)
        if "messages" in item:
            prompt = engine.apply_chat_template(item.pop("messages"))
            special = False
        else:
            prompt = item.pop("prompt")
            if args.chat:
                prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
            special = not args.chat
        params = SamplingParams.from_dict({**defaults, **item})
        ids.append(engine.add_request(None, prompt, params, priority=priority, add_special_tokens=special))
        prompts.append(prompt)
        served.append((params, priority))

    import time

    start = time.perf_counter()
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    elapsed = time.perf_counter() - start
    outputs = [final[i] for i in ids]
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
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


# --- paged serve ----------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from paged.core.config import resolve_plugins
    from paged.core.server import run_server

    config = engine_config_from_args(args)
    resolve_plugins(config, device=_device_for_check(config))  # bad plugin names fail before anything starts
    if os.environ.get("WORLD_SIZE", "1") != "1" and config.parallel.data_parallel_size > 1:
        raise PagedError(
            f"parallel.data_parallel_size: {config.parallel.data_parallel_size} cannot be combined with a "
            "torchrun launch (WORLD_SIZE is set); under torchrun use --tensor-parallel-size only"
        )
    if _is_torchrun_worker():
        return _run_torchrun_worker(config)
    return run_server(config, access_log=args.access_log, log_level="warning" if args.quiet else "info",
                      record_trace=args.record_trace)


# --- paged bench -----------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / f"{args.bench}.py"
    if not script.is_file():
        raise PagedError(f"paged bench {args.bench}: {script} not found (benchmarks ship with a source checkout)")
    module = runpy.run_path(str(script), run_name="paged_bench")
    return module["main"](args.bench_args) or 0


# --- entry point -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    parser = argparse.ArgumentParser(prog="paged", description="A plugin-first LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", parents=[common], help="generate completions for prompts with the offline engine")
    add_run_flags(run)
    add_engine_flags(run)
    run.set_defaults(func=cmd_run)

    plugins = sub.add_parser("plugins", parents=[common], help="list discovered plugins and what they provide")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(func=cmd_plugins)

    serve = sub.add_parser("serve", parents=[common],
                           help="run the OpenAI-compatible HTTP server (engine core in its own process)")
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request")
    serve.add_argument("--record-trace", metavar="PATH",
                       help="append every finished request to a lab trace (JSONL) for `paged lab replay`")
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", parents=[common], help="benchmarks (paged bench serve --help)")
    bench.add_argument("bench", choices=["serve"], help="serve: load-test a running server")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(func=cmd_bench)

    config = sub.add_parser("config", parents=[common], help="print the effective configuration")
    config.add_argument("--json", action="store_true")
    add_engine_flags(config)
    config.set_defaults(func=cmd_config)

    from paged.core.cli.lab import add_lab_parser  # paged lab: gen, replay, calibrate, validate, policies

    add_lab_parser(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args) or 0
    except PagedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
