"""The front-end's client for its engine-core process(es): start them, handshake, own the sockets.
See ``paged.core.ipc.engine_core_proc`` for the protocol and the process lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from paged.core.engine.child_process import spawn_child
from paged.core.engine.model_info import ModelInfo
from paged.core.errors import ConfigError
from paged.core.ipc.messages import CoreFailed, EngineDeadError, Ready, Refused, make_encoder, message_decoder

logger = logging.getLogger("paged")


# On Linux a GPU driver makes one of these (NVIDIA, Jetson's nvgpu, WSL's GPU, ROCm): where none
# exists torch.cuda finds no device, and the API server's front-end need not import torch (1 s) to
# learn it. A node too many only means asking torch.
_GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/nvhost-ctrl-gpu", "/dev/nvmap", "/dev/dxg", "/dev/kfd")


def no_gpu_driver() -> bool:
    return sys.platform == "linux" and not any(os.path.exists(node) for node in _GPU_DRIVER_NODES)


def _core_devices(config, local_index: int) -> dict[str, str]:
    """With several engine cores on GPUs, this node's ``local_index``-th core sees only its own
    ``tensor_parallel_size`` GPUs (that slice of the visible ones), so every core's ranks start at
    ``cuda:0``."""
    local = config.parallel.local_cores
    if config.parallel.data_parallel_size == 1 or config.device == "cpu" or "LOCAL_RANK" in os.environ:
        return {}  # (under torchrun each process takes the GPU of its LOCAL_RANK)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        if no_gpu_driver():
            return {}
        import torch

        if not torch.cuda.is_available():
            return {}
        visible = ",".join(str(i) for i in range(torch.cuda.device_count()))
    devices = [d for d in visible.split(",") if d.strip()]
    tp = config.parallel.tensor_parallel_size
    mine = devices[local_index * tp : (local_index + 1) * tp]
    if len(mine) < tp:
        raise ConfigError(
            f"parallel.data_parallel_size: {local} cores on this node x tensor_parallel_size {tp} "
            f"need {local * tp} GPUs; {len(devices)} are visible ({visible!r})"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


class EngineCoreClient:
    """Starts the core process(es), does the READY handshake and owns the two front-end sockets
    (zmq.asyncio: use ``send``/``recv`` from one event loop).

    With ``parallel.data_parallel_size`` N > 1 it starts N cores (ranks 0..N-1) and returns once
    all N are ready; ``procs``, ``pids``, ``identities`` and ``model_infos`` are indexed by rank.
    ``model_info`` is rank 0's with the smallest ``num_blocks`` and ``max_model_len`` of all, so a
    request the front-end accepts fits whichever core it goes to. The engine is alive while every
    core is: one dead core is a dead engine (with ``data_parallel_on_core_loss: continue``, while
    one is: see ``lost``).

    With cores on other nodes (``parallel.data_parallel_address``, see ``paged.core.ipc.nodes``)
    the sockets are TCP on that address (CURVE with ``data_parallel_keys``), this process starts
    only its node's cores (``local_ranks``; ``procs[r]`` is None for the others) and waits for
    the rest to connect; every core sends a ``Heartbeat`` each ``data_parallel_heartbeat_s`` and is
    lost after ``data_parallel_timeout_s`` without one (``note_beat``, ``core_down``); a core knows
    the front-end is gone when its connection drops (ZMTP heartbeats, in libzmq). A core whose
    fingerprint differs from rank 0's is refused (``Refused``) with a log line naming what differs."""

    def __init__(self, config, start_timeout: float = 600.0, log_level: str | None = None,
                 cancel: threading.Event | None = None) -> None:
        import zmq.asyncio

        parallel = config.parallel
        self.num_cores = parallel.data_parallel_size
        self.multi_node = parallel.multi_node
        self.keep_serving = parallel.data_parallel_on_core_loss == "continue"
        self.heartbeat_s = parallel.data_parallel_heartbeat_s
        self.timeout_s = parallel.data_parallel_timeout_s
        self.tmpdir = tempfile.mkdtemp(prefix="paged-")
        if self.multi_node:
            from paged.core.ipc.nodes import addresses, check_node_security

            check_node_security(parallel)
            self.input_addr, self.output_addr = addresses(parallel)
        else:
            self.input_addr = f"ipc://{self.tmpdir}/input"
            self.output_addr = f"ipc://{self.tmpdir}/output"
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a dead core fails, not vanishes
        self.router.setsockopt(zmq.LINGER, 0)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.authenticator = None
        self.procs: list[subprocess.Popen | None] = [None] * self.num_cores
        self.identities: list[bytes | None] = [None] * self.num_cores
        self.model_infos: list[ModelInfo | None] = [None] * self.num_cores
        self.pids: list[int | None] = [None] * self.num_cores
        self.hosts: list[str] = [""] * self.num_cores
        self.last_beat: list[float] = [0.0] * self.num_cores
        self.lost: dict[int, str] = {}  # rank -> why, for cores lost while serving (keep_serving)
        self.fingerprint = ""  # rank 0's (paged.core.ipc.nodes.fingerprint)
        self.model_info: ModelInfo | None = None
        self._closed = False
        self._last_refusal_log = -1e9
        try:
            if self.multi_node and parallel.data_parallel_keys is not None:
                from paged.core.ipc.nodes import secure_server, watch_connection

                self.authenticator = secure_server([self.router, self.pull], self.ctx, parallel.data_parallel_keys)
                for sock, what in ((self.router, "requests"), (self.pull, "outputs")):
                    watch_connection(sock, what, on_failure=self._log_refused_keys)
            self.router.bind(self.input_addr)
            self.pull.bind(self.output_addr)
        except BaseException:
            self._close_sockets()
            raise
        self.encoder = make_encoder()
        self.decoder = message_decoder()
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        args = ["--input", self.input_addr, "--output", self.output_addr, "--log-level", str(level)]
        try:
            for rank in parallel.local_ranks:
                rank_args = ["--dp-rank", str(rank)] if self.num_cores > 1 else []
                # Its own session: a terminal's Ctrl-C reaches the front-end only, which drains and
                # then stops the core (SIGTERM); if the front-end dies instead, the core notices the
                # orphaning.
                env = {"TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
                       **_core_devices(config, rank - parallel.data_parallel_start_rank)}
                self.procs[rank] = spawn_child("paged.core.ipc.engine_core_proc", args + rank_args, config, env)
            if self.multi_node and parallel.local_cores < self.num_cores:
                logger.info("waiting for data-parallel ranks %s to connect to %s (paged serve --headless on the other "
                            "nodes)", _ranks(range(parallel.local_cores, self.num_cores)), self.input_addr)
            if self.multi_node:
                start_timeout = min(start_timeout, parallel.data_parallel_start_timeout_s)
            self._handshake(start_timeout, cancel)
        except BaseException:
            self.close()
            raise

    def _log_refused_keys(self, message: str) -> None:
        """From the handshake monitors' threads; at most one line per 10 s (a refused node retries)."""
        now = time.monotonic()
        if now - self._last_refusal_log < 10:
            return
        self._last_refusal_log = now
        logger.error("an engine core tried to connect with keys this API server does not accept (%s); every node "
                     "needs the same --data-parallel-keys folder", message)

    def _which(self, rank: int) -> str:
        """' (data-parallel rank R)' when there are several cores, else ''."""
        if self.num_cores == 1:
            return ""
        return f" (data-parallel rank {rank}{f' on {self.hosts[rank]}' if self.hosts[rank] else ''})"

    def _handshake(self, timeout: float, cancel: threading.Event | None) -> None:
        sync = zmq.Socket.shadow(self.router.underlying)
        deadline = time.monotonic() + timeout
        waiting = set(range(self.num_cores))
        pending: list[tuple[bytes, Ready]] = []  # READYs that wait for rank 0's fingerprint
        while waiting:
            if sync.poll(100):
                identity, payload = sync.recv_multipart()
                msg = self.decoder.decode(payload)
                if isinstance(msg, CoreFailed):
                    if 0 <= msg.dp_rank < self.num_cores and self.procs[msg.dp_rank] is not None:
                        self.procs[msg.dp_rank].wait(30)
                    if msg.config_error:  # as if this process had checked the settings itself
                        raise ConfigError(f"{msg.message}{self._which(msg.dp_rank)}")
                    raise EngineDeadError(f"the engine core{self._which(msg.dp_rank)} failed to start: {msg.message}")
                if not isinstance(msg, Ready):
                    raise EngineDeadError(f"engine core handshake: expected READY, got {type(msg).__name__}")
                pending.append((identity, msg))
                if msg.dp_rank == 0:
                    self.fingerprint = msg.fingerprint
                if self.fingerprint or not self.multi_node:
                    for identity, ready in pending:
                        if self._take(sync, identity, ready, waiting):
                            waiting.discard(ready.dp_rank)
                    pending = []
                continue
            now = time.monotonic()
            for rank, proc in enumerate(self.procs):
                code = proc.poll() if proc is not None else None
                if code is not None:
                    raise EngineDeadError(f"the engine core process{self._which(rank)} exited with code {code} "
                                          f"during start-up (see its log above)")
            if now > deadline:
                if self.multi_node and any(self.procs[r] is None for r in waiting):
                    raise EngineDeadError(
                        f"data-parallel ranks {_ranks(sorted(waiting))} did not connect to {self.input_addr} within "
                        f"{timeout:.0f} s (start them with paged serve --headless --data-parallel-start-rank R on "
                        f"their nodes, with the same keys and settings)")
                raise EngineDeadError(f"the engine core{'s' if self.num_cores > 1 else ''} did not become ready "
                                      f"within {timeout:.0f} s")
            if cancel is not None and cancel.is_set():
                raise EngineDeadError("engine start-up cancelled")
        infos = self.model_infos
        self.model_info = dataclasses.replace(
            infos[0], num_blocks=min(i.num_blocks for i in infos), max_model_len=min(i.max_model_len for i in infos)
        )
        now = time.monotonic()
        self.last_beat = [now] * self.num_cores

    def _take(self, sock, identity: bytes, ready: Ready, waiting: set[int]) -> bool:
        """Accept a core's READY, or refuse it (a rank not expected, a fingerprint unlike rank 0's)."""
        from paged.core.ipc.nodes import fingerprint_difference

        rank = ready.dp_rank
        reason = None
        if not 0 <= rank < self.num_cores:
            reason = f"data-parallel rank {rank} is not among 0 .. {self.num_cores - 1} (parallel.data_parallel_size)"
        elif rank not in waiting and rank not in self.lost:
            reason = f"data-parallel rank {rank} is served already (by {self.hosts[rank] or 'this node'})"
        elif self.multi_node and ready.fingerprint != self.fingerprint:
            reason = (f"its model or settings differ from data-parallel rank 0's: "
                      f"{fingerprint_difference(self.fingerprint, ready.fingerprint)}")
        if reason is not None:
            logger.error("refused the engine core of data-parallel rank %d on %s (pid %d): %s", rank,
                         ready.host or "?", ready.pid, reason)
            sock.send_multipart([identity, self.encoder.encode(Refused(reason))])
            return False
        self.identities[rank] = identity
        self.model_infos[rank] = ready.model_info
        self.pids[rank] = ready.pid
        self.hosts[rank] = ready.host
        self.last_beat[rank] = time.monotonic()
        return True

    # Rank 0's process, pid and identity: all there is with one core.
    @property
    def proc(self) -> subprocess.Popen:
        return self.procs[0]

    @property
    def pid(self) -> int | None:
        return self.pids[0]

    @property
    def identity(self) -> bytes | None:
        return self.identities[0]

    # --- liveness -----------------------------------------------------------------------------
    def core_down(self, rank: int) -> str | None:
        """Why the core of ``rank`` is gone (its process exited; over tcp, no heartbeat for
        ``data_parallel_timeout_s``), or None while it runs."""
        if rank in self.lost:
            return self.lost[rank]
        proc = self.procs[rank]
        code = proc.poll() if proc is not None else None
        if code is not None:
            where = f"pid {proc.pid}" if self.num_cores == 1 else f"pid {proc.pid}, data-parallel rank {rank}"
            if code == 0:
                return f"the engine core process ({where}) has exited"
            return f"the engine core process ({where}) died (exit code {code})"
        if self.multi_node and self.model_info is not None:
            silent = time.monotonic() - self.last_beat[rank]
            if silent > self.timeout_s:
                return (f"the engine core of data-parallel rank {rank}{f' on {self.hosts[rank]}' if self.hosts[rank] else ''}"
                        f" sent nothing for {silent:.1f} s (parallel.data_parallel_timeout_s): its process or node is "
                        "lost")
        return None

    def note_beat(self, rank: int) -> None:
        """A core's heartbeat arrived."""
        if 0 <= rank < self.num_cores:
            self.last_beat[rank] = time.monotonic()

    def live_ranks(self) -> list[int]:
        return [rank for rank in range(self.num_cores) if rank not in self.lost]

    @property
    def alive(self) -> bool:
        """The engine serves: every core runs (with ``data_parallel_on_core_loss: continue``, at
        least one that was not lost)."""
        if self._closed:
            return False
        if self.keep_serving:
            return any(self.core_down(rank) is None for rank in self.live_ranks())
        return all(self.core_down(rank) is None for rank in range(self.num_cores))

    @property
    def closed(self) -> bool:
        """``close``/``aclose`` was called (a socket error after that is expected)."""
        return self._closed

    def mark_lost(self, rank: int, reason: str) -> None:
        """Serve without this core from now on (``keep_serving``); it may rejoin (``rejoin``)."""
        self.lost[rank] = reason
        proc = self.procs[rank]
        if proc is not None and proc.poll() is None:
            proc.terminate()

    def rejoin(self, identity: bytes, ready: Ready) -> bool:
        """A READY after start-up: a lost core back (a node restarted); True once it serves again."""
        if ready.dp_rank not in self.lost:
            self._take(zmq.Socket.shadow(self.router.underlying), identity, ready, set())
            return False
        if not self._take(zmq.Socket.shadow(self.router.underlying), identity, ready, set()):
            return False
        del self.lost[ready.dp_rank]
        self.procs[ready.dp_rank] = None  # a process of another node (or another start), not ours
        logger.warning("data-parallel rank %d%s rejoined: serving on %d of %d cores", ready.dp_rank,
                       f" on {ready.host}" if ready.host else "", len(self.live_ranks()), self.num_cores)
        return True

    # --- sending ------------------------------------------------------------------------------
    async def send(self, msg, core: int = 0) -> None:
        """Send to the core of rank ``core``."""
        if not self.alive or core in self.lost:
            raise EngineDeadError(self.death_message() if core not in self.lost else self.lost[core])
        try:
            await self.router.send_multipart([self.identities[core], self.encoder.encode(msg)])
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core{self._which(core)}: {e}") from None

    def send_nowait(self, msg, core: int = 0) -> None:
        """Fire-and-forget (aborts from a finally block); a dead core is ignored."""
        if self._closed or core in self.lost:
            return
        try:
            fut = self.router.send_multipart([self.identities[core], self.encoder.encode(msg)])
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        except zmq.ZMQError:
            pass

    def death_message(self) -> str:
        if self._closed:
            return "the engine is shut down"
        for rank in range(self.num_cores):
            reason = self.core_down(rank)
            if reason is not None:
                return reason
        return "the engine core is not responding"

    def terminate(self) -> None:
        """SIGTERM every core of this node still running, without waiting; the sockets stay open
        (``close`` reaps the processes later). For the survivors of a dead core: the engine is
        dead, and they would only finish requests nobody waits for. Cores on other nodes notice
        that the front-end stops pinging them."""
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the cores (SIGTERM to all, then SIGKILL to what is left) and close the sockets;
        idempotent. Blocks while the cores exit: from an event loop, use ``aclose``."""
        if self._closed:
            return
        self._closed = True
        self._stop_processes(timeout)
        self._close_sockets()

    async def aclose(self, timeout: float = 10.0) -> None:
        """``close`` without blocking the event loop: the cores are waited for in a thread. Call it
        from the loop that uses the sockets, once nothing awaits them."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._stop_processes, timeout)
        self._close_sockets()

    def _stop_processes(self, timeout: float) -> None:
        running = [proc for proc in getattr(self, "procs", []) if proc is not None and proc.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in running:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def _close_sockets(self) -> None:
        for sock in (self.router, self.pull):
            sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)
