"""The engine core in its own process, the messages it exchanges with a front-end, and the
front-end's client for it.

Wire protocol (ZeroMQ + msgspec msgpack; nothing is ever pickled, the process start included)::

    front-end ROUTER (bind, ipc)  <---- DEALER (connect) core   requests in; READY handshake
    front-end PULL   (bind, ipc)  <---- PUSH   (connect) core   outputs, utility results, errors

With data parallelism (``parallel.data_parallel_size`` N > 1, ``paged serve`` only) N core
processes, ranks 0..N-1, each a whole engine core with its own KV cache, connect to the same two
sockets: each DEALER has its own identity (``core-<rank>-<pid>``), which the ROUTER learns from
that core's READY, and all PUSH to the one PULL (request ids are unique, so an output needs no
sender). The front-end sends each request to one core (``paged.core.frontend.dp_router``) and utility
calls to every core.

Front-end -> core (``CoreRequest``, a tagged union): ``AddRequest``, ``AbortRequests``,
``UtilityCall`` (``stats``, ``reset_prefix_cache``, ``ping``).
Core -> front-end (``CoreMessage``): ``Ready`` (once, over the DEALER, after the model and the KV
cache are up), ``Outputs`` (one per engine step that produced something), ``UtilityResult``,
``RequestFailed`` (the core rejected an added request), ``CoreFailed`` (a fatal error; the core
exits right after).

Process: ``python -m paged.core.ipc.engine_core_proc --input ADDR --output ADDR --parent-pid PID
[--dp-rank R]`` with the configuration as JSON (``EngineConfig.model_dump``) on stdin. Inside,
an input thread decodes requests into a queue, the main thread runs the busy loop (step while
there is work, block on the queue when idle) and an output thread encodes and sends. The core
exits on SIGINT/SIGTERM and when its parent goes away (``os.getppid()`` changes). It runs in its
own session, so a terminal's Ctrl-C goes to the front-end alone, which drains its connections and
then stops the core(s) with SIGTERM (SIGKILL after a timeout). The front-end detects a dead core
by polling the processes (``Popen.poll``) whenever its output socket is quiet and, with several
cores, every 0.2 s while it is busy (another core may keep it busy), and fails the pending
requests with ``EngineDeadError``: one dead core is a dead engine (the front-end stops the rest).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Union

import msgspec
import zmq

from paged.core.config import for_child_process
from paged.core.engine.engine_core import EngineCoreOutput, ModelInfo
from paged.core.errors import PagedError, RequestRejectedError
from paged.core.engine.sampler import TokenLogprobs
from paged.core.sampling_params import SamplingParams

logger = logging.getLogger("paged")


class EngineDeadError(PagedError):
    """The engine core process is not running (it died, or it has not started)."""


# --- messages ------------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    eos_token_id: int | None = None
    max_tokens: int = 16
    tenant: str | None = None
    deadline: float | None = None  # absolute, time.monotonic() (the same clock in every process)


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]
    status: str = "abort"  # "abort" (client went away) | "stop" (a stop string ended it)


class UtilityCall(msgspec.Struct, tag="utility", array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


CoreRequest = Union[AddRequest, AbortRequests, UtilityCall]


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """``EngineCoreOutput`` on the wire."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_token_id: int | None = None
    logprobs: list[TokenLogprobs] = []
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    reject_reason: str | None = None


class Ready(msgspec.Struct, tag="ready", array_like=True):
    model_info: ModelInfo
    pid: int
    dp_rank: int = 0


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[CoreOutput]
    timestamp: float  # time.monotonic() in the core when the step ended (same clock in every process)


class UtilityResult(msgspec.Struct, tag="utility_result", array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class RequestFailed(msgspec.Struct, tag="failed", array_like=True):
    request_id: str
    message: str
    invalid: bool = True  # an InvalidRequestError (the client's fault) rather than an internal error
    http_status: int = 0  # 429 / 503: the policy's admission control rejected it (RequestRejectedError)


class CoreFailed(msgspec.Struct, tag="dead", array_like=True):
    message: str
    dp_rank: int = 0


CoreMessage = Union[Ready, Outputs, UtilityResult, RequestFailed, CoreFailed]

_FIELDS = [f.name for f in dataclasses.fields(EngineCoreOutput)]


def output_to_wire(out: EngineCoreOutput) -> CoreOutput:
    return CoreOutput(**{name: getattr(out, name) for name in _FIELDS})


def output_from_wire(out: CoreOutput) -> EngineCoreOutput:
    return EngineCoreOutput(**{name: getattr(out, name) for name in _FIELDS})


def request_to_wire(request) -> AddRequest:
    """A ``paged.core.engine.request.Request`` (as the InputProcessor builds it) as an AddRequest."""
    return AddRequest(
        request.request_id, list(request.prompt_token_ids), request.sampling_params, request.arrival_time,
        request.priority, request.cache_salt, request.eos_token_id, request.max_tokens, request.tenant,
        request.deadline,
    )


def request_from_wire(msg: AddRequest):
    from paged.core.engine.request import Request

    return Request(
        msg.request_id, msg.prompt_token_ids, msg.sampling_params, arrival_time=msg.arrival_time,
        priority=msg.priority, cache_salt=msg.cache_salt, eos_token_id=msg.eos_token_id, max_tokens=msg.max_tokens,
        tenant=msg.tenant, deadline=msg.deadline,
    )


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def request_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreRequest)


