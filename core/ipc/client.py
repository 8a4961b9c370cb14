"""The front-end's client for its engine-core process(es): start them, handshake, own the sockets.
See ``paged.core.ipc.engine_core_proc`` for the protocol and the process lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time

import zmq

from paged.core.engine.child_process import spawn_child
from paged.core.engine.model_info import ModelInfo
from paged.core.errors import ConfigError
from paged.core.ipc.messages import CoreFailed, EngineDeadError, Ready, make_encoder, message_decoder

logger = logging.getLogger("paged")


def _core_devices(config, dp_rank: int) -> dict[str, str]:
    """With several engine cores on GPUs, core ``r`` sees only its own ``tensor_parallel_size``
    GPUs (the ``r``-th slice of the visible ones), so every core's ranks start at ``cuda:0``."""
    if config.parallel.data_parallel_size == 1 or config.device == "cpu":
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        import torch

        if not torch.cuda.is_available():
            return {}
        visible = ",".join(str(i) for i in range(torch.cuda.device_count()))
    devices = [d for d in visible.split(",") if d.strip()]
    tp = config.parallel.tensor_parallel_size
    mine = devices[dp_rank * tp : (dp_rank + 1) * tp]
    if len(mine) < tp:
        raise ConfigError(
            f"parallel.data_parallel_size: {config.parallel.data_parallel_size} cores x tensor_parallel_size {tp} "
            f"need {config.parallel.data_parallel_size * tp} GPUs; {len(devices)} are visible ({visible!r})"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


class EngineCoreClient:
    """Starts the core process(es), does the READY handshake and owns the two front-end sockets
    (zmq.asyncio: use ``send``/``recv`` from one event loop).

    With ``parallel.data_parallel_size`` N > 1 it starts N cores (ranks 0..N-1) and returns once
    all N are ready; ``procs``, ``pids``, ``identities`` and ``model_infos`` are indexed by rank.
    ``model_info`` is rank 0's with the smallest ``num_blocks`` and ``max_model_len`` of all, so a
    request the front-end accepts fits whichever core it goes to. The engine is alive while every
    core is: one dead core is a dead engine."""

    def __init__(self, config, start_timeout: float = 600.0, log_level: str | None = None,
                 cancel: threading.Event | None = None) -> None:
        import zmq.asyncio

        self.num_cores = config.parallel.data_parallel_size
        self.tmpdir = tempfile.mkdtemp(prefix="paged-")
        self.input_addr = f"ipc://{self.tmpdir}/input"
        self.output_addr = f"ipc://{self.tmpdir}/output"
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a dead core fails, not vanishes
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.input_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(self.output_addr)
        self.encoder = make_encoder()
        self.decoder = message_decoder()
        self.procs: list[subprocess.Popen] = []
        self.identities: list[bytes | None] = [None] * self.num_cores
        self.model_infos: list[ModelInfo | None] = [None] * self.num_cores
        self.pids: list[int | None] = [None] * self.num_cores
        self.model_info: ModelInfo | None = None
        self._closed = False
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        args = ["--input", self.input_addr, "--output", self.output_addr, "--log-level", str(level)]
        try:
            for rank in range(self.num_cores):
                rank_args = ["--dp-rank", str(rank)] if self.num_cores > 1 else []
                # Its own session: a terminal's Ctrl-C reaches the front-end only, which drains and
                # then stops the core (SIGTERM); if the front-end dies instead, the core notices the
                # orphaning.
                env = {"TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
                       **_core_devices(config, rank)}
                self.procs.append(spawn_child("paged.core.ipc.engine_core_proc", args + rank_args, config, env))
            self._handshake(start_timeout, cancel)
        except BaseException:
            self.close()
            raise

    def _which(self, rank: int) -> str:
        """' (data-parallel rank R)' when there are several cores, else ''."""
        return f" (data-parallel rank {rank})" if self.num_cores > 1 else ""

    def _handshake(self, timeout: float, cancel: threading.Event | None) -> None:
        sync = zmq.Socket.shadow(self.router.underlying)
        deadline = time.monotonic() + timeout
        waiting = set(range(self.num_cores))
        while waiting:
            if sync.poll(100):
                identity, payload = sync.recv_multipart()
                msg = self.decoder.decode(payload)
                if isinstance(msg, CoreFailed):
                    if 0 <= msg.dp_rank < self.num_cores:
                        self.procs[msg.dp_rank].wait(30)
                    raise EngineDeadError(f"the engine core{self._which(msg.dp_rank)} failed to start: {msg.message}")
                if not isinstance(msg, Ready):
                    raise EngineDeadError(f"engine core handshake: expected READY, got {type(msg).__name__}")
                if msg.dp_rank not in waiting:
                    raise EngineDeadError(f"engine core handshake: unexpected READY from rank {msg.dp_rank}")
                waiting.discard(msg.dp_rank)
                self.identities[msg.dp_rank] = identity
                self.model_infos[msg.dp_rank] = msg.model_info
                self.pids[msg.dp_rank] = msg.pid
                continue
            for rank, proc in enumerate(self.procs):
                code = proc.poll()
                if code is not None:
                    raise EngineDeadError(f"the engine core process{self._which(rank)} exited with code {code} "
                                          f"during start-up (see its log above)")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine core{'s' if self.num_cores > 1 else ''} did not become ready "
                                      f"within {timeout:.0f} s")
            if cancel is not None and cancel.is_set():
                raise EngineDeadError("engine start-up cancelled")
        infos = self.model_infos
        self.model_info = dataclasses.replace(
            infos[0], num_blocks=min(i.num_blocks for i in infos), max_model_len=min(i.max_model_len for i in infos)
        )

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

    @property
    def alive(self) -> bool:
        return not self._closed and all(proc.poll() is None for proc in self.procs)

    @property
    def closed(self) -> bool:
        """``close``/``aclose`` was called (a socket error after that is expected)."""
        return self._closed

    async def send(self, msg, core: int = 0) -> None:
        """Send to the core of rank ``core``."""
        if not self.alive:
            raise EngineDeadError(self.death_message())
        try:
            await self.router.send_multipart([self.identities[core], self.encoder.encode(msg)])
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core{self._which(core)}: {e}") from None

    def send_nowait(self, msg, core: int = 0) -> None:
        """Fire-and-forget (aborts from a finally block); a dead core is ignored."""
        if not self.alive:
            return
        try:
            fut = self.router.send_multipart([self.identities[core], self.encoder.encode(msg)])
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        except zmq.ZMQError:
            pass

    def death_message(self) -> str:
        if self._closed:
            return "the engine is shut down"
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is None:
                continue
            where = f"pid {proc.pid}" if self.num_cores == 1 else f"pid {proc.pid}, data-parallel rank {rank}"
            if code == 0:
                return f"the engine core process ({where}) has exited"
            return f"the engine core process ({where}) died (exit code {code})"
        return "the engine core is not responding"

    def terminate(self) -> None:
        """SIGTERM every core still running, without waiting; the sockets stay open (``close``
        reaps the processes later). For the survivors of a dead core: the engine is dead, and they
        would only finish requests nobody waits for."""
        for proc in self.procs:
            if proc.poll() is None:
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
        running = [proc for proc in getattr(self, "procs", []) if proc.poll() is None]
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
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
