"""The asynchronous front-end: an engine core in its own process, driven over ZeroMQ.

``AsyncLLM`` = InputProcessor (tokenize, validate, fan out n > 1, build the core messages) +
``EngineCoreClient`` (the core process) + OutputProcessor (the per-request states: incremental
detokenization, stop strings, outputs as each request's ``RequestOutputKind`` asks), composed
like the in-process ``LLMEngine`` but with the core behind sockets. One output-handler task pulls
the core's outputs; the output processor puts each request's outputs straight into that
request's ``RequestStream`` (``paged.core.frontend.stream``), which its consumer reads;
``generate()`` streams them and aborts the request in the core when its consumer goes away.

With ``parallel.data_parallel_size`` N > 1 there are N cores behind the same sockets: a
``DataParallelRouter`` picks the core of each core request (each child of an n > 1 request on its
own: least loaded, preferring a known prefix) and remembers it until the request ends, so that
aborts and stops go to the core that holds it; utility calls go to every core and ``get_stats``
combines their answers (``paged.core.frontend.dp_stats``). Any dead core makes the whole engine dead
(``watch`` tells its owner, e.g. the server, which then exits or starts a new ``AsyncLLM``).

    llm = AsyncLLM.from_config(config)        # blocks until the core says READY
    async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].new_text, end="")
    llm.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from typing import Any, AsyncIterator, Callable, Sequence

import msgspec
import zmq

from paged.core.config import EngineConfig
from paged.core.constraint_check import ConstraintValidator
from paged.core.frontend.dp_router import DataParallelRouter
from paged.core.frontend.dp_stats import combine_core_stats
from paged.core.engine.model_info import ModelInfo
from paged.core.ipc.client import EngineCoreClient
from paged.core.ipc.messages import (
    AbortRequests,
    AddRequests,
    CoreFailed,
    EngineDeadError,
    Heartbeat,
    Outputs,
    Ready,
    RequestFailed,
    UtilityCall,
    UtilityResult,
)
from paged.core.errors import InvalidRequestError, PagedError, RequestRejectedError
from paged.core.frontend.outputs import RequestOutput, RequestOutputKind
from paged.core.frontend.processor import InputProcessor, OutputProcessor, check_lora_request
from paged.core.lora import LoRARequest
from paged.core.frontend.request_state import RequestState, SampleState
from paged.core.frontend.stats_observer import StatsObserver
from paged.core.frontend.stream import RequestStream
from paged.core.pooling_params import PoolingParams
from paged.core.sampling_params import SamplingParams

logger = logging.getLogger("paged")

__all__ = ["AsyncLLM", "EngineDeadError", "RequestOutputKind", "RequestStream", "StatsObserver"]

_POLL_MS = 200  # how often the output handler checks that the core is alive when it is quiet


class AsyncLLM:
    def __init__(self, config: EngineConfig, client: EngineCoreClient, tokenizer,
                 observer: StatsObserver | None = None) -> None:
        from paged.core.loading.generation_config import load_generation_defaults

        self.config = config
        self.client = client
        self.model_info: ModelInfo = client.model_info
        self.tokenizer = tokenizer
        # the model's generation_config.json sampling, for the fields a request leaves unset
        self.default_sampling = load_generation_defaults(self.model_info.model_dir)
        # Without the plugins (and torch): the engine core has checked the structured-output backend.
        self.input_processor = InputProcessor(tokenizer, self.model_info, ConstraintValidator(config))
        self.output_processor = OutputProcessor()
        self.observer = observer or StatsObserver()
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._utility_core: dict[int, int] = {}  # call id -> the core asked (call_utility_all, several cores)
        self._call_ids = itertools.count()
        self._request_ids = itertools.count()
        self._handler: asyncio.Task | None = None
        self._dead: str | None = None
        self._shutting_down = False
        self._on_death: Callable[[str], None] | None = None  # see watch()
        self.num_cores: int = client.num_cores
        self.router: DataParallelRouter | None = None  # None with one core: everything goes to core 0
        if self.num_cores > 1:
            self.router = DataParallelRouter(
                self.num_cores, self.model_info.block_size,
                max_hashes=max(sum(info.num_blocks for info in client.model_infos), 1),
                prefix_affinity=config.cache.enable_prefix_caching,
            )
        self.last_stats: dict[str, Any] | None = None  # combined over the cores
        self.last_core_stats: list[dict[str, Any]] | None = None  # one per core, by rank
        self.trace_recorder = None  # paged.core.lab.trace.TraceRecorder with `paged serve --record-trace`

    @classmethod
    def from_config(cls, config: EngineConfig, observer: StatsObserver | None = None,
                    start_timeout: float = 600.0, cancel: threading.Event | None = None) -> "AsyncLLM":
        """Start the core process, wait for its READY, load the tokenizer. Blocking; from an event
        loop, run it in a thread (``await asyncio.to_thread(AsyncLLM.from_config, config)``).
        Setting ``cancel`` stops the wait (and the core)."""
        from paged.core.loading.tokenizer import load_tokenizer

        client = EngineCoreClient(config, start_timeout=start_timeout, cancel=cancel)
        try:
            tokenizer = load_tokenizer(client.model_info.tokenizer_dir or client.model_info.model_dir)
        except BaseException:
            client.close()
            raise
        if client.num_cores == 1:
            logger.info("engine core ready (pid %d): %d KV blocks of %d tokens, max_model_len %d",
                        client.pid, client.model_info.num_blocks, client.model_info.block_size,
                        client.model_info.max_model_len)
        else:
            logger.info("%d data-parallel engine cores ready (pids %s): %s KV blocks of %d tokens, max_model_len %d",
                        client.num_cores, ", ".join(map(str, client.pids)),
                        " + ".join(str(info.num_blocks) for info in client.model_infos),
                        client.model_info.block_size, client.model_info.max_model_len)
        return cls(config, client, tokenizer, observer)

    # --- state ------------------------------------------------------------------------------
    @property
    def core_pid(self) -> int | None:
        """Rank 0's pid (the only core's without data parallelism)."""
        return self.client.pid

    @property
    def core_pids(self) -> list[int | None]:
        return list(self.client.pids)

    def core_loads(self) -> list[int]:
        """Per core, by rank: the unfinished core requests (children) the front-end sent to it."""
        if self.router is None:
            return [self.output_processor.num_live_samples]
        return list(self.router.loads)

    @property
    def requests(self) -> dict[str, RequestState]:
        """The open requests' states, by request id (the output processor's: one per request)."""
        return self.output_processor.requests

    @property
    def streams(self) -> dict[str, RequestStream]:
        """The open requests' streams, by request id (a snapshot)."""
        return {rid: state.stream for rid, state in self.requests.items()}

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self.client.alive

    @property
    def death_reason(self) -> str | None:
        """Why the engine is dead; None while it is alive."""
        if self._dead is not None:
            return self._dead
        return None if self.client.alive else self.client.death_message()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self.client.alive:
            self._on_core_death(self.client.death_message())
            raise EngineDeadError(self._dead)

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(self._output_handler(), name="paged-output-handler")

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(message)`` once, from the event loop, when the engine dies (after its
        pending requests have failed), but not when it is shut down. Starts the output handler
        now, so that a dead core is noticed within _POLL_MS even with no request open."""
        self._on_death = on_death
        self._ensure_handler()

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None) -> str:
        return self.input_processor.apply_chat_template(messages, tools, chat_template_kwargs)

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
        prompt_token_ids: list[int] | None = None,
        tenant: str | None = None,
        deadline_s: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and send a request to the core. Raises InvalidRequestError (nothing sent) or
        EngineDeadError at once; a rejection by the core (RequestRejectedError when the policy's
        admission control turns it away) comes out of the stream. A text prompt's
        ``prompt_token_ids``, when given, were tokenized by the caller (off the event loop).
        ``output_kind``: what the stream yields (``RequestOutputKind``: every step's whole output
        so far, its increments, or the final output alone). ``lora_request``: the LoRA adapter it
        runs with (registered with ``add_lora`` first, so that a bad adapter fails there)."""
        self._check_alive()
        self._ensure_handler()
        request_id = f"req-{next(self._request_ids)}" if request_id is None else str(request_id)
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
        state, requests = self.input_processor.process(
            request_id, prompt, params or SamplingParams(), priority, arrival_time, cache_salt, add_special_tokens,
            prompt_token_ids=prompt_token_ids, tenant=tenant, deadline_s=deadline_s, output_kind=output_kind,
            lora_request=lora_request,
        )
        [stream] = await self._register_and_send([(state, requests)], params or SamplingParams(), priority)
        return stream

    async def add_requests(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | PoolingParams | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
        prompt_token_ids: Sequence[list[int]] | None = None,
        tenant: str | None = None,
        deadline_s: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> list[RequestStream]:
        """``add_request`` for several prompts with the same parameters (an embeddings call's
        inputs), every one validated before any is sent, then sent in one message per core, so
        the core's next step holds them all. One stream per prompt, in order."""
        self._check_alive()
        self._ensure_handler()
        if len(set(request_ids)) != len(request_ids) or any(r in self.requests for r in request_ids):
            raise InvalidRequestError(f"request_id: {list(request_ids)!r} repeats an id or one already in use")
        params = params or SamplingParams()
        prepared = [self.input_processor.process(
            request_id, prompt, params, priority, None, None, add_special_tokens,
            prompt_token_ids=None if prompt_token_ids is None else prompt_token_ids[i], tenant=tenant,
            deadline_s=deadline_s, output_kind=output_kind,
        ) for i, (request_id, prompt) in enumerate(zip(request_ids, prompts, strict=True))]
        return await self._register_and_send(prepared, params, priority)

    async def _register_and_send(self, prepared: list[tuple[RequestState, list]], params, priority: int
                                 ) -> list[RequestStream]:
        """Give each validated request (its state and core messages, as the input processor built
        them) a stream, then send the messages: one per core. A failed send aborts them all."""
        streams = []
        for state, _ in prepared:
            state.stream = RequestStream(state.request_id, self.abort)
            self.output_processor.add(state)
            streams.append(state.stream)
        by_core: dict[int, list] = {}
        try:
            for request in (request for _, requests in prepared for request in requests):
                core = 0 if self.router is None else self.router.route(
                    request.request_id, request.prompt_token_ids, request.cache_salt,
                    request.lora_request.lora_int_id if request.lora_request is not None else 0)
                by_core.setdefault(core, []).append(request)
            for core, batch in by_core.items():
                await self.client.send(batch[0] if len(batch) == 1 else AddRequests(batch), core)
        except BaseException:
            for state, _ in prepared:
                self.abort(state.request_id)
            raise
        for state, requests in prepared:
            self.observer.prompt_tokens(len(state.prompt_token_ids) * len(requests))
            if self.trace_recorder is not None and state.pooling is None:
                self.trace_recorder.add(state.request_id, params, priority, state.prompt)
        return streams

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs: by default (``output_kind`` CUMULATIVE) the text so far
        plus ``new_text`` deltas at every step (``add_request``'s keywords are accepted). Closing
        the generator or cancelling its consumer aborts the request in the core."""
        stream = await self.add_request(request_id, prompt, params, priority, **kwargs)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Forget a request and abort its children in the core; unknown ids are ignored."""
        state = self.requests.get(request_id)
        if state is None:
            return
        if not state.stream.finished:
            state.stream.put(None)  # ends a consumer's iteration
        if self.trace_recorder is not None:
            self.trace_recorder.discard(request_id)
        live = self.output_processor.remove(request_id)
        if live:
            self._send_aborts(live, "abort")

    def _send_aborts(self, child_ids: list[str], status: str) -> None:
        """Abort core requests in the core(s) that hold them; they end for the router too."""
        router = self.router
        if router is None:
            self.client.send_nowait(AbortRequests(child_ids, status))
            return
        for core, ids in router.group_by_core(child_ids).items():
            self.client.send_nowait(AbortRequests(ids, status), core)
            for child_id in ids:
                router.finish(child_id)

    # --- utility calls ----------------------------------------------------------------------
    async def call_utility(self, method: str, *args: Any, timeout: float = 10.0, core: int = 0) -> Any:
        """Call ``method`` in one core (rank ``core``) and return its result."""
        self._check_alive()
        self._ensure_handler()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = fut
        try:
            await self.client.send(UtilityCall(call_id, method, list(args)), core)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._utility_futures.pop(call_id, None)

    async def call_utility_all(self, method: str, *args: Any, timeout: float = 10.0) -> list[Any]:
        """Call ``method`` in every core; their results by rank (the first failure is raised)."""
        if self.num_cores == 1:
            return [await self.call_utility(method, *args, timeout=timeout)]
        self._check_alive()
        self._ensure_handler()
        loop = asyncio.get_running_loop()
        ranks = self.client.live_ranks()  # a lost core is not asked (its future would wait forever)
        call_ids = [next(self._call_ids) for _ in ranks]
        futs = [loop.create_future() for _ in call_ids]
        self._utility_futures.update(zip(call_ids, futs))
        self._utility_core.update(zip(call_ids, ranks))
        try:
            for core, call_id in zip(ranks, call_ids):
                await self.client.send(UtilityCall(call_id, method, list(args)), core)
            results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout)
        finally:
            for call_id in call_ids:
                self._utility_futures.pop(call_id, None)
                self._utility_core.pop(call_id, None)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    # --- LoRA adapters (paged.core.lora) -----------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest, timeout: float = 120.0) -> None:
        """Register an adapter in every core, which reads and checks it now; raises
        InvalidRequestError naming the file and the field (no core keeps it then)."""
        check_lora_request(lora_request, self.model_info)
        try:
            await self.call_utility_all("add_lora", *msgspec.structs.astuple(lora_request), timeout=timeout)
        except PagedError as e:
            with contextlib.suppress(Exception):  # a core that read it keeps nothing of a failed add
                await self.call_utility_all("remove_lora", lora_request.lora_int_id)
            message = str(e).removeprefix("utility call failed in the core: ")
            raise InvalidRequestError(message.removeprefix("InvalidRequestError: ")) from None

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter in every core (each drops it once its unfinished requests end)."""
        return any(await self.call_utility_all("remove_lora", lora_int_id))

    async def get_stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The cores' CoreStats fields plus num_blocks, num_free_blocks, pid, num_requests_added
        and pids, combined over the cores as ``paged.core.frontend.dp_stats`` says (one core: its own).
        The per-core dicts are kept in ``last_core_stats``."""
        per_core = await self.call_utility_all("stats", timeout=timeout)
        for rank, stats in zip(self.client.live_ranks(), per_core):
            stats.update(dp_rank=rank, host=self.client.hosts[rank])
        stats = combine_core_stats(per_core)
        self.last_core_stats, self.last_stats = per_core, stats
        return stats

    async def reset_prefix_cache(self) -> bool:
        """Reset every core's prefix cache; True only if all did (a core refuses while any of its
        requests holds blocks)."""
        done = all(await self.call_utility_all("reset_prefix_cache"))
        if done and self.router is not None:
            self.router.forget_prefixes()
        return done

    # --- the output handler -----------------------------------------------------------------
    async def _output_handler(self) -> None:
        client = self.client
        pull, decoder = client.pull, client.decoder
        # With several cores a busy one keeps the socket from going quiet while another is dead:
        # then check the cores every _POLL_MS whatever arrives (one core: only when quiet). Over tcp
        # the front-end also takes the READY of a core that rejoins.
        check_when_busy = self.num_cores > 1 or client.multi_node
        loop = asyncio.get_running_loop()
        next_check = loop.time() + _POLL_MS / 1000
        try:
            while self._dead is None:
                if check_when_busy and loop.time() >= next_check:
                    next_check = loop.time() + _POLL_MS / 1000
                    if client.multi_node:
                        await self._take_rejoins()
                    if not self._check_cores():
                        break
                if not await pull.poll(_POLL_MS):
                    if not self._check_cores():
                        break
                    continue
                try:
                    payload = await pull.recv()
                except zmq.Again:  # the poll saw a message of a peer that dropped since (a lost node)
                    continue
                msg = decoder.decode(payload)
                if isinstance(msg, Heartbeat):
                    client.note_beat(msg.dp_rank)
                elif isinstance(msg, Outputs):
                    self._process_outputs(msg)
                elif isinstance(msg, UtilityResult):
                    fut = self._utility_futures.get(msg.call_id)
                    if fut is not None and not fut.done():
                        if msg.error is None:
                            fut.set_result(msg.result)
                        else:
                            fut.set_exception(PagedError(f"utility call failed in the core: {msg.error}"))
                elif isinstance(msg, RequestFailed):
                    sample = self.output_processor.samples.get(msg.request_id)
                    if sample is not None:
                        if msg.http_status:
                            err = RequestRejectedError(msg.message, msg.http_status)
                        else:
                            err = InvalidRequestError(msg.message) if msg.invalid else PagedError(msg.message)
                        sample.request.stream.put(err)
                        self.abort(sample.request.request_id)
                elif isinstance(msg, CoreFailed):
                    which = f" (data-parallel rank {msg.dp_rank})" if self.num_cores > 1 else ""
                    message = f"the engine core{which} failed: {msg.message}"
                    if client.keep_serving and self.num_cores > 1:
                        self._on_core_lost(msg.dp_rank, message)
                        if not self._check_cores():
                            break
                    else:
                        self._on_core_death(message)
        except asyncio.CancelledError:
            raise
        except (zmq.ZMQError, zmq.error.ContextTerminated) as e:
            if not self.client.closed:
                self._on_core_death(f"engine core connection lost: {e}")
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("output handler failed")
            self._on_core_death(f"output handler failed: {type(e).__name__}: {e}")

    def _process_outputs(self, msg: Outputs) -> None:
        """One core message: token timings for the observer, the router's bookkeeping, then the
        output processor (which puts each request's output into its stream)."""
        observer = self.observer
        core_outputs = msg.outputs
        now = msg.timestamp
        num_tokens = 0
        router = self.router
        samples = self.output_processor.samples
        for out in core_outputs:
            num_tokens += len(out.new_token_ids)
            if out.finish_reason is not None and router is not None:
                router.finish(out.request_id)
            sample = samples.get(out.request_id)
            if sample is None:
                continue  # aborted meanwhile
            last = sample.last_token_time
            if last is None:
                if out.first_token_time is not None:
                    observer.time_to_first_token(max(out.first_token_time - out.arrival_time, 0.0))
            elif out.new_token_ids:
                observer.inter_token_latency(max(now - last, 0.0) / len(out.new_token_ids))
            sample.last_token_time = now
        observer.generation_tokens(num_tokens)
        result = self.output_processor.process(core_outputs)
        if result.stopped:  # a stop string ended these children here: the core still runs them
            self._send_aborts(result.stopped, "stop")
        for sample in result.finished:
            self._observe_finished(sample)
        if self.trace_recorder is not None:
            for state in result.done:
                if state.pooling is None:
                    self.trace_recorder.finish(state.final_output())

    def _observe_finished(self, sample: SampleState) -> None:
        self.observer.request_finished(sample.finish_reason)
        m = sample.metrics()
        if m is not None:
            if m.e2e_latency is not None:
                self.observer.e2e_latency(max(m.e2e_latency, 0.0))
            if m.queue_time is not None:
                self.observer.queue_time(max(m.queue_time, 0.0))

    def _check_cores(self) -> bool:
        """Notice lost cores: with ``data_parallel_on_core_loss: continue`` each is dropped on its
        own; the engine dies when it cannot serve. False once it is dead."""
        client = self.client
        if client.keep_serving and self.num_cores > 1:
            for rank in client.live_ranks():
                reason = client.core_down(rank)
                if reason is not None:
                    self._on_core_lost(rank, reason)
        if not client.alive:
            self._on_core_death(client.death_message())
            return False
        return True

    def _on_core_lost(self, rank: int, reason: str) -> None:
        """One core is gone and the others keep serving: fail the requests it held (a request
        with samples on other cores too fails whole), route nothing to it until it rejoins."""
        if rank in self.client.lost:
            return
        self.client.mark_lost(rank, reason)
        held = self.router.drop_core(rank) if self.router is not None else []
        logger.error("%s; failing its %d request(s), serving on the other %d core(s) (data_parallel_on_core_loss = "
                     "continue)", reason, len(held), len(self.client.live_ranks()))
        err = EngineDeadError(f"{reason}; this request was running there")
        for child_id in held:
            sample = self.output_processor.samples.get(child_id)
            if sample is None:
                continue
            state = sample.request
            state.stream.put(err)
            others = [c for c in self.output_processor.remove(state.request_id) if c not in held]
            if others:
                self._send_aborts(others, "abort")
        for call_id, core in list(self._utility_core.items()):
            fut = self._utility_futures.get(call_id)
            if core == rank and fut is not None and not fut.done():
                fut.set_exception(EngineDeadError(reason))

    async def _take_rejoins(self) -> None:
        """READYs after start-up (over tcp): a lost core back, or one to refuse."""
        router = self.client.router
        while await router.poll(0):
            try:
                identity, payload = await router.recv_multipart()
            except zmq.Again:  # its sender dropped since the poll
                return
            try:
                msg = self.client.decoder.decode(payload)
            except Exception as e:
                logger.error("dropping an undecodable message from an engine core: %s", e)
                continue
            if isinstance(msg, Ready) and self.client.rejoin(identity, msg) and self.router is not None:
                self.router.restore_core(msg.dp_rank)

    @property
    def lost_ranks(self) -> dict[int, str]:
        """Cores lost while the others serve (``data_parallel_on_core_loss: continue``): rank -> why."""
        return dict(self.client.lost)

    def _on_core_death(self, message: str) -> None:
        if self._dead is not None:
            return
        self._dead = message
        if not self._shutting_down:
            logger.error("%s; failing %d pending request(s)", message, len(self.requests))
            if self.num_cores > 1:
                self.client.terminate()  # one dead core is a dead engine: stop the others' work now
        err = EngineDeadError(message)
        for state in list(self.requests.values()):
            state.stream.put(err)
            self.output_processor.remove(state.request_id)
        if self.router is not None:
            self.router.reset()
        for fut in self._utility_futures.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        if self._on_death is not None and not self._shutting_down:
            self._on_death(message)

    # --- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the core process (SIGTERM, then SIGKILL) and fail what is still pending. Blocks
        while the cores exit: from an event loop, use ``aclose``."""
        self._shutting_down = True
        handler, self._handler = self._handler, None
        if handler is not None and not handler.done():
            handler.cancel()
        self._on_core_death("the engine is shut down")
        self.client.close()

    async def aclose(self) -> None:
        """``shutdown`` without blocking the event loop (the cores are waited for in a thread)."""
        self._shutting_down = True
        handler, self._handler = self._handler, None
        if handler is not None and not handler.done():
            handler.cancel()
            await asyncio.wait([handler])  # nothing may await the sockets once they close
        self._on_core_death("the engine is shut down")
        await self.client.aclose()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()