def message_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreMessage)


# --- the core process ----------------------------------------------------------------------------
_PARENT_CHECK_S = 1.0
_IDLE_WAIT_S = 0.5


class EngineCoreProc:
    """Runs an EngineCore behind two sockets until told to stop or orphaned."""

    def __init__(self, config, input_addr: str, output_addr: str, parent_pid: int, dp_rank: int = 0) -> None:
        self.config = config
        self.input_addr = input_addr
        self.output_addr = output_addr
        self.parent_pid = parent_pid
        self.dp_rank = dp_rank
        self.num_requests_added = 0  # reported by `stats`: shows which data-parallel core served what
        self.stop = threading.Event()
        self.in_q: queue.Queue = queue.Queue()
        self.out_q: queue.Queue = queue.Queue()
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 1000)
        self.dealer.setsockopt(zmq.IDENTITY, f"core-{dp_rank}-{os.getpid()}".encode())
        self.dealer.connect(input_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(output_addr)
        self.encoder = make_encoder()
        self.core = None

    # I/O threads: all (de)serialisation happens here, off the step.
    def _input_thread(self) -> None:
        decoder = request_decoder()
        while not self.stop.is_set():
            try:
                if not self.dealer.poll(100):
                    continue
                frames = self.dealer.recv_multipart()
            except zmq.ZMQError:
                if self.stop.is_set():
                    return
                raise
            try:
                self.in_q.put(decoder.decode(frames[-1]))
            except msgspec.DecodeError as e:
                logger.error("core: dropping an undecodable message: %s", e)

    def _output_thread(self) -> None:
        encoder = make_encoder()
        while True:
            item = self.out_q.get()
            if item is None:
                return
            if isinstance(item, tuple):  # (engine core outputs, timestamp): convert here, not in the loop
                outputs, timestamp = item
                item = Outputs([output_to_wire(o) for o in outputs], timestamp)
            self.push.send(encoder.encode(item))

    def _orphaned(self) -> bool:
        return os.getppid() != self.parent_pid

    def _handle(self, msg) -> None:
        from paged.core.engine.request import RequestStatus

        core = self.core
        if isinstance(msg, AddRequest):
            try:
                core.add_request(request_from_wire(msg))
                self.num_requests_added += 1
            except RequestRejectedError as e:
                self.out_q.put(RequestFailed(msg.request_id, str(e), invalid=False, http_status=e.http_status))
            except PagedError as e:
                self.out_q.put(RequestFailed(msg.request_id, str(e), invalid=isinstance(e, ValueError)))
            except Exception as e:  # a bad request must not take the core down
                logger.exception("core: add_request(%s) failed", msg.request_id)
                self.out_q.put(RequestFailed(msg.request_id, f"{type(e).__name__}: {e}", invalid=False))
        elif isinstance(msg, AbortRequests):
            status = RequestStatus.FINISHED_STOPPED if msg.status == "stop" else RequestStatus.FINISHED_ABORTED
            core.abort_requests(msg.request_ids, status)
        elif isinstance(msg, UtilityCall):
            try:
                result = self._utility(msg.method, msg.args)
                self.out_q.put(UtilityResult(msg.call_id, result))
            except Exception as e:
                self.out_q.put(UtilityResult(msg.call_id, None, f"{type(e).__name__}: {e}"))

    def _utility(self, method: str, args: list) -> Any:
        core = self.core
        if method == "stats":
            stats = dataclasses.asdict(core.snapshot_stats())
            kv = core.kv_cache_manager
            stats.update(num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks, pid=os.getpid(),
                         num_requests_added=self.num_requests_added)
            return stats
        if method == "reset_prefix_cache":
            return core.kv_cache_manager.reset_prefix_cache()
        if method == "ping":
            return "pong"
        raise ValueError(f"unknown utility method {method!r}")

    def run(self) -> int:
        from paged.core.engine.engine_core import EngineCore

        try:
            self.core = EngineCore(self.config)
        except BaseException as e:
            message = f"{type(e).__name__}: {e}"
            logger.error("core: start-up failed: %s", message)
            if not isinstance(e, PagedError):
                traceback.print_exc()
            self.dealer.send(self.encoder.encode(CoreFailed(message, self.dp_rank)))
            self.close()
            return 1
        if self.stop.is_set() or self._orphaned():
            if self._orphaned():
                self._remove_orphaned_ipc_dir()
            self.close()
            return 0
        # Handshake: READY only once the model and the KV cache are up.
        self.dealer.send(self.encoder.encode(Ready(self.core.model_info, os.getpid(), self.dp_rank)))
        threads = [
            threading.Thread(target=self._input_thread, name="core-input", daemon=True),
            threading.Thread(target=self._output_thread, name="core-output", daemon=True),
        ]
        for t in threads:
            t.start()
        code = 0
        try:
            self._busy_loop()
        except Exception as e:
            logger.exception("core: fatal error in the engine loop")
            self.out_q.put(CoreFailed(f"{type(e).__name__}: {e}", self.dp_rank))
            code = 1
        self.stop.set()
        self.out_q.put(None)
        for t in threads:
            t.join(timeout=5)
        self.close()
        return code

    def _busy_loop(self) -> None:
        core, in_q = self.core, self.in_q
        next_check = time.monotonic() + _PARENT_CHECK_S
        while not self.stop.is_set():
            if not core.has_unfinished_requests():
                try:
                    self._handle(in_q.get(timeout=_IDLE_WAIT_S))  # idle: block on input
                except queue.Empty:
                    pass
            while True:
                try:
                    self._handle(in_q.get_nowait())
                except queue.Empty:
                    break
            if core.has_unfinished_requests():
                outputs = core.step()
                if outputs:
                    self.out_q.put((outputs, time.monotonic()))
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _PARENT_CHECK_S
                if self._orphaned():
                    logger.warning("core: the front-end process is gone; exiting")
                    self._remove_orphaned_ipc_dir()
                    return

    def _remove_orphaned_ipc_dir(self) -> None:
        """The front-end died without cleaning up: remove its private ipc directory."""
        paths = {a[len("ipc://"):] for a in (self.input_addr, self.output_addr) if a.startswith("ipc://")}
        dirs = {os.path.dirname(p) for p in paths}
        if len(dirs) == 1:
            d = dirs.pop()
            if os.path.basename(d).startswith("paged-"):
                shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        if self.core is not None:
            self.core.shutdown()  # its tensor-parallel ranks, if any
        for sock in (self.dealer, self.push):
            try:
                sock.close()
            except Exception:
                pass
        self.ctx.term()


def core_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="paged engine core process (started by the front-end)")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--dp-rank", type=int, default=None, help="data-parallel rank (only when there are several)")
    args = parser.parse_args(argv)
    label = "core" if args.dp_rank is None else f"core {args.dp_rank}"
    logging.basicConfig(level=args.log_level, format=f"%(levelname)s %(name)s ({label}): %(message)s",
                        stream=sys.stderr)
    from paged.core.config import EngineConfig

    data = json.loads(sys.stdin.read())
    config = EngineConfig(**data)
    proc = EngineCoreProc(config, args.input, args.output, args.parent_pid, args.dp_rank or 0)

    def _stop(signum, frame):  # noqa: ARG001
        proc.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return proc.run()


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
        from paged.core.errors import ConfigError

        raise ConfigError(
            f"parallel.data_parallel_size: {config.parallel.data_parallel_size} cores x tensor_parallel_size {tp} "
            f"need {config.parallel.data_parallel_size * tp} GPUs; {len(devices)} are visible ({visible!r})"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


# --- the front-end's client ----------------------------------------------------------------------
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
        payload, env = for_child_process(config)
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        cmd = [sys.executable, "-m", "paged.core.ipc.engine_core_proc", "--input", self.input_addr,
               "--output", self.output_addr, "--parent-pid", str(os.getpid()), "--log-level", str(level)]
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            for rank in range(self.num_cores):
                rank_args = ["--dp-rank", str(rank)] if self.num_cores > 1 else []
                # Its own session: a terminal's Ctrl-C reaches the front-end only, which drains and
                # then stops the core (SIGTERM); if the front-end dies instead, the core notices the
                # orphaning.
                core_env = dict(env, **_core_devices(config, rank))
                proc = subprocess.Popen(cmd + rank_args, stdin=subprocess.PIPE, env=core_env, start_new_session=True)
                self.procs.append(proc)
                proc.stdin.write(payload)
                proc.stdin.close()
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
        idempotent."""
        if self._closed:
            return
        self._closed = True
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
        for sock in (self.router, self.pull):
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(core_main())
