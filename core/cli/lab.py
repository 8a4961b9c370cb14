"""``paged lab``: gen, replay, calibrate, validate, policies.

Policies and their options in ``replay``: ``--policy NAME`` (repeatable; each is one replay),
with options either inline, ``--policy 'priority:aging_s=5,other=1'``, or with ``--policy-option
KEY=VALUE`` flags, which apply to the nearest ``--policy`` before them. The same policy may be given
twice with different options; each replay is labelled by its spec (``priority:aging_s=5``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from paged.core.errors import ConfigError


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- flags --------------------------------------------------------------------------------------------
class _PolicyAction(argparse.Action):
    """--policy SPEC appends a replay; --policy-option KEY=VALUE adds to the last one."""

    def __call__(self, parser, namespace, values, option_string=None):
        from paged.core.lab.replay import PolicyRun

        runs = list(getattr(namespace, self.dest, None) or [])
        try:
            if option_string == "--policy":
                runs.append(PolicyRun.parse(values))
            else:
                key, sep, value = values.partition("=")
                if not sep or not key.strip():
                    raise ConfigError(f"--policy-option: expected KEY=VALUE, got {values!r}")
                if not runs:
                    raise ConfigError("--policy-option: must follow the --policy it applies to")
                runs[-1].options[key.strip()] = value.strip()
        except ConfigError as e:
            parser.error(str(e))
        setattr(namespace, self.dest, runs)


def _add_engine_flags_without_policy(parser: argparse.ArgumentParser) -> None:
    """The engine flags of ``paged run`` but --policy / --policy-option, which the lab takes per
    replay, and the server's."""
    from paged.core.cli.flags import add_engine_flags

    add_engine_flags(parser, skip=("server", "scheduler.policy"))


