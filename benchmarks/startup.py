"""Start-up: ``import paged``, ``paged --help`` and a warm ``paged run "hi" --max-tokens 8``,
each as a fresh process, with the run's time broken down by phase.

    python benchmarks/startup.py [--repeats 5]
    python benchmarks/startup.py --python /other/.venv/bin/python --pythonpath /old/src   # another checkout

Every command runs ``--repeats`` times after one warm-up run (the model converted, the kernels
built, the files in the page cache); the table gives medians of wall time and of the process's
CPU time (user + sys, all threads: steadier than wall time on a shared machine). The run's
breakdown comes from ``PAGED_STARTUP_TIMES=1`` (``paged.core.loading.startup_times``): each
phase logs its own wall and CPU seconds, without the phases timed inside it, so the rows add up
to the totals (the generation's CPU seconds are all on ``other tokens``):

    interpreter, CLI imports, flags   process start -> flags parsed (python, pydantic, argparse)
    imports                       the engine's modules: torch, transformers, numpy, ...
    config                        flags, config file, env -> EngineConfig
    hf config                     config.json through transformers' AutoConfig
    load                          build the model, read the safetensors weights into it
    quantize                      int4/int8 weights: packed (or read back from the packed-weight cache)
    kernels                       load (or build) the C++ kernel libraries
    tokenizer                     AutoTokenizer
    engine                        the rest of the engine's start: plugins, KV cache, ...
    first token                   the request's time to first token
    other tokens                  the remaining 7 tokens
    exit                          what is left: output, interpreter shutdown

A checkout that predates ``PAGED_STARTUP_TIMES`` gives the totals only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

IMPORT_CHECK = "import sys, paged; print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)"
PHASES = ["interpreter, CLI imports, flags", "imports", "config", "hf config", "load", "quantize", "kernels",
          "tokenizer", "engine", "first token", "other tokens"]


def run_once(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process and its children, stderr). Forked by hand for
    ``wait4``'s resource usage of exactly this child (subprocess reaps it without one)."""
    start = time.perf_counter()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: stdout to /dev/null, stderr to the pipe
        os.close(read)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(write, 2)
        try:
            os.execvpe(cmd[0], cmd, env)
        finally:
            os._exit(127)
    os.close(write)
    with os.fdopen(read, encoding="utf-8", errors="replace") as f:
        err = f.read()
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed ({os.waitstatus_to_exitcode(status)}):\n{err[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, err


def phases_of(stderr: str) -> dict[str, tuple[float, float]]:
    """The ``paged.startup: <phase> <wall> <cpu>`` lines, summed per phase."""
    out: dict[str, tuple[float, float]] = {}
    for line in stderr.splitlines():
        _, sep, rest = line.partition("paged.startup: ")
        if not sep:
            continue
        parts = rest.rsplit(" ", 2)
        try:
            name, wall, cpu = parts[0], float(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            continue
        before = out.get(name, (0.0, 0.0))
        out[name] = (before[0] + wall, before[1] + cpu)
    return out


def measure(cmd: list[str], env: dict[str, str], repeats: int) -> dict:
    run_once(cmd, env)  # warm-up: page cache, conversion, kernel builds, packed weights
    runs = [run_once(cmd, env) for _ in range(repeats)]
    walls = [w for w, _, _ in runs]
    cpus = [c for _, c, _ in runs]
    result = {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "walls": walls, "cpus": cpus}
    per_run = [phases_of(err) for _, _, err in runs]
    if any(per_run):
        names = PHASES + sorted({n for p in per_run for n in p} - set(PHASES))
        result["phases"] = {n: [statistics.median(p.get(n, (0.0, 0.0))[i] for p in per_run) for i in (0, 1)]
                            for n in names}
        result["phases"]["exit"] = [
            statistics.median(w - sum(v[0] for v in p.values()) for w, p in zip(walls, per_run)),
            statistics.median(c - sum(v[1] for v in p.values() if not math.isnan(v[1])) for c, p in zip(cpus, per_run)),
        ]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--python", default=sys.executable, help="the interpreter (its venv's paged is measured)")
    parser.add_argument("--pythonpath", help="put this first on PYTHONPATH (another checkout, as <dir>/paged)")
    parser.add_argument("--only", choices=["import", "help", "run"], action="append", help="measure only these")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)

    env = dict(os.environ, PAGED_STARTUP_TIMES="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    python = args.python
    cli = [python, "-c", "import sys; from paged.core.cli.main import main; sys.exit(main())"]
    commands = {
        "import": [python, "-c", IMPORT_CHECK],
        "help": [*cli, "--help"],
        "run": [*cli, "run", "hi", "--max-tokens", "8"],
    }
    results = {}
    for name, cmd in commands.items():
        if args.only and name not in args.only:
            continue
        results[name] = measure(cmd, env, args.repeats)
        if name == "import":
            results[name]["torch_imported"] = "torch imported" in run_once(cmd, env)[2]
    meta = {"python": python, "pythonpath": args.pythonpath, "repeats": args.repeats, "cpus": os.cpu_count(),
            "load_average": os.getloadavg()}
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
        return 0
    print(f"{python}{' with ' + args.pythonpath if args.pythonpath else ''}: medians of {args.repeats} runs "
          f"(load average before/after: {meta['load_average'][0]:.1f}/{os.getloadavg()[0]:.1f})")
    labels = {"import": 'python -c "import paged"', "help": "paged --help", "run": 'paged run "hi" --max-tokens 8'}
    for name, r in results.items():
        extra = f"  ({'imports torch' if r['torch_imported'] else 'no torch'})" if name == "import" else ""
        print(f"  {labels[name]:34s} wall {r['wall_s']:6.2f} s   cpu {r['cpu_s']:6.2f} s{extra}")
    phases = results.get("run", {}).get("phases")
    if phases:
        print("  breakdown of the run (median per phase, seconds):        wall     cpu")
        for name, (wall, cpu) in phases.items():
            cpu_text = "      -" if math.isnan(cpu) else f"{cpu:7.2f}"  # not measured apart
            print(f"    {name:50s} {wall:7.2f} {cpu_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
