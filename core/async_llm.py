"""The asynchronous front-end: an engine core in its own process, driven over ZeroMQ.

``AsyncLLM`` = InputProcessor (tokenize, validate, fan out n > 1) + ``EngineCoreClient`` (the
core process) + OutputProcessor (incremental detokenization, stop strings), composed like the
in-process ``LLMEngine`` but with the core behind sockets. One output-handler task pulls the
core's outputs and routes each request's ``RequestOutput``s to that request's asyncio queue;
``generate()`` streams them and aborts the request in the core when its consumer goes away.

    llm = AsyncLLM.from_config(config)        # blocks until the core says READY
    async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].new_text, end="")
    llm.shutdown()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Any, AsyncIterator, Sequence

import zmq

from paged.core.config import EngineConfig
from paged.core.engine_core import ModelInfo
from paged.core.engine_core_proc import (
    AbortRequests,
    CoreFailed,
    EngineCoreClient,
    EngineDeadError,
    Outputs,
    RequestFailed,
    UtilityCall,
    UtilityResult,
    output_from_wire,
    request_to_wire,
)
from paged.core.errors import InvalidRequestError, PagedError
from paged.core.outputs import RequestOutput
from paged.core.processor import InputProcessor, OutputProcessor
from paged.core.sampling_params import SamplingParams

logger = logging.getLogger("paged")

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream", "StatsObserver"]

_POLL_MS = 200  # how often the output handler checks that the core is alive when it is quiet


class StatsObserver:
    """Receives per-request measurements (the server turns them into Prometheus metrics).
    Times are seconds. Every method is optional to override."""

    def prompt_tokens(self, n: int) -> None: ...
    def generation_tokens(self, n: int) -> None: ...
    def time_to_first_token(self, s: float) -> None: ...
    def inter_token_latency(self, s: float) -> None: ...
    def e2e_latency(self, s: float) -> None: ...
    def queue_time(self, s: float) -> None: ...
    def request_finished(self, finish_reason: str) -> None: ...


class RequestStream:
    """The outputs of one request, in order. Iterate it; ``close()`` aborts it if unfinished."""

    def __init__(self, llm: "AsyncLLM", request_id: str) -> None:
        self.request_id = request_id
        self._llm = llm
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException | None) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._llm.abort(self.request_id)


class AsyncLLM:
    def __init__(self, config: EngineConfig, client: EngineCoreClient, tokenizer,
                 observer: StatsObserver | None = None) -> None:
        self.config = config
        self.client = client
        self.model_info: ModelInfo = client.model_info
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(tokenizer, self.model_info)
        self.output_processor = OutputProcessor()
        self.observer = observer or StatsObserver()
        self.streams: dict[str, RequestStream] = {}
        self._child_parent: dict[str, str] = {}
        self._last_token_time: dict[str, float] = {}
        self._finished_children: dict[str, set[int]] = {}
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._request_ids = itertools.count()
        self._handler: asyncio.Task | None = None
        self._dead: str | None = None
        self._shutting_down = False
        self.last_stats: dict[str, Any] | None = None
        self.trace_recorder = None  # paged.core.lab.trace.TraceRecorder with `paged serve --record-trace`

    @classmethod
    def from_config(cls, config: EngineConfig, observer: StatsObserver | None = None,
                    start_timeout: float = 600.0, cancel: threading.Event | None = None) -> "AsyncLLM":
        """Start the core process, wait for its READY, load the tokenizer. Blocking; from an event
        loop, run it in a thread (``await asyncio.to_thread(AsyncLLM.from_config, config)``).
        Setting ``cancel`` stops the wait (and the core)."""
        from paged.models.loader import load_tokenizer

        client = EngineCoreClient(config, start_timeout=start_timeout, cancel=cancel)
        try:
            tokenizer = load_tokenizer(config.model.tokenizer or client.model_info.model_dir)
        except BaseException:
            client.close()
            raise
        logger.info("engine core ready (pid %d): %d KV blocks of %d tokens, max_model_len %d",
                    client.pid, client.model_info.num_blocks, client.model_info.block_size,
                    client.model_info.max_model_len)
        return cls(config, client, tokenizer, observer)

    # --- state ------------------------------------------------------------------------------
    @property
    def core_pid(self) -> int | None:
        return self.client.pid

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self.client.alive

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.streams)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self.client.alive:
            self._on_core_death(self.client.death_message())
            raise EngineDeadError(self._dead)

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(self._output_handler(), name="paged-output-handler")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.input_processor.apply_chat_template(messages)

    # --- requests ---------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
    ) -> RequestStream:
        """Validate and send a request to the core. Raises InvalidRequestError (nothing sent) or
        EngineDeadError at once; a rejection by the core comes out of the stream."""
        self._check_alive()
        self._ensure_handler()
        request_id = f"req-{next(self._request_ids)}" if request_id is None else str(request_id)
        if request_id in self.streams:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
        parent, requests = self.input_processor.process(
            request_id, prompt, params or SamplingParams(), priority, arrival_time, cache_salt, add_special_tokens
        )
        stream = RequestStream(self, request_id)
        self.streams[request_id] = stream
        self.output_processor.add(parent)
        for request in requests:
            self._child_parent[request.request_id] = request_id
        self._finished_children[request_id] = set()
        try:
            for request in requests:
                await self.client.send(request_to_wire(request))
        except BaseException:
            self.abort(request_id)
            raise
        self.observer.prompt_tokens(len(parent.prompt_token_ids) * len(requests))
        if self.trace_recorder is not None:
            self.trace_recorder.add(request_id, params or SamplingParams(), priority, parent.prompt)
        return stream

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative text plus ``new_text`` deltas). Closing the
        generator or cancelling its consumer aborts the request in the core."""
        stream = await self.add_request(request_id, prompt, params, priority, **kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Forget a request and abort its children in the core; unknown ids are ignored."""
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream._put(None)  # ends a consumer's iteration
        self._finished_children.pop(request_id, None)
        if self.trace_recorder is not None:
            self.trace_recorder.discard(request_id)
        child_ids = self.output_processor.remove(request_id)
        for child_id in child_ids:
            self._child_parent.pop(child_id, None)
            self._last_token_time.pop(child_id, None)
        if child_ids:
            self.client.send_nowait(AbortRequests(child_ids, "abort"))

    # --- utility calls ----------------------------------------------------------------------
    async def call_utility(self, method: str, *args: Any, timeout: float = 10.0) -> Any:
        self._check_alive()
        self._ensure_handler()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = fut
        try:
            await self.client.send(UtilityCall(call_id, method, list(args)))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._utility_futures.pop(call_id, None)

    async def get_stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The core's CoreStats fields plus num_blocks, num_free_blocks and pid."""
        stats = await self.call_utility("stats", timeout=timeout)
        self.last_stats = stats
        return stats

    async def reset_prefix_cache(self) -> bool:
        return await self.call_utility("reset_prefix_cache")

    # --- the output handler -----------------------------------------------------------------
    async def _output_handler(self) -> None:
        pull, decoder = self.client.pull, self.client.decoder
        try:
            while self._dead is None:
                if not await pull.poll(_POLL_MS):
                    if not self.client.alive:
                        self._on_core_death(self.client.death_message())
                    continue
                msg = decoder.decode(await pull.recv())
                if isinstance(msg, Outputs):
                    self._process_outputs(msg)
                elif isinstance(msg, UtilityResult):
                    fut = self._utility_futures.get(msg.call_id)
                    if fut is not None and not fut.done():
                        if msg.error is None:
                            fut.set_result(msg.result)
                        else:
                            fut.set_exception(PagedError(f"utility call failed in the core: {msg.error}"))
                elif isinstance(msg, RequestFailed):
                    parent_id = self._child_parent.get(msg.request_id)
                    stream = self.streams.get(parent_id) if parent_id is not None else None
                    if stream is not None:
                        err = InvalidRequestError(msg.message) if msg.invalid else PagedError(msg.message)
                        stream._put(err)
                    if parent_id is not None:
                        self.abort(parent_id)
                elif isinstance(msg, CoreFailed):
                    self._on_core_death(f"the engine core failed: {msg.message}")
        except asyncio.CancelledError:
            raise
        except (zmq.ZMQError, zmq.error.ContextTerminated) as e:
            if not self.client._closed:
                self._on_core_death(f"engine core connection lost: {e}")
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("output handler failed")
            self._on_core_death(f"output handler failed: {type(e).__name__}: {e}")

    def _process_outputs(self, msg: Outputs) -> None:
        observer = self.observer
        core_outputs = [output_from_wire(o) for o in msg.outputs]
        now = msg.timestamp
        num_tokens = 0
        for out in core_outputs:
            num_tokens += len(out.new_token_ids)
            last = self._last_token_time.get(out.request_id)
            if last is None:
                if out.first_token_time is not None and out.request_id in self._child_parent:
                    observer.time_to_first_token(max(out.first_token_time - out.arrival_time, 0.0))
            elif out.new_token_ids:
                observer.inter_token_latency(max(now - last, 0.0) / len(out.new_token_ids))
            if out.finish_reason is None:
                self._last_token_time[out.request_id] = now
            else:
                self._last_token_time.pop(out.request_id, None)
        observer.generation_tokens(num_tokens)
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            for child_id in stopped:
                self._last_token_time.pop(child_id, None)
            self.client.send_nowait(AbortRequests(stopped, "stop"))
        for output in outputs:
            self._observe_finished(output)
            stream = self.streams.get(output.request_id)
            if output.finished:
                self.streams.pop(output.request_id, None)
                self._finished_children.pop(output.request_id, None)
                if self.trace_recorder is not None:
                    self.trace_recorder.finish(output)
            if stream is not None:
                stream._put(output)
        for out in core_outputs:
            if out.finish_reason is not None or out.request_id in stopped:
                self._child_parent.pop(out.request_id, None)

    def _observe_finished(self, output: RequestOutput) -> None:
        done = self._finished_children.get(output.request_id)
        if done is None:
            return
        for c in output.outputs:
            if c.finish_reason is None or c.index in done:
                continue
            done.add(c.index)
            self.observer.request_finished(c.finish_reason)
            m = c.metrics
            if m is not None:
                if m.e2e_latency is not None:
                    self.observer.e2e_latency(max(m.e2e_latency, 0.0))
                if m.queue_time is not None:
                    self.observer.queue_time(max(m.queue_time, 0.0))

    def _on_core_death(self, message: str) -> None:
        if self._dead is not None:
            return
        self._dead = message
        if not self._shutting_down:
            logger.error("%s; failing %d pending request(s)", message, len(self.streams))
        err = EngineDeadError(message)
        for stream in list(self.streams.values()):
            stream._put(err)
        self.streams.clear()
        self._child_parent.clear()
        self._last_token_time.clear()
        self._finished_children.clear()
        for parent_id in list(self.output_processor.parents):
            self.output_processor.remove(parent_id)
        for fut in self._utility_futures.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))

    # --- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the core process (SIGTERM, then SIGKILL) and fail what is still pending."""
        self._shutting_down = True
        handler, self._handler = self._handler, None
        if handler is not None and not handler.done():
            handler.cancel()
        self._on_core_death("the engine is shut down")
        self.client.close()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()

