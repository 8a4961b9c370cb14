"""The engine core in its own process.

Wire protocol (ZeroMQ + msgspec msgpack; nothing is ever pickled, the process start included)::

    front-end ROUTER (bind, ipc)  <---- DEALER (connect) core   requests in; READY handshake
    front-end PULL   (bind, ipc)  <---- PUSH   (connect) core   outputs, utility results, errors

With data parallelism (``parallel.data_parallel_size`` N > 1, ``paged serve`` only) N core
processes, ranks 0..N-1, each a whole engine core with its own KV cache, connect to the same two
sockets: each DEALER has its own identity (``core-<rank>-<pid>``), which the ROUTER learns from
that core's READY, and all PUSH to the one PULL (request ids are unique, so an output needs no
sender). The front-end sends each request to one core (``paged.core.frontend.dp_router``) and utility
calls to every core.

On several machines (``parallel.data_parallel_address``) the two sockets are TCP on that address
instead, CURVE-encrypted with ``data_parallel_keys``, and the cores of other nodes (``paged serve
--headless``, ``paged.core.ipc.headless``) connect to them as the local ones do; each core then
sends a ``Heartbeat`` every ``data_parallel_heartbeat_s`` and exits when its connection to the
front-end has been down for ``data_parallel_timeout_s`` (``paged.core.ipc.nodes``).

The messages are in ``paged.core.ipc.messages``; the front-end's side is
``paged.core.ipc.client.EngineCoreClient``.

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
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from paged.core.engine.child_process import is_orphaned, read_config_from_stdin
from paged.core.errors import ConfigError, EngineError, PagedError, RequestRejectedError
from paged.core.lora import LoRARequest
from paged.core.ipc.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    CoreFailed,
    Heartbeat,
    Outputs,
    Ready,
    Refused,
    RequestFailed,
    UtilityCall,
    UtilityResult,
    make_encoder,
    request_decoder,
)

logger = logging.getLogger("paged")


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
        self.exit_code = 0  # set by a refusal (keys, fingerprint) before stop
        self.in_q: queue.Queue = queue.Queue()
        self.out_q: queue.Queue = queue.Queue()
        parallel = config.parallel
        # Over tcp (parallel.data_parallel_address): this core sends a Heartbeat every heartbeat_s
        # (the output thread); it knows the API server is gone when its connection has been down
        # for timeout_s (libzmq's ZMTP heartbeats drop a connection whose peer stops answering).
        self.multi_node = input_addr.startswith("tcp://")
        self.heartbeat_s = parallel.data_parallel_heartbeat_s
        self.timeout_s = parallel.data_parallel_timeout_s
        self.down_since: float | None = None  # the connection to the API server is down since then
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 1000)
        self.dealer.setsockopt(zmq.IDENTITY, f"core-{dp_rank}-{os.getpid()}".encode())
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        if self.multi_node:
            from paged.core.ipc.nodes import secure_client, watch_connection

            for sock in (self.dealer, self.push):
                sock.setsockopt(zmq.HEARTBEAT_IVL, int(1000 * self.heartbeat_s))
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(1000 * self.timeout_s))
                if parallel.data_parallel_keys is not None:
                    secure_client(sock, parallel.data_parallel_keys)
            watch_connection(self.dealer, "requests", self._refused_keys, self._up, self._down)
            if parallel.data_parallel_keys is not None:
                watch_connection(self.push, "outputs", self._refused_keys)
        self.dealer.connect(input_addr)
        self.push.connect(output_addr)
        self.encoder = make_encoder()
        self.core = None

    def _up(self) -> None:
        self.down_since = None

    def _down(self) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()

    def _refused(self, message: str) -> None:
        """The API server does not take this core: log why and stop (exit code 3)."""
        if self.exit_code:
            return
        logger.error("core: %s", message)
        self.exit_code = 3
        self.stop.set()

    def _refused_keys(self, message: str) -> None:
        self._refused(f"the API server at {self.input_addr} refused this node's keys: {message}; every node needs "
                      "the same --data-parallel-keys folder (paged keys DIR)")
        if self.core is None:  # still loading the model: stop that too
            import _thread

            _thread.interrupt_main()

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
                msg = decoder.decode(frames[-1])
            except msgspec.DecodeError as e:
                logger.error("core: dropping an undecodable message: %s", e)
                continue
            if isinstance(msg, Refused):
                self._refused(f"the API server refused this core (data-parallel rank {self.dp_rank}): {msg.reason}")
                continue
            self.in_q.put(msg)

    def _output_thread(self) -> None:
        encoder = make_encoder()
        beat = encoder.encode(Heartbeat(self.dp_rank)) if self.multi_node else None
        next_beat = time.monotonic()
        while True:
            if beat is None:
                item = self.out_q.get()
            else:  # a beat at least every heartbeat_s, busy or not (the step runs on another thread)
                now = time.monotonic()
                if now >= next_beat:
                    self.push.send(beat)
                    next_beat = now + self.heartbeat_s
                try:
                    item = self.out_q.get(timeout=max(next_beat - now, 0.001))
                except queue.Empty:
                    continue
            if item is None:
                return
            if isinstance(item, tuple):  # (engine core outputs, timestamp): convert here, not in the loop
                outputs, timestamp = item
                item = Outputs(outputs, timestamp)
            self.push.send(encoder.encode(item))

    def _orphaned(self) -> bool:
        return is_orphaned(self.parent_pid)

    def _handle(self, msg) -> None:
        from paged.core.engine.request import RequestStatus

        core = self.core
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AddRequests):
            for request in msg.requests:
                self._add(request)
        elif isinstance(msg, AbortRequests):
            status = RequestStatus.FINISHED_STOPPED if msg.status == "stop" else RequestStatus.FINISHED_ABORTED
            core.abort_requests(msg.request_ids, status)
        elif isinstance(msg, UtilityCall):
            try:
                result = self._utility(msg.method, msg.args)
                self.out_q.put(UtilityResult(msg.call_id, result))
            except Exception as e:
                self.out_q.put(UtilityResult(msg.call_id, None, f"{type(e).__name__}: {e}"))

    def _add(self, msg: AddRequest) -> None:
        try:
            self.core.add_request(msg)  # the core builds its Request from the decoded message
            self.num_requests_added += 1
        except RequestRejectedError as e:
            self.out_q.put(RequestFailed(msg.request_id, str(e), invalid=False, http_status=e.http_status))
        except PagedError as e:
            self.out_q.put(RequestFailed(msg.request_id, str(e), invalid=isinstance(e, ValueError)))
        except Exception as e:  # a bad request must not take the core down
            logger.exception("core: add_request(%s) failed", msg.request_id)
            self.out_q.put(RequestFailed(msg.request_id, f"{type(e).__name__}: {e}", invalid=False))

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
        if method == "add_lora":  # (name, id, path): read and checked now; an error names file and field
            return core.add_lora(LoRARequest(*args))
        if method == "remove_lora":
            return core.remove_lora(int(args[0]))
        if method == "list_loras":
            return [list(msgspec.structs.astuple(r)) for r in core.list_loras()]
        if method == "ping":
            return "pong"
        raise ValueError(f"unknown utility method {method!r}")

    def run(self) -> int:
        from paged.core.engine.engine_core import EngineCore

        try:
            self.core = EngineCore(self.config)
        except BaseException as e:
            if self.exit_code:  # refused while loading (its keys): logged already
                self.close()
                return self.exit_code
            message = f"{type(e).__name__}: {e}"
            logger.error("core: start-up failed: %s", message)
            if not isinstance(e, PagedError):
                traceback.print_exc()
            bad_settings = isinstance(e, ConfigError)
            if bad_settings:  # the front-end reports it as its own: the message names the field
                message = str(e)
            self.dealer.send(self.encoder.encode(CoreFailed(message, self.dp_rank, bad_settings)))
            self.close()
            return 2 if bad_settings else 1  # 2 for bad settings, as the CLI's (a headless node passes it on)
        if self.stop.is_set() or self._orphaned():
            if self._orphaned():
                self._remove_orphaned_ipc_dir()
            self.close()
            return self.exit_code
        # Handshake: READY only once the model and the KV cache are up.
        from paged.core.ipc.nodes import fingerprint, hostname

        core = self.core
        mark = fingerprint(self.config, core.model_info, str(core.model_config.dtype).removeprefix("torch."))
        self.dealer.send(self.encoder.encode(Ready(core.model_info, os.getpid(), self.dp_rank, hostname(), mark)))
        threads = [
            threading.Thread(target=self._input_thread, name="core-input", daemon=True),
            threading.Thread(target=self._output_thread, name="core-output", daemon=True),
        ]
        for t in threads:
            t.start()
        code = 0
        try:
            self._busy_loop()
        except EngineError as e:  # a plugin or the engine failed in a step: already logged, with its traceback
            self.out_q.put(CoreFailed(str(e), self.dp_rank))
            code = 1
        except Exception as e:
            logger.exception("core: fatal error in the engine loop")
            self.out_q.put(CoreFailed(f"{type(e).__name__}: {e}", self.dp_rank))
            code = 1
        self.stop.set()
        self.out_q.put(None)
        for t in threads:
            t.join(timeout=5)
        self.close()
        return code or self.exit_code

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
                down = self.down_since
                if down is not None and now - down > self.timeout_s:
                    logger.error("core: the connection to the API server at %s has been down for %.1f s "
                                 "(parallel.data_parallel_timeout_s): it is gone; exiting", self.input_addr, now - down)
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
    config = read_config_from_stdin()
    proc = EngineCoreProc(config, args.input, args.output, args.parent_pid, args.dp_rank or 0)

    def _stop(signum, frame):  # noqa: ARG001
        proc.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return proc.run()


if __name__ == "__main__":
    sys.exit(core_main())
