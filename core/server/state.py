"""What the server's handlers share: the engine (once started), its metrics and the served name;
and the engine's lifecycle: its start in the background and what happens when it dies.

When an engine core dies its pending requests fail at once (``AsyncLLM``), then, as
``server.on_engine_death`` says: ``exit`` (the default) drains and stops the server with exit code
1, for a process supervisor to notice; ``restart`` starts a new engine after
``restart_backoff_s`` (doubled for each restart in a row, at most ``restart_backoff_max_s``; an
engine that ran that long before dying starts the count again), and exits like ``exit`` once
``max_restarts`` restarts in a row did not keep it up. /health is 503 until a restart succeeds."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable

from paged.core.config import EngineConfig
from paged.core.errors import ConfigError
from paged.core.frontend.async_llm import AsyncLLM
from paged.core.frontend.stream import MergedStreams
from paged.core.frontend.reasoning import reasoning_parser_for
from paged.core.frontend.tools import model_type, tool_parser_for
from paged.core.lora import LoRARequest
from paged.core.server.errors import APIError, ShuttingDown, engine_unavailable, shutting_down
from paged.core.server.inputs import PromptInputs
from paged.core.server.metrics import Metrics
from paged.core.server.streaming import Tokens

logger = logging.getLogger("paged")


class ServerState:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.llm: AsyncLLM | None = None
        self.start_error: str | None = None
        self.metrics = Metrics()
        self.cancel_start = threading.Event()
        self.served_model_name: str | None = config.server.served_model_name
        self.created = int(time.time())
        self.uvicorn_server = None  # set by run_server, to stop when the engine cannot start or dies
        self.tokens: Tokens | None = None
        self.tool_parser: type | None = None  # the served model family's tool-call parser (read at start-up)
        self.reasoning_parser: str | None = None  # its reasoning parser (server.reasoning_parser), if any
        self.inputs: PromptInputs | None = None
        self.draining = False  # SIGTERM came: new requests get 503, open ones may finish
        self.open_merges: set[MergedStreams] = set()  # one per request being answered
        self.exit_code = 0  # 1 once the server stops because the engine died, 2 when the settings are wrong
        self.stopping = asyncio.Event()  # the app is shutting down: no more restarts
        self.start_timeout = 600.0
        self.restarting: str | None = None  # why the engine is down while a restart is pending
        self.restarts = 0  # restarts in a row (see the module docstring)
        self.engine_started_at = 0.0  # time.monotonic() of the current engine's start
        self.starter: asyncio.Task | None = None  # the engine's first start
        self.recovery: asyncio.Task | None = None  # handling the engine's death, if it died
        # LoRA adapters served, by the name clients send as ``model``: --lora-modules (every core
        # reads them at start-up, ids 1..n), then those /v1/load_lora_adapter adds (later ids)
        self.loras: dict[str, LoRARequest] = {r.lora_name: r for r in config.lora.module_requests()}
        self.next_lora_id = len(self.loras) + 1
        self.lora_lock = asyncio.Lock()  # one load or unload at a time

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; after ``grace_s`` end the open ones (error event, then [DONE])."""
        self.draining = True

        def end_open_requests() -> None:
            for merge in list(self.open_merges):
                merge.interrupt(ShuttingDown())

        asyncio.get_running_loop().call_later(grace_s, end_open_requests)

    def engine_down(self) -> str | None:
        """Why the engine cannot serve now (None while it runs)."""
        llm = self.llm
        if llm is None:
            return self.start_error or "the engine is starting; retry when /health returns 200"
        if not llm.is_alive:
            return self.restarting or llm.death_reason
        return None

    def require_llm(self) -> AsyncLLM:
        """The engine, or the 503 to answer (shutting down, or the engine down). Once per request."""
        if self.draining:
            raise shutting_down()
        reason = self.engine_down()
        if reason is not None:
            raise engine_unavailable(reason)
        return self.llm

    # --- the engine's lifecycle ----------------------------------------------------------------
    def begin_start(self, start_timeout: float, make_trace_recorder: Callable[[], Any] | None = None) -> None:
        """Start the engine in the background (the app's startup; see ``close``)."""
        self.start_timeout = start_timeout
        self.starter = asyncio.get_running_loop().create_task(self._start_engine(make_trace_recorder),
                                                              name="paged-engine-start")

    async def _start_engine(self, make_trace_recorder: Callable[[], Any] | None) -> None:
        """Start the engine (loading blocks: in a thread) and serve it; stop the server if it
        cannot start."""
        try:
            llm, tool_parser = await self._new_engine()
        except Exception as e:
            self.start_error = f"the engine failed to start: {e}"
            logger.error("%s", self.start_error)
            if isinstance(e, ConfigError):  # bad settings: the exit code of every other command's
                self.exit_code = 2
            self._stop_server()
            return
        if make_trace_recorder is not None:
            llm.trace_recorder = make_trace_recorder()
        self._serve(llm, tool_parser)
        logger.info("serving model %r", self.served_model_name)

    async def _new_engine(self) -> tuple[AsyncLLM, type]:
        """A new engine and its model's tool-call parser, both found in a thread (the engine's
        start blocks; the parser comes from the model's config.json, read here rather than on the
        event loop for each chat request)."""
        def start() -> tuple[AsyncLLM, type]:
            llm = AsyncLLM.from_config(self.config, self.metrics, self.start_timeout, self.cancel_start)
            try:
                return llm, tool_parser_for(model_type(llm.model_info.model_dir))
            except BaseException:
                llm.shutdown()
                raise

        return await asyncio.to_thread(start)

    def _serve(self, llm: AsyncLLM, tool_parser: type) -> None:
        self.served_model_name = default_served_model_name(self.config)
        self.tokens = Tokens(llm.tokenizer)
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser_for(self.config.server.reasoning_parser,
                                                     model_type(llm.model_info.model_dir))
        old_inputs, self.inputs = self.inputs, PromptInputs(llm)
        if old_inputs is not None:
            old_inputs.close(cancel_pending=False)  # a request may still be tokenizing there
        self.llm = llm
        self.engine_started_at = time.monotonic()
        llm.watch(self._engine_died)

    def _engine_died(self, message: str) -> None:
        if self.draining or self.stopping.is_set():
            return
        self.recovery = asyncio.get_running_loop().create_task(self._recover(message), name="paged-engine-recovery")

    async def _recover(self, message: str) -> None:
        server = self.config.server
        if server.on_engine_death == "exit":
            logger.error("%s: the server exits (server.on_engine_death = exit)", message)
            self._stop_server(exit_code=1)
            return
        old = self.llm
        if time.monotonic() - self.engine_started_at >= server.restart_backoff_max_s:
            self.restarts = 0  # it ran long enough: this death starts a new count
        await old.aclose()  # reaps the dead core (and a data-parallel engine's stopped survivors)
        while self.restarts < server.max_restarts:
            self.restarts += 1
            delay = restart_delay(self.restarts, server.restart_backoff_s, server.restart_backoff_max_s)
            self.restarting = f"{message}; restart {self.restarts} of {server.max_restarts} in {delay:g} s"
            logger.warning("%s", self.restarting)
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
            if self.stopping.is_set():
                return
            try:
                llm, tool_parser = await self._new_engine()
                await self._add_runtime_loras(llm)
            except Exception as e:
                if self.stopping.is_set():
                    return
                message = f"the engine failed to restart: {e}"
                logger.error("%s", message)
                continue
            if self.stopping.is_set():
                await llm.aclose()
                return
            llm.trace_recorder = old.trace_recorder
            self._serve(llm, tool_parser)
            self.restarting = None
            logger.warning("engine restarted (restart %d of %d in a row): serving again", self.restarts,
                           server.max_restarts)
            return
        logger.error("%s; giving up after %d restart(s) in a row (server.max_restarts): the server exits",
                     message, server.max_restarts)
        self._stop_server(exit_code=1)

    def _stop_server(self, exit_code: int | None = None) -> None:
        """Make uvicorn shut down, draining the open requests (nothing to stop under a test client)."""
        if exit_code is not None:
            self.exit_code = exit_code
        if self.uvicorn_server is not None:
            self.uvicorn_server.should_exit = True

    async def close(self) -> None:
        """At the app's shutdown: stop a pending start or restart, then the engine."""
        self.stopping.set()
        self.cancel_start.set()
        for task in (self.starter, self.recovery):
            if task is not None:
                with suppress(BaseException):
                    await asyncio.wait_for(task, 30)
        if self.inputs is not None:
            self.inputs.close()
        if self.llm is not None:
            await self.llm.aclose()

    async def _add_runtime_loras(self, llm: AsyncLLM) -> None:
        """A restarted engine read --lora-modules itself; the adapters loaded at run time are
        registered again (one that no longer loads is dropped, with an error in the log)."""
        static = {r.lora_name for r in self.config.lora.module_requests()}
        for name, lora_request in list(self.loras.items()):
            if name in static:
                continue
            try:
                await llm.add_lora(lora_request)
            except Exception as e:
                logger.error("LoRA adapter %r is no longer served: %s", name, e)
                del self.loras[name]

    def check_model(self, model: str | None) -> None:
        """The request's ``model`` names the served model or one of its LoRA adapters (404 else)."""
        if model is None or model in self.loras:
            return
        accepted = {self.served_model_name, self.config.model.model}
        if self.llm is not None:
            accepted.add(self.llm.model_info.model_dir)
        if model not in accepted:
            raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")

    def lora_of(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, or None (the base model)."""
        return None if model is None else self.loras.get(model)

    def model_name(self, model: str | None) -> str:
        """The ``model`` a response reports: the adapter's name, else the served model's."""
        return model if model is not None and model in self.loras else self.served_model_name


def default_served_model_name(config: EngineConfig) -> str:
    if config.server.served_model_name:
        return config.server.served_model_name
    if config.model.model is None:  # the embedded default: its name, not its cache directory's
        from paged.core.loading.gguf import DEFAULT_GGUF

        return DEFAULT_GGUF.split(".")[0]
    path = Path(config.model.model)
    return path.stem if path.suffix == ".gguf" else path.name


def restart_delay(restart: int, first_s: float, max_s: float) -> float:
    """The wait before the ``restart``-th restart in a row (1, 2, ...): ``first_s`` doubled for
    each earlier one, at most ``max_s``."""
    return min(first_s * 2 ** min(restart - 1, 64), max_s)