def _config(args: argparse.Namespace):
    from paged.core.cli.flags import engine_config_from_args

    if not hasattr(args, "policy_option"):
        args.policy_option = None
    return engine_config_from_args(args)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_lab_parser(sub, common: argparse.ArgumentParser) -> None:
    from paged.core.cli.flags import add_engine_flags

    lab = sub.add_parser("lab", help="policy lab: record, replay and compare scheduling policies on traces",
                         description=__doc__.split("\n\n")[0].replace("``", "`"))
    labsub = lab.add_subparsers(dest="lab_command", required=True)

    gen = labsub.add_parser("gen", parents=[common], help="write a seeded synthetic trace")
    gen.add_argument("--out", required=True, help="trace file to write (JSONL)")
    gen.add_argument("--num-requests", type=int, default=100)
    gen.add_argument("--rate", type=float, default=10.0, help="mean requests per second")
    gen.add_argument("--arrival", choices=["poisson", "bursty", "constant"], default="poisson")
    gen.add_argument("--burstiness", type=float, default=0.2,
                     help="bursty: gamma shape of inter-arrival times (< 1: burstier; 1 = poisson)")
    gen.add_argument("--prompt-len", type=float, default=128, help="median prompt tokens (log-normal)")
    gen.add_argument("--prompt-len-sigma", type=float, default=0.8)
    gen.add_argument("--prompt-len-min", type=int, default=4)
    gen.add_argument("--prompt-len-max", type=int, default=1024)
    gen.add_argument("--output-len", type=float, default=64, help="median output tokens (log-normal)")
    gen.add_argument("--output-len-sigma", type=float, default=0.6)
    gen.add_argument("--output-len-min", type=int, default=1)
    gen.add_argument("--output-len-max", type=int, default=256)
    gen.add_argument("--shared-prefix-frac", type=float, default=0.0, help="share of requests with a shared prefix")
    gen.add_argument("--num-prefixes", type=int, default=4, help="distinct shared prefixes")
    gen.add_argument("--prefix-len", type=int, default=128, help="tokens of each shared prefix")
    gen.add_argument("--priority-classes", type=int, default=1, help="priorities 0 (highest) .. C-1")
    gen.add_argument("--priority-weights", type=_floats, default=None, help="share of each class, e.g. 0.2,0.8")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--workload", choices=["multi-tenant", "shared-prefix", "heavy-tail", "deadline"], default=None,
                     help="a named workload for the research policies (uses --num-requests, --rate, --seed, "
                          "--num-prefixes, --prefix-len, --tenants, --flood; other shape flags are ignored)")
    gen.add_argument("--tenants", type=int, default=4, help="multi-tenant: number of tenants")
    gen.add_argument("--flood", type=float, default=10.0, help="multi-tenant: the flooding tenant's rate / each other's")
    gen.set_defaults(func=cmd_gen)

    replay = labsub.add_parser(
        "replay", parents=[common], help="replay a trace once per policy (real engine, or --simulate) and compare",
        description="Replay TRACE once per --policy against the real engine (in-process) or, with --simulate, "
        "against a cost model driving the real scheduler and KV cache; print a side-by-side table and write "
        "pictures. Options per policy: --policy 'NAME:KEY=VALUE,...' or --policy-option KEY=VALUE after "
        "the --policy it applies to.",
    )
    replay.add_argument("trace", help="trace file (JSONL; see `paged lab gen`)")
    replay.add_argument("--policy", dest="lab_policies", action=_PolicyAction, metavar="NAME[:K=V,...]",
                        help="a policy to replay (repeatable; default: the configured one)")
    replay.add_argument("--policy-option", dest="lab_policies", action=_PolicyAction, metavar="KEY=VALUE",
                        help="an option of the preceding --policy (repeatable)")
    replay.add_argument("--simulate", metavar="COST.json|const:SECONDS",
                        help="simulate with this cost model (from `paged lab calibrate`) or a constant step time")
    replay.add_argument("--clock", choices=["wall", "cpu", "steps"], default="wall",
                        help="real replays: wall time (arrivals slept for), CPU time of the steps (idle gaps "
                        "skipped; robust on a busy machine), or a fixed --step-time per step (reproducible)")
    replay.add_argument("--step-time", type=float, default=0.01, help="seconds per step for --clock steps")
    replay.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's arrival times (0.5: twice the rate)")
    replay.add_argument("--seed", type=int, default=None, help="token ids of length-only prompts (default: the trace's)")
    replay.add_argument("--max-requests", type=int, default=None, help="replay only the first N trace lines")
    replay.add_argument("--slo-ttft", type=float, default=None, help="TTFT objective, seconds")
    replay.add_argument("--slo-tpot", type=float, default=None, help="TPOT objective, seconds")
    replay.add_argument("--out-dir", default="lab-out", help="where pictures, results.json and summary.txt go")
    replay.add_argument("--html", action="store_true", help="also write OUT_DIR/report.html (self-contained)")
    replay.add_argument("--no-plots", action="store_true", help="write no files, print only")
    replay.add_argument("--json", action="store_true", help="print the summaries as JSON instead of the table")
    _add_engine_flags_without_policy(replay)
    replay.set_defaults(func=cmd_replay)

    calibrate = labsub.add_parser("calibrate", parents=[common],
                                  help="time real engine steps, fit the simulator's cost model, validate it")
    calibrate.add_argument("--out", required=True, help="cost model JSON to write")
    calibrate.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                           help="fit wall time, or the process CPU time (robust when other work shares the machine)")
    calibrate.add_argument("--scale", type=float, default=1.0, help="size of the calibration workload")
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument("--no-validate", action="store_true", help="skip the sim-vs-real validation replay")
    add_engine_flags(calibrate)
    calibrate.set_defaults(func=cmd_calibrate)

    validate = labsub.add_parser("validate", parents=[common],
                                 help="replay a small trace on the engine and simulated; print relative errors")
    validate.add_argument("trace", nargs="?", help="trace (default: a Poisson trace at 60%% of capacity)")
    validate.add_argument("--cost", required=True, help="cost model JSON")
    validate.add_argument("--clock", choices=["wall", "cpu"], default=None, help="default: the cost model's")
    validate.add_argument("--json", action="store_true")
    add_engine_flags(validate)
    validate.set_defaults(func=cmd_validate)

    policies = labsub.add_parser("policies", parents=[common], help="the scheduling policies the lab can replay, with options")
    policies.add_argument("--json", action="store_true")
    policies.set_defaults(func=cmd_policies)


