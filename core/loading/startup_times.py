"""Where a start-up's seconds go: with ``PAGED_STARTUP_TIMES=1`` each timed phase logs one line
``paged.startup: <phase> <wall seconds> <CPU seconds>`` (debug level, on the ``paged.startup``
logger, which the CLI then turns on), and ``benchmarks/startup.py`` sums them per phase. CPU
seconds (the process's, all threads) say what a phase costs on a machine other work shares;
wall seconds what a user waits.

A phase's seconds exclude the phases timed inside it (a kernel load during quantization counts
as ``kernels``, not ``quantize``), so the phases add up to the time they span. Off (the
default), ``phase`` costs a flag test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

ENV = "PAGED_STARTUP_TIMES"
logger = logging.getLogger("paged.startup")

enabled = os.environ.get(ENV) == "1"
_inner = threading.local()  # per thread: a stack of the seconds spent in phases inside the open ones


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as ``name`` (without the phases timed inside it)."""
    if not enabled:
        yield
        return
    stack = _inner.__dict__.setdefault("stack", [])
    stack.append([0.0, 0.0])
    start, start_cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        inner, inner_cpu = stack.pop()
        if stack:
            stack[-1][0] += elapsed
            stack[-1][1] += cpu
        logger.debug("%s %.4f %.4f", name, elapsed - inner, cpu - inner_cpu)


def record(name: str, seconds: float, cpu_seconds: float | None = None) -> None:
    """Log a phase measured elsewhere (the interpreter's start, a request's time to first token)."""
    if enabled:
        logger.debug("%s %.4f %.4f", name, seconds, seconds if cpu_seconds is None else cpu_seconds)


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc, 10 ms resolution), else None."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
