"""The tensor-parallel ranks of one engine core.

Rank 0 is the engine core's own process (scheduler, sampler, its share of the model). The other
ranks run ``ModelRunner.run_worker_loop`` and are either

* started here, on this machine (``--tensor-parallel-size N`` alone): ``python -m
  paged.core.engine.tp_ranks`` per rank, the config as JSON on stdin, rendezvous on a free loopback
  port, each in its own session and watching its parent (an orphaned rank exits); or
* started by ``torchrun`` on one or several machines: every process runs the same ``paged run``
  / ``paged serve`` command; ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` say who is
  who, rank 0 serves and the others become workers (``python -m paged.core.cli``).

Either way all ranks meet in torch.distributed's ``env://``-style rendezvous, and rank 0 stops
them by broadcasting the stop sentinel (``shutdown``).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import torch

from paged.core.config import EngineConfig, resolve_plugins
from paged.core.engine.child_process import is_orphaned, read_config_from_stdin, spawn_child
from paged.core.engine.cpu_malloc import keep_freed_memory
from paged.core.engine.distributed import (
    STORE_TIMEOUT,
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from paged.core.engine.torchrun_env import rendezvous_from_env, torchrun_placement
from paged.core.errors import ConfigError, PagedError

logger = logging.getLogger("paged")


def configure_cpu_process(config: EngineConfig, device: torch.device) -> None:
    """For a process that runs the model on the CPU: its threads and its malloc.

    Several ranks or engine cores on one CPU share its cores: give each process its share
    (unless OMP_NUM_THREADS says otherwise), or they slow each other down many times over. And
    glibc keeps the memory a step frees for the next step (``paged.core.engine.cpu_malloc``)."""
    if device.type != "cpu":
        return
    processes = config.parallel.tensor_parallel_size * config.parallel.local_cores  # this node's
    if processes > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))
    keep_freed_memory()


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelRanks:
    """Rank 0's handle on the group: joins it (starting the local ranks first when torchrun did
    not), and stops it. Use ``start``; ``device`` is rank 0's device."""

    def __init__(self, tp: TensorParallel, device: torch.device, procs: list[subprocess.Popen]) -> None:
        self.tp = tp
        self.device = device
        self.procs = procs
        self._closed = False
        atexit.register(self.shutdown)

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> "TensorParallelRanks | None":
        size = config.parallel.tensor_parallel_size
        launched = rendezvous_from_env()
        if launched is not None:
            rank, world = launched
            if world != size:  # torchrun with data parallelism: this core is one group of ranks
                group, group_rank = torchrun_placement(config)
                if group_rank != 0:
                    raise PagedError(f"rank {rank} must run the worker loop of group {group}, not an engine core")
                if size == 1:
                    return None
                device = rank_device(device, int(os.environ.get("LOCAL_RANK", "0")))
                host, port = publish_group_address(group)
                tp = init_tensor_parallel(0, size, device, host, port, own_store=True)
                logger.info("tensor parallel: group %d, %d ranks under torchrun (rendezvous at %s:%d)", group, size,
                            host, port)
                return cls(tp, device, [])
            if rank != 0:
                raise PagedError(f"rank {rank} must run the worker loop, not an engine core")
            device = rank_device(device, int(os.environ.get("LOCAL_RANK", "0")))
            tp = init_tensor_parallel(0, size, device, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            return cls(tp, device, [])
        if size == 1:
            return None
        device = rank_device(device, 0)
        port = _free_port()
        procs = [_spawn_rank(config, rank, size, port) for rank in range(1, size)]
        try:
            tp = _join_watching(procs, lambda: init_tensor_parallel(0, size, device, "127.0.0.1", port))
        except BaseException:
            _stop_processes(procs, timeout=5)
            raise
        logger.info("tensor parallel: %d ranks on this machine (gloo/nccl rendezvous on port %d)", size, port)
        return cls(tp, device, procs)

    def shutdown(self) -> None:
        """Broadcast the stop, wait for the local ranks, leave the group; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            self.tp.broadcast_array(None)
        except Exception as e:  # a rank already gone: nothing to stop there
            logger.debug("stop broadcast failed: %s", e)
        _stop_processes(self.procs, timeout=10)
        destroy_tensor_parallel()

    def abort(self) -> None:
        """After a failure on rank 0: kill the ranks started here and leave the group (ranks
        started by torchrun see the closed connections and exit); idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        for proc in self.procs:
            proc.kill()
        _stop_processes(self.procs, timeout=5)
        destroy_tensor_parallel()


def _spawn_rank(config: EngineConfig, rank: int, size: int, port: int) -> subprocess.Popen:
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    args = ["--rank", str(rank), "--world-size", str(size), "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--log-level", str(level)]
    return spawn_child("paged.core.engine.tp_ranks", args, config)


def _join_watching(procs: list[subprocess.Popen], join):
    """Run the blocking rendezvous in a thread while watching the ranks we started: one that dies
    before joining would otherwise leave rank 0 waiting forever."""
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["value"] = join()
        except BaseException as e:  # handed to the caller
            result["error"] = e

    thread = threading.Thread(target=target, name="paged-tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        for rank, proc in enumerate(procs, 1):
            code = proc.poll()
            if code is not None and thread.is_alive():
                raise PagedError(f"tensor-parallel rank {rank} exited with code {code} during start-up (see its log above)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _stop_processes(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# ---- the other ranks ---------------------------------------------------------------------------


def run_worker(config: EngineConfig, rank: int, size: int, master_addr: str, master_port: int, local_rank: int,
               own_store: bool = False) -> int:
    """Join the group as ``rank``, build this rank's share of the model and KV cache, and run the
    steps rank 0 broadcasts until it says stop."""
    from paged.core.engine.model_runner import ModelRunner, resolve_device
    from paged.core.loading.model_config import resolve_model
    from paged.core.registry import get_registry

    if config.parallel.tensor_parallel_size != size:
        raise ConfigError(
            f"parallel.tensor_parallel_size: {config.parallel.tensor_parallel_size}, but the group has "
            f"{size} ranks; pass --tensor-parallel-size {size}"
        )
    device = rank_device(resolve_device(config.device), local_rank)
    configure_cpu_process(config, device)
    init_tensor_parallel(rank, size, device, master_addr, master_port, own_store)
    try:
        registry = get_registry()
        model = resolve_model(config, registry, device)  # this process's own copy of rank 0's resolution
        runner = ModelRunner(config, resolve_plugins(config, registry, device.type), model, device, registry)
        logger.info("rank %d/%d ready on %s", rank, size, device)
        runner.run_worker_loop()
    finally:
        destroy_tensor_parallel()
    return 0


def run_worker_from_env(config: EngineConfig) -> int:
    """A torchrun-started rank other than its group's first (with data parallelism, each group of
    ``tensor_parallel_size`` ranks is one engine core: it joins its group's rendezvous)."""
    rank, world = rendezvous_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    size = config.parallel.tensor_parallel_size
    if world == size:
        return run_worker(config, rank, size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), local_rank)
    group, group_rank = torchrun_placement(config)
    host, port = group_address(group)
    return run_worker(config, group_rank, size, host, port, local_rank, own_store=True)


# ---- torchrun with data parallelism -------------------------------------------------------------
# WORLD_SIZE = data_parallel_size x tensor_parallel_size: process RANK belongs to group RANK // TP
# (one engine core, data-parallel rank g) as its rank RANK % TP. Torchrun rank 0 serves the API (a
# node with core 0), each other group's first rank is a headless node with its core, the rest are
# workers. Each group meets on a rendezvous of its own, whose address its first rank publishes in
# a TCPStore on MASTER_ADDR:MASTER_PORT that torchrun rank 0 hosts (``host_group_store``); the
# request traffic goes over ZeroMQ as between any nodes (paged.core.ipc.nodes).
_GROUP_KEY = "paged/tp-group/{}"
_group_store_server = None  # torchrun rank 0's, alive while it serves


def _store(is_master: bool):
    return torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=is_master,
                                      wait_for_workers=False, timeout=STORE_TIMEOUT)


def host_group_store() -> None:
    """Torchrun rank 0 with data parallelism: host the store the groups publish their addresses in
    (torchrun's agent hosts one there already when it says so: TORCHELASTIC_USE_AGENT_STORE)."""
    global _group_store_server
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        _group_store_server = _store(is_master=True)


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what the other machines reach it by)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


def publish_group_address(group: int) -> tuple[str, int]:
    """A group's first rank: pick its rendezvous address and tell the group's other ranks."""
    host = _address_towards(os.environ["MASTER_ADDR"])
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    _store(is_master=False).set(_GROUP_KEY.format(group), f"{host}:{port}")
    return host, port


def group_address(group: int) -> tuple[str, int]:
    """The rendezvous address of ``group`` (waits until its first rank published it)."""
    host, _, port = _store(is_master=False).get(_GROUP_KEY.format(group)).decode().rpartition(":")
    return host, int(port)


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if is_orphaned(parent_pid):
            os._exit(1)  # rank 0 is gone; nothing will ever be broadcast again


def worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="paged tensor-parallel rank (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=f"%(levelname)s %(name)s (rank {args.rank}): %(message)s",
                        stream=sys.stderr)
    config = read_config_from_stdin()
    threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid,), daemon=True).start()
    return run_worker(config, args.rank, args.world_size, args.master_addr, args.master_port, args.rank)


if __name__ == "__main__":
    sys.exit(worker_main())