# --- commands ------------------------------------------------------------------------------------------
def cmd_gen(args: argparse.Namespace) -> int:
    from paged.core.lab.trace import GeneratorSpec, generate_trace, write_trace
    from paged.core.lab.workloads import WorkloadSpec, generate_workload

    if args.workload is not None:
        trace = generate_workload(WorkloadSpec(args.workload, args.num_requests, args.rate, args.seed, args.tenants,
                                               args.flood, args.num_prefixes, args.prefix_len))
        write_trace(args.out, trace)
        _log(f"wrote {len(trace)} {args.workload} requests over {trace.requests[-1].arrival_s:.2f} s to {args.out}")
        return 0
    spec = GeneratorSpec(
        num_requests=args.num_requests, rate=args.rate, arrival=args.arrival, burstiness=args.burstiness,
        prompt_len_median=args.prompt_len, prompt_len_sigma=args.prompt_len_sigma, prompt_len_min=args.prompt_len_min,
        prompt_len_max=args.prompt_len_max, output_len_median=args.output_len, output_len_sigma=args.output_len_sigma,
        output_len_min=args.output_len_min, output_len_max=args.output_len_max,
        shared_prefix_frac=args.shared_prefix_frac, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        priority_classes=args.priority_classes, priority_weights=args.priority_weights, seed=args.seed,
    )
    trace = generate_trace(spec)
    write_trace(args.out, trace)
    span = trace.requests[-1].arrival_s if trace.requests else 0.0
    _log(f"wrote {len(trace)} requests over {span:.2f} s to {args.out}")
    return 0


def _load_cost(text: str | None):
    from paged.core.lab.cost import CostModel

    if text is None:
        return None
    if text.startswith("const:"):
        try:
            step = float(text[len("const:"):])
        except ValueError:
            raise ConfigError(f"--simulate: expected const:SECONDS, got {text!r}") from None
        if not step > 0:
            raise ConfigError(f"--simulate: the constant step time must be > 0, got {text!r}")
        return CostModel.constant(step)
    return CostModel.load(text)


