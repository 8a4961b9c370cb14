"""Where the test suite's CPU time goes: per test file and per kind of process it starts.

    python benchmarks/suite_profile.py                      # the whole suite, as .ci/run runs it
    python benchmarks/suite_profile.py -- tests/core/engine # a part (arguments after -- go to pytest)

On 2 cores the suite is CPU-bound (the two xdist workers and the servers, engine cores and
`paged run`s they start keep both cores busy), so its wall time falls only with its CPU time;
this says where that is. It runs pytest as the README's test command does, with two additions
that change no test's outcome:

- a pytest plugin (``-p``) in each worker records each test's wall time and the worker's own
  CPU seconds (user + sys) spent in it;
- a ``sitecustomize`` module (on ``PYTHONPATH``, so every Python process the tests start loads
  it) records each process's CPU seconds when it exits, with its command and the test that was
  running when it started (``PYTEST_CURRENT_TEST``, inherited from the worker). The records go
  to ``SUITE_PROFILE_DIR``: no ``PAGED_`` prefix, which engine cores and tensor-parallel ranks do
  not inherit.

A test file's CPU is its workers' CPU plus that of the processes started under its tests (a
server of a module fixture counts for the test whose set-up started it). What no record covers
(the launcher's children's total minus the records) is not attributed to a test: processes
other than Python (bash, curl, pip's builds) and Python processes ended by ``SIGKILL`` (a process
ended by ``SIGTERM`` without a handler of its own is recorded by one this module installs, which
then ends it by the same signal). Where ``/proc`` exists, a poller reads every descendant of
the launcher each 0.2 s (its command and CPU seconds), and the report shows the ones no record
covers by kind: the CPU each had at its last reading (a process's last 0.2 s are missed, and one
that lives less long is not seen). Measure alone: another busy process makes every figure larger.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PLUGIN = '''
import json, os, resource, time
import pytest

def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu = time.monotonic(), _cpu()
    yield
    record = {"test": item.nodeid, "wall": time.monotonic() - wall, "cpu": _cpu() - cpu,
              "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(os.environ["SUITE_PROFILE_DIR"] + "/tests.jsonl", "a") as f:
        f.write(json.dumps(record) + "\\n")
'''

SITECUSTOMIZE = '''
import atexit, json, os, signal, sys, time
_started = time.monotonic()
_test = os.environ.get("PYTEST_CURRENT_TEST", "")
_out = os.environ.get("SUITE_PROFILE_DIR")
_recorded = []

def _record():
    if _recorded:
        return
    _recorded.append(True)
    times = os.times()
    try:
        with open(_out + "/processes.jsonl", "a") as f:
            f.write(json.dumps({"argv": sys.argv[:4], "test": _test, "wall": time.monotonic() - _started,
                                "pid": os.getpid(), "start": _start_ticks(),
                                "cpu": times.user + times.system,
                                "pytest": not _test and ("PYTEST_XDIST_WORKER" in os.environ
                                                         or any("pytest" in a for a in sys.argv))}) + "\\n")
    except OSError:
        pass

def _start_ticks():
    """The process's start time in clock ticks since boot (/proc), which with the pid names it."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None

def _on_sigterm(signum, frame):
    # SIGTERM's default action skips atexit: record, then die of the signal as before
    _record()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)

if _out:
    atexit.register(_record)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # a process's own handler replaces this one
        signal.signal(signal.SIGTERM, _on_sigterm)
