"""``paged serve --headless``: a node that runs engine cores for the API server on another node.

It starts this node's cores (``parallel.local_ranks``, each its own process, as the API server
node starts its own) connecting to ``data_parallel_address`` (``paged.core.ipc.nodes``), then
waits. It prints its start-up and errors only, and exits when its cores have exited: each exits
when the API server is gone (no heartbeat for ``data_parallel_timeout_s``), refuses it (other
keys, another model or settings) or stops it; SIGTERM / Ctrl-C stop them. The exit code is the
first non-zero one of its cores (0 when the API server went away).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from paged.core.config import EngineConfig
from paged.core.engine.child_process import spawn_child
from paged.core.ipc.client import _core_devices
from paged.core.ipc.nodes import addresses, check_node_security

logger = logging.getLogger("paged")


def run_headless(config: EngineConfig, log_level: str = "INFO") -> int:
    parallel = config.parallel
    check_node_security(parallel)
    input_addr, output_addr = addresses(parallel)
    ranks = list(parallel.local_ranks)
    procs = {}
    for rank in ranks:
        env = {"TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
               **_core_devices(config, rank - parallel.data_parallel_start_rank)}
        args = ["--input", input_addr, "--output", output_addr, "--log-level", log_level, "--dp-rank", str(rank)]
        procs[rank] = spawn_child("paged.core.ipc.engine_core_proc", args, config, env)
    logger.info("headless node: data-parallel ranks %s of %d (pids %s) for the API server at %s%s",
                ", ".join(map(str, ranks)), parallel.data_parallel_size, ", ".join(str(p.pid) for p in procs.values()),
                input_addr, ", CURVE keys from " + parallel.data_parallel_keys if parallel.data_parallel_keys else "")
    stop = threading.Event()

    def _stop(signum, frame):  # noqa: ARG001
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    code = 0
    while procs and not stop.wait(0.2):
        for rank, proc in list(procs.items()):
            exit_code = proc.poll()
            if exit_code is None:
                continue
            del procs[rank]
            if exit_code:
                logger.error("headless node: the engine core of data-parallel rank %d exited with code %d", rank,
                             exit_code)
                code = code or exit_code
    for proc in procs.values():  # stopped: end the cores (SIGTERM, then SIGKILL)
        proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(10)
        except Exception:
            proc.kill()
            proc.wait(5)
    logger.info("headless node: every engine core has exited; exiting")
    return code