def cmd_replay(args: argparse.Namespace) -> int:
    from paged.core.lab.metrics import format_table, summarize
    from paged.core.lab.replay import replay_trace
    from paged.core.lab.trace import read_trace

    from paged.core.lab.checks import calibration_range_warnings, poor_fit_warnings

    config = _config(args)
    trace = read_trace(args.trace)
    cost = _load_cost(args.simulate)
    mode = "sim" if cost is not None else args.clock
    if cost is not None:
        for warning in calibration_range_warnings(cost.engine, config) + poor_fit_warnings(cost.validation):
            _log(f"warning: {warning}")
    plots = not args.no_plots and importlib.util.find_spec("matplotlib") is not None
    if not args.no_plots and not plots:  # said before the replays, which may take long
        _log("warning: matplotlib is not installed: the results table is printed, but no pictures or files "
             "are written (pip install 'paged[plots]'; --no-plots to skip them)")
    results = replay_trace(trace, args.lab_policies or [], config, mode=mode, cost=cost, step_time=args.step_time,
                           time_scale=args.time_scale, seed=args.seed, max_requests=args.max_requests,
                           log=None if args.quiet else _log)
    summaries = [summarize(r, args.slo_ttft, args.slo_tpot) for r in results]
    meta: dict[str, Any] = {
        "trace": str(args.trace), "num_requests": len(results[0].requests) if results else 0, "mode": mode,
        "time_scale": args.time_scale, "slo_ttft": args.slo_ttft, "slo_tpot": args.slo_tpot,
        "settings": results[0].settings if results else {},
    }
    if mode == "sim":
        meta["cost_model"] = cost.to_dict()
    if mode == "steps":
        meta["step_time"] = args.step_time
    files = {}
    if plots:  # after the replays; the table is printed below in any case
        from paged.core.lab.report import write_report

        files = write_report(results, summaries, args.out_dir, meta, html_page=args.html)
    if args.json:
        print(json.dumps({"meta": meta, "summaries": summaries, "files": {k: str(v) for k, v in files.items()}},
                         indent=2, default=str))
    else:
        slos = [f"{name} <= {value} s" for name, value in (("TTFT", args.slo_ttft), ("TPOT", args.slo_tpot)) if value]
        print(f"trace {args.trace}: {meta['num_requests']} requests, mode {mode}"
              + (f", SLOs: {', '.join(slos)}" if slos else ""))
        print(format_table(summaries))
        for name, path in files.items():
            print(f"{name}: {path}")
    if not args.no_plots and not plots:
        _log("no pictures: they need matplotlib (pip install 'paged[plots]'), or pass --no-plots")
        return 1
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from paged.core.lab.calibrate import calibrate, validate
    from paged.core.lab.checks import poor_fit_warnings

    config = _config(args)
    log = None if args.quiet else _log
    model, _ = calibrate(config, clock=args.clock, seed=args.seed, scale=args.scale, log=log)
    if not args.no_validate:
        model.validation = validate(model, config, clock=args.clock, log=log)
    model.save(args.out)
    fit = model.fit
    print(f"wrote {args.out}: {fit['num_steps']} steps, R^2 {fit['r2']}, mean |relative error| per step "
          f"{100 * fit['mean_abs_rel_error']:.1f}%, total time error before rescaling {100 * fit['unscaled_total_time_rel_error']:+.1f}%")
    print("coefficients: " + ", ".join(f"{k} {v:.3g}" for k, v in model.to_dict()["coef"].items()))
    if model.validation:
        errors = model.validation["rel_errors"]
        print("sim vs real (relative error of the mean): "
              + ", ".join(f"{k} {'-' if v is None else f'{100 * v:+.1f}%'}" for k, v in errors.items()))
        for warning in poor_fit_warnings(model.validation):
            print(f"warning: {warning}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from paged.core.lab.calibrate import validate
    from paged.core.lab.checks import poor_fit_warnings
    from paged.core.lab.cost import CostModel
    from paged.core.lab.trace import read_trace

    config = _config(args)
    cost = CostModel.load(args.cost)
    trace = read_trace(args.trace) if args.trace else None
    out = validate(cost, config, trace, clock=args.clock, log=None if args.quiet else _log)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['num_requests']} requests, {out['clock']} clock; real vs simulated means:")
    for metric in ("ttft", "tpot", "e2e", "span_s"):
        err = out["rel_errors"].get(f"{metric}_mean" if metric != "span_s" else "span")
        real, sim = out["real"][metric], out["sim"][metric]
        print(f"  {metric:7s} real {real if real is None else f'{real:.4f}'} s  sim {sim if sim is None else f'{sim:.4f}'} s"
              f"  error {'-' if err is None else f'{100 * err:+.1f}%'}")
    for warning in poor_fit_warnings(out):
        print(f"warning: {warning}")
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    from paged.core.registry import get_registry

    registry = get_registry()
    items = []
    for name, spec in sorted(registry.policies.items()):
        options = []
        if spec.options is not None:
            for field, info in spec.options.model_fields.items():
                options.append({"name": field, "type": getattr(info.annotation, "__name__", str(info.annotation)),
                                "default": info.default, "description": info.description or ""})
        items.append({"name": name, "plugin": registry.owner.get(("policies", name)),
                      "description": getattr(spec, "description", "") or "", "options": options})
    if args.json:
        print(json.dumps({"policies": items}, indent=2, default=str))
        return 0
    for item in items:
        print(f"{item['name']}  (plugin {item['plugin']})  {item['description']}")
        for o in item["options"]:
            print(f"    {o['name']}: {o['type']} = {o['default']!r}  {o['description']}")
    return 0