'''


def process_kind(argv: list[str]) -> str:
    """A short name for what a process was: `paged serve`, an engine core, a benchmark, ..."""
    words = [w for w in argv if w]
    text = " ".join(words)
    for module in ("engine_core_proc", "tp_ranks", "constraint_check", "headless"):
        if module in text:
            return module
    if words and (words[0].endswith("/paged") or words[0].endswith("cli/__main__.py")
                  or words[:2] == ["-m", "paged.core.cli"]):
        rest = [w for w in words[1:] if not w.startswith("-")]
        return "paged " + (rest[0] if rest else "")
    if not words or words[0] == "-c":
        return "python -c"
    if words[0].startswith("benchmarks/") or "/benchmarks/" in words[0]:
        return "python benchmarks/" + Path(words[0]).name
    return Path(words[0]).name


class ProcessPoller:
    """Every 0.2 s, each descendant of ``root`` in ``/proc``: its command and CPU seconds, by
    (pid, start time). A descendant is a process whose parent is ``root`` or a descendant seen
    before (one whose parent ended between two readings is missed)."""

    def __init__(self, root: int, interval: float = 0.2) -> None:
        self.root, self.interval = root, interval
        self.seen: dict[tuple[int, int], dict] = {}
        self._ours = {root}
        self._stop = threading.Event()
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._thread = threading.Thread(target=self._run, name="suite-profile-poller", daemon=True)

    def __enter__(self) -> "ProcessPoller":
        if os.path.isdir("/proc/self"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parent, start = int(fields[1]), int(fields[19])
                cpu = (int(fields[11]) + int(fields[12])) / self._ticks
                if pid not in self._ours and parent not in self._ours:
                    continue
                self._ours.add(pid)
                entry = self.seen.setdefault((pid, start), {"argv": [], "cpu": 0.0})
                entry["cpu"] = max(entry["cpu"], cpu)
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")[:-1]
                if argv:  # empty between fork and exec, or once it has exited
                    entry["argv"] = argv
            except (OSError, ValueError, IndexError):
                continue  # it ended while being read


def polled_kind(argv: list[str]) -> str:
    """``process_kind`` of a command line read from ``/proc`` (the interpreter first, ``-m``
    kept as a record's ``sys.argv`` would not)."""
    if argv and Path(argv[0]).name.startswith("python"):
        argv = argv[1:]
        if len(argv) > 1 and argv[0] == "-m":  # as sys.argv has it: the module's file
            module = argv[1].replace(".", "/")
            argv = [module + ("/__main__.py" if module == "paged/core/cli" else ".py"), *argv[2:]]
    return process_kind(argv)


def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0] if nodeid else "(outside a test)"


def started_under(process: dict) -> str:
    """The node id of the test that was running when the process started (its set-up, call or
    teardown)."""
    return re.sub(r" \((setup|call|teardown)\)$", "", process["test"])


def summarize(tests: list[dict], processes: list[dict], total_cpu: float, wall: float, top: int,
              polled: dict[tuple[int, int], dict] | None = None) -> dict:
    pytest = [p for p in processes if p["pytest"]]
    started = [p for p in processes if p["test"]]
    process_cpu_by_test: dict[str, float] = collections.defaultdict(float)
    for p in started:
        process_cpu_by_test[started_under(p)] += p["cpu"]
    per_file: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for t in tests:
        row = per_file[file_of(t["test"])]
        row["tests"] += 1
        row["wall"] += t["wall"]
        row["worker_cpu"] += t["cpu"]
    for p in started:
        row = per_file[file_of(started_under(p))]
        row["processes"] += 1
        row["process_cpu"] += p["cpu"]
    for row in per_file.values():
        row["cpu"] = row["worker_cpu"] + row["process_cpu"]
    kinds: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for p in started:
        row = kinds[process_kind(p["argv"])]
        row["count"] += 1
        row["cpu"] += p["cpu"]
    recorded = sum(p["cpu"] for p in processes)
    recorded_ids = {(p.get("pid"), p.get("start")) for p in processes}
    unrecorded: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for key, entry in (polled or {}).items():
        if key not in recorded_ids and entry["cpu"] > 0:
            row = unrecorded[polled_kind(entry["argv"])]
            row["count"] += 1
            row["cpu"] += entry["cpu"]
    return {
        "wall_s": wall,
        "cpu_s": total_cpu,
        "busy_cores": total_cpu / wall if wall else 0.0,
        "tests": len(tests),
        "pytest_cpu_s": sum(p["cpu"] for p in pytest),
        "started_processes": len(started),
        "started_process_cpu_s": sum(p["cpu"] for p in started),
        "not_attributed_cpu_s": max(0.0, total_cpu - recorded),
        "files": dict(sorted(per_file.items(), key=lambda kv: -kv[1]["cpu"])[:top]),
        "process_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["cpu"])[:top]),
        "polled": polled is not None,
        "unrecorded_kinds": dict(sorted(unrecorded.items(), key=lambda kv: -kv[1]["cpu"])[:top]),
        "tests_by_cpu": sorted(({"test": t["test"], "wall": t["wall"], "cpu": t["cpu"] + process_cpu_by_test[t["test"]]}
                                for t in tests), key=lambda t: -t["cpu"])[:top],
    }


def print_report(s: dict) -> None:
    print(f"suite: {s['tests']} tests, wall {s['wall_s']:.0f} s, CPU {s['cpu_s']:.0f} s "
          f"({s['busy_cores']:.2f} cores busy on average)")
    print(f"  pytest (launcher and workers)  {s['pytest_cpu_s']:7.0f} s")
    print(f"  {s['started_processes']:4d} processes the tests started {s['started_process_cpu_s']:7.0f} s")
    print(f"  not attributed                 {s['not_attributed_cpu_s']:7.0f} s  (not Python, or ended by SIGKILL)")
    print("\nCPU by test file (s): total = workers + processes started; wall = its tests' wall time")
    print(f"{'cpu':>7} {'workers':>7} {'procs':>7} {'n':>4} {'wall':>7}  file")
    for name, row in s["files"].items():
        print(f"{row['cpu']:7.1f} {row['worker_cpu']:7.1f} {row['process_cpu']:7.1f} {int(row['processes']):4d} "
              f"{row['wall']:7.1f}  {name}")
    print("\nProcesses the tests started, by kind (CPU s: total, mean each)")
    for name, row in s["process_kinds"].items():
        print(f"{row['cpu']:7.1f} {row['cpu'] / row['count']:5.2f} x {int(row['count']):3d}  {name}")
    if s["polled"]:
        seen = sum(row["cpu"] for row in s["unrecorded_kinds"].values())
        print(f"\nNot attributed, as the /proc poller saw it: {seen:.0f} s in processes no record covers "
              f"(CPU at their last reading), by kind (CPU s: total, mean each)")
        for name, row in s["unrecorded_kinds"].items():
            print(f"{row['cpu']:7.1f} {row['cpu'] / row['count']:5.2f} x {int(row['count']):3d}  {name}")
    print("\nTests by CPU (worker + the processes started under them; s)")
    for t in s["tests_by_cpu"]:
        print(f"{t['cpu']:7.1f} {t['wall']:7.1f}  {t['test']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=25, help="rows of each table")
    parser.add_argument("--out", type=Path, help="keep the raw records (tests.jsonl, processes.jsonl, "
                        "polled.jsonl) here")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the whole suite)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="paged-suite-profile-") as tmp:
        out = args.out or Path(tmp) / "records"
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tests.jsonl", "processes.jsonl", "polled.jsonl"):
            (out / name).unlink(missing_ok=True)
        hooks = Path(tmp) / "hooks"
        hooks.mkdir()
        (hooks / "paged_suite_profile_plugin.py").write_text(PLUGIN)
        (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # (run from a test)
        env.update(SUITE_PROFILE_DIR=str(out),
                   PYTHONPATH=os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH")) if p))
        command = [sys.executable, "-m", "pytest", "-q", "-p", "paged_suite_profile_plugin", *args.pytest_args]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        launcher = subprocess.Popen(command, cwd=REPO, env=env)
        with ProcessPoller(launcher.pid) as poller:
            returncode = launcher.wait()
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        total_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)

        def read(name: str) -> list[dict]:
            path = out / name
            return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

        polled = poller.seen if os.path.isdir("/proc/self") else None
        if polled is not None:
            with open(out / "polled.jsonl", "w") as f:
                for (pid, start), entry in polled.items():
                    f.write(json.dumps({"pid": pid, "start": start, **entry}) + "\n")
        summary = summarize(read("tests.jsonl"), read("processes.jsonl"), total_cpu, wall, args.top, polled)
    summary["pytest_returncode"] = returncode
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_report(summary)
    return returncode


if __name__ == "__main__":
    sys.exit(main())
