"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of ``AsyncLLM``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent
events or not), ``GET /v1/models``, ``GET /health`` (503 until the engine core is ready and
whenever it is dead), ``GET /metrics`` (Prometheus text), ``GET /version`` and
``GET /debug/engine`` (core pid, KV blocks free / total, running / waiting requests).

With ``--data-parallel-size N`` the engine is N core processes behind this one front-end (see
``paged.core.frontend.async_llm``): /health is 200 only while all N run, the core metrics and
/debug/engine's ``core`` are combined over the cores (``paged.core.frontend.dp_stats``), and /debug/engine's
``cores`` lists each core's own stats plus the front-end's load on it; /metrics adds per-core
gauges labelled ``dp_rank`` when N > 1.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with 400 for an
invalid request (paged's InvalidRequestError messages, which name the field), 401 for a missing
or wrong API key (``server.api_key``; only /v1/* is protected), 404 for an unknown model and 503
while the engine core is not running. The engine starts in the background, so the server
answers /health (with 503) while the model loads.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any, AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from paged.core.frontend.async_llm import AsyncLLM, StatsObserver
from paged.core.config import EngineConfig
from paged.core.ipc.engine_core_proc import EngineDeadError
from paged.core.errors import InvalidRequestError, PagedError, RequestRejectedError
from paged.core.frontend.outputs import RequestOutput
from paged.core.sampling_params import SamplingParams

logger = logging.getLogger("paged")


# --- errors ------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_PARAM = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*)(?::| \()")


def invalid(message: str, param: str | None = None) -> APIError:
    if param is None:
        m = _PARAM.match(message)
        param = m.group(1) if m else None
    return APIError(400, message, "invalid_request_error", param, "invalid_value" if param else None)


def engine_unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "engine_unavailable")


def rejected(reason: str, http_status: int = 503) -> APIError:
    if http_status == 429:
        return APIError(429, reason, "requests", None, "rate_limit_exceeded")
    return APIError(503, reason, "server_error", None, "rejected_by_policy")


def _rejection(outputs) -> Response | None:
    """An error response if the policy turned a request away from the queue (it then finished with
    finish_reason "rejected" before producing anything), else None."""
    for out in outputs:
        for c in out.outputs:
            if c.finish_reason == "rejected":
                return rejected(str(c.stop_reason or "rejected by the scheduling policy")).response()
    return None


def _from_exception(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return invalid(str(e))
    if isinstance(e, EngineDeadError):
        return engine_unavailable(str(e))
    if isinstance(e, RequestRejectedError):  # the scheduling policy's admission control
        return rejected(str(e), e.http_status)
    if isinstance(e, PagedError):
        return APIError(500, str(e), "server_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


# --- request bodies ----------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Fields of the OpenAI API that are accepted and ignored (they change nothing here).
_IGNORED = {"metadata", "store", "service_tier", "parallel_tool_calls", "modalities"}


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extras (as vLLM accepts them)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    deadline_s: float | None = None  # seconds after arrival by which it should finish (policies)
    user: str | None = None  # the tenant, for fairness policies (else the X-Paged-Tenant header)
    # ignored OpenAI fields
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise invalid("request body: must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            msg = f"{loc}: unrecognized request argument"
        elif first["type"] == "missing":
            msg = f"{loc}: required"
        else:
            msg = f"{loc}: {first['msg']} (got {first.get('input')!r})"
        raise invalid(msg, str(first["loc"][0]) if first["loc"] else None) from None


def _sampling_params(req: _Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options: only allowed when stream is true")
    if req.logit_bias:
        raise invalid("logit_bias: not supported")
    kw: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, logprobs=logprobs, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "stop", "stop_token_ids"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    return SamplingParams(**kw)


# --- Prometheus metrics ------------------------------------------------------------------------
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class Metrics(StatsObserver):
    """Front-end measurements (histograms, token counters) plus the core's gauges and counters,
    refreshed from a ``stats`` utility call at each scrape. One registry per app."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.core_stats: dict[str, Any] | None = None
        self.per_core_stats: list[dict[str, Any]] | None = None  # only with several cores
        self.core_alive = False
        self._prompt = Counter("paged:prompt_tokens", "Prompt tokens processed (per sample)", registry=r)
        self._generation = Counter("paged:generation_tokens", "Tokens generated", registry=r)
        self._success = Counter("paged:request_success", "Finished requests (samples) by finish reason",
                                ["finished_reason"], registry=r)
        self._ttft = Histogram("paged:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                               registry=r)
        self._itl = Histogram("paged:inter_token_latency_seconds", "Time between generated tokens",
                              buckets=_ITL_BUCKETS, registry=r)
        self._e2e = Histogram("paged:e2e_request_latency_seconds", "Arrival to finish", buckets=_E2E_BUCKETS,
                              registry=r)
        self._queue = Histogram("paged:request_queue_time_seconds", "Arrival to first scheduled",
                                buckets=_E2E_BUCKETS, registry=r)
        r.register(_CoreCollector(self))

    def prompt_tokens(self, n: int) -> None:
        self._prompt.inc(n)

    def generation_tokens(self, n: int) -> None:
        self._generation.inc(n)

    def time_to_first_token(self, s: float) -> None:
        self._ttft.observe(s)

    def inter_token_latency(self, s: float) -> None:
        self._itl.observe(s)

    def e2e_latency(self, s: float) -> None:
        self._e2e.observe(s)

    def queue_time(self, s: float) -> None:
        self._queue.observe(s)

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(finish_reason).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# (name, kind, help, key in the core's stats)
_CORE_METRICS = [
    ("paged:num_requests_running", "gauge", "Requests (samples) in the running batch", "num_running"),
    ("paged:num_requests_waiting", "gauge", "Requests (samples) waiting to be scheduled", "num_waiting"),
    ("paged:kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0..1)", "kv_usage"),
    ("paged:num_kv_blocks", "gauge", "KV cache blocks in total", "num_blocks"),
    ("paged:num_free_kv_blocks", "gauge", "KV cache blocks free (cached-but-unused blocks count as free)",
     "num_free_blocks"),
    ("paged:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    ("paged:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache", "prefix_cache_hits"),
    ("paged:num_preemptions", "counter", "Preemptions of running requests", "num_preemptions"),
    ("paged:engine_steps", "counter", "Engine steps run", "num_steps"),
]


# With several data-parallel cores, also per core (label dp_rank); the families above are the sums.
_PER_CORE_METRICS = [
    ("paged:core_num_requests_running", "gauge", "Requests (samples) running in this core", "num_running"),
    ("paged:core_num_requests_waiting", "gauge", "Requests (samples) waiting in this core", "num_waiting"),
    ("paged:core_kv_cache_usage_perc", "gauge", "Fraction of this core's KV blocks in use (0..1)", "kv_usage"),
    ("paged:core_requests_added", "counter", "Requests (samples) sent to this core", "num_requests_added"),
]


class _CoreCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def _families(self, stats: dict[str, Any] | None, per_core: list[dict[str, Any]] | None):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily("paged:engine_core_alive", "1 while the engine core process runs",
                                value=1.0 if self.metrics.core_alive else 0.0)
        for name, kind, help_text, key in _CORE_METRICS:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name, help_text)
            if stats is not None and key in stats:
                family.add_metric([], float(stats[key]))
            yield family
        if per_core is None:
            return
        for name, kind, help_text, key in _PER_CORE_METRICS:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name, help_text, labels=["dp_rank"])
            for rank, core_stats in enumerate(per_core):
                if key in core_stats:
                    family.add_metric([str(rank)], float(core_stats[key]))
            yield family

    def describe(self):
        return list(self._families(None, None))

    def collect(self):
        return list(self._families(self.metrics.core_stats, self.metrics.per_core_stats))


# --- output formatting -------------------------------------------------------------------------
class _Tokens:
    """Token id -> text, cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self.cache[token_id] = text
        return text


def _completion_logprobs(tok: _Tokens, logprobs: list, text_offset: int) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in logprobs:
        s = tok(lp.token_id)
        tokens.append(s)
        token_lps.append(lp.logprob)
        top = {tok(t): v for t, v in lp.top}
        top.setdefault(s, lp.logprob)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tok: _Tokens, logprobs: list) -> dict[str, Any]:
    content = []
    for lp in logprobs:
        s = tok(lp.token_id)
        content.append({
            "token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": tok(t), "logprob": v, "bytes": list(tok(t).encode("utf-8"))} for t, v in lp.top],
        })
    return {"content": content}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


async def _merged(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several request streams as they come; closes them all on exit."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.close()


class _EventStream(StreamingResponse):
    """A StreamingResponse that always watches for the client going away and then cancels the
    body (whatever ASGI spec version the server speaks), so the request is aborted at once."""

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            with suppress(OSError):
                await self.stream_response(send)

        sender = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sender, watcher):
                t.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with suppress(Exception):
                    await aclose()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro) -> Response:
    """Run the handler; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        with suppress(BaseException):
            await task
        return Response(status_code=499)
    return task.result()


# --- the app -----------------------------------------------------------------------------------
class ServerState:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.llm: AsyncLLM | None = None
        self.start_error: str | None = None
        self.metrics = Metrics()
        self.cancel_start = threading.Event()
        self.served_model_name: str | None = config.server.served_model_name
        self.created = int(time.time())
        self.uvicorn_server = None  # set by run_server, to stop when the engine cannot start
        self.tokens: _Tokens | None = None

    def require_llm(self) -> AsyncLLM:
        llm = self.llm
        if llm is None:
            raise engine_unavailable(self.start_error or "the engine is starting; retry when /health returns 200")
        if not llm.is_alive:
            raise engine_unavailable(llm._dead or llm.client.death_message())
        return llm

    def check_model(self, model: str | None) -> None:
        if model is None:
            return
        accepted = {self.served_model_name, self.config.model.model}
        if self.llm is not None:
            accepted.add(self.llm.model_info.model_dir)
        if model not in accepted:
            raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")


def default_served_model_name(config: EngineConfig) -> str:
    if config.server.served_model_name:
        return config.server.served_model_name
    if config.model.model is None:  # the embedded default: its name, not its cache directory's
        from paged.core.loading.gguf import DEFAULT_GGUF

        return DEFAULT_GGUF.split(".")[0]
    path = Path(config.model.model)
    return path.stem if path.suffix == ".gguf" else path.name


def build_app(config: EngineConfig, start_timeout: float = 600.0, record_trace: str | None = None) -> FastAPI:
    state = ServerState(config)

    async def start_engine() -> None:
        try:
            llm = await asyncio.to_thread(AsyncLLM.from_config, config, state.metrics, start_timeout,
                                          state.cancel_start)
        except Exception as e:
            state.start_error = f"the engine failed to start: {e}"
            logger.error("%s", state.start_error)
            if state.uvicorn_server is not None:
                state.uvicorn_server.should_exit = True
            return
        state.served_model_name = default_served_model_name(config)
        if record_trace:
            from paged.core.lab.trace import TraceRecorder

            llm.trace_recorder = TraceRecorder(record_trace, "paged serve")
            logger.info("recording the served requests as a lab trace in %s", record_trace)
        state.tokens = _Tokens(llm.tokenizer)
        state.llm = llm
        logger.info("serving model %r", state.served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starter = asyncio.ensure_future(start_engine())
        try:
            yield
        finally:
            state.cancel_start.set()
            with suppress(BaseException):
                await asyncio.wait_for(starter, 30)
            if state.llm is not None:
                state.llm.shutdown()

    app = FastAPI(title="paged", lifespan=lifespan)
    app.state.paged = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return invalid(f"request: {e.errors()[0].get('msg', 'invalid')}").response()

    @app.exception_handler(PagedError)
    async def _paged_error(request: Request, e: PagedError):
        return _from_exception(e).response()

    if config.server.api_key:
        app.add_middleware(_APIKeyMiddleware, key=config.server.api_key)

    @app.get("/health")
    async def health():
        if state.llm is None or not state.llm.is_alive:
            reason = state.start_error or ("engine starting" if state.llm is None else "engine core is dead")
            return engine_unavailable(reason).response()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        from paged import __version__

        return {"version": __version__}

    @app.get("/debug/engine")
    async def debug_engine():
        llm = state.llm
        info: dict[str, Any] = {"ready": llm is not None, "alive": llm is not None and llm.is_alive,
                                "core_pid": llm.core_pid if llm else None, "error": state.start_error}
        if llm is not None:
            info["data_parallel_size"] = llm.num_cores
            info["core_pids"] = llm.core_pids
            info["front_end_unfinished_requests"] = llm.num_unfinished_requests
            info["model"] = {"name": state.served_model_name, **msgspec.structs.asdict(_ModelInfoView.of(llm))}
            if llm.is_alive:
                with suppress(Exception):
                    info["core"] = await llm.get_stats(timeout=5.0)
                    loads = llm.core_loads()
                    info["cores"] = [{"dp_rank": rank, "front_end_load": loads[rank], **stats}
                                     for rank, stats in enumerate(llm.last_core_stats)]
        return info

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        llm = state.llm
        state.metrics.core_alive = llm is not None and llm.is_alive
        if state.metrics.core_alive:
            with suppress(Exception):
                state.metrics.core_stats = await llm.get_stats(timeout=5.0)
                state.metrics.per_core_stats = llm.last_core_stats if llm.num_cores > 1 else None
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        llm = state.require_llm()
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "paged",
            "root": llm.model_info.model_dir, "max_model_len": llm.model_info.max_model_len,
        }]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        return await _unless_disconnected(request, _completions(state, body, request.headers.get("x-paged-tenant")))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        return await _unless_disconnected(request, _chat(state, body, request.headers.get("x-paged-tenant")))

    return app


class _APIKeyMiddleware:
    """``Authorization: Bearer <server.api_key>`` on /v1/*; a plain ASGI middleware, so that
    streamed responses and disconnect detection pass through untouched."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = APIError(401, "Incorrect API key provided. Pass it as `Authorization: Bearer <key>`.",
                                    "invalid_request_error", None, "invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ModelInfoView(msgspec.Struct):
    model_dir: str
    max_model_len: int
    num_blocks: int
    block_size: int

    @classmethod
    def of(cls, llm: AsyncLLM) -> "_ModelInfoView":
        m = llm.model_info
        return cls(m.model_dir, m.max_model_len, m.num_blocks, m.block_size)


async def _json(request: Request) -> Any:
    try:
        return msgspec.json.decode(await request.body())
    except msgspec.DecodeError as e:
        raise invalid(f"request body: invalid JSON ({e})") from None


# --- /v1/completions ---------------------------------------------------------------------------
def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt: must not be empty")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def _start(state: ServerState, request_id: str, prompts: list, params: SamplingParams, priority: int,
                 add_special_tokens: bool, tenant: str | None = None, deadline_s: float | None = None) -> list:
    llm = state.require_llm()
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await llm.add_request(rid, prompt, params, priority, add_special_tokens=add_special_tokens,
                                                 tenant=tenant, deadline_s=deadline_s))  # fmt: skip
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def _completions(state: ServerState, body: Any, tenant: str | None = None) -> Response:
    try:
        req: CompletionRequest = _parse(CompletionRequest, body)
        state.require_llm()
        state.check_model(req.model)
        if req.echo:
            raise invalid("echo: not supported", "echo")
        if req.suffix:
            raise invalid("suffix: not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise invalid(f"best_of: only best_of == n is supported (got {req.best_of}, n={req.n})", "best_of")
        params = _sampling_params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
        prompts = _prompts(req.prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await _start(state, request_id, prompts, params, req.priority, True, req.user or tenant, req.deadline_s)
    except Exception as e:
        return _from_exception(e).response()
    model = state.served_model_name
    created = int(time.time())
    n = params.n
    tok = state.tokens
    it = _merged(streams)

    if not req.stream:
        final: dict[int, RequestOutput] = {}
        try:
            async for i, out in it:
                final[i] = out
        except Exception as e:
            return _from_exception(e).response()
        if (rejection := _rejection(final.values())) is not None:
            return rejection
        choices, completion_tokens = [], 0
        for i in range(len(prompts)):
            for c in final[i].outputs:
                completion_tokens += len(c.token_ids)
                choices.append({
                    "index": i * n + c.index, "text": c.text,
                    "logprobs": _completion_logprobs(tok, c.logprobs, 0) if c.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                })
        prompt_tokens = sum(len(final[i].prompt_token_ids) for i in range(len(prompts)))
        return JSONResponse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)})

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    first = await _first(it)
    if isinstance(first, Response):
        return first

    async def events() -> AsyncIterator[bytes]:
        sent_finish: set[int] = set()
        offsets: dict[int, int] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        try:
            item = first
            while item is not None:
                i, out = item
                prompt_tokens[i] = len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    if index in sent_finish:
                        continue
                    completion_tokens[index] = len(c.token_ids)
                    if not c.new_text and not c.new_token_ids and not c.finished:
                        continue
                    logprobs = None
                    if c.logprobs is not None:
                        k = len(c.new_token_ids)
                        logprobs = _completion_logprobs(tok, c.logprobs[len(c.logprobs) - k:] if k else [],
                                                        offsets.get(index, 0))
                    offsets[index] = len(c.text)
                    if c.finished:
                        sent_finish.add(index)
                    choices.append({"index": index, "text": c.new_text, "logprobs": logprobs,
                                    "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason if c.finished else None})
                if choices:
                    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                             "choices": choices}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
                item = await anext(it, None)
            if include_usage:
                yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(sum(prompt_tokens.values()),
                                                           sum(completion_tokens.values()))})
        except Exception as e:
            yield _sse(_from_exception(e).body())
        finally:
            await it.aclose()
        yield _DONE

    return _EventStream(events(), media_type="text/event-stream")


async def _first(it) -> Any:
    """The first item of a merged stream, or an error Response (before any header is sent)."""
    try:
        first = await anext(it)
        rejection = _rejection([first[1]])
        if rejection is not None:
            await it.aclose()
            return rejection
        return first
    except StopAsyncIteration:
        return APIError(500, "the request produced no output", "server_error").response()
    except Exception as e:
        await it.aclose()
        return _from_exception(e).response()


# --- /v1/chat/completions ----------------------------------------------------------------------
def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise invalid(f"messages[{k}]: must be an object with 'role' and 'content'", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    raise invalid(f"messages[{k}].content: only text parts are supported", "messages")
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise invalid(f"messages[{k}].content: must be a string or a list of text parts", "messages")
        out.append({**m, "content": content})
    return out


async def _chat(state: ServerState, body: Any, tenant: str | None = None) -> Response:
    try:
        req: ChatCompletionRequest = _parse(ChatCompletionRequest, body)
        llm = state.require_llm()
        state.check_model(req.model)
        if req.tools:
            raise invalid("tools: not supported", "tools")
        if req.tool_choice not in (None, "none"):
            raise invalid("tool_choice: not supported", "tool_choice")
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise invalid("response_format: only {'type': 'text'} is supported", "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs: requires logprobs to be true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            params = _sampling_params(req, max_tokens, logprobs)
        except InvalidRequestError as e:
            msg = str(e)
            if req.logprobs and msg.startswith("logprobs:"):
                raise invalid("top_logprobs:" + msg[len("logprobs:"):], "top_logprobs") from None
            raise
        if not req.messages:
            raise invalid("messages: must not be empty", "messages")
        prompt = llm.apply_chat_template(_chat_messages(req.messages))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await _start(state, request_id, [prompt], params, req.priority, False, req.user or tenant,
                               req.deadline_s)  # fmt: skip
    except Exception as e:
        return _from_exception(e).response()
    model = state.served_model_name
    created = int(time.time())
    tok = state.tokens
    it = _merged(streams)

    if not req.stream:
        final = None
        try:
            async for _, out in it:
                final = out
        except Exception as e:
            return _from_exception(e).response()
        if (rejection := _rejection([final])) is not None:
            return rejection
        choices = [{
            "index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": _chat_logprobs(tok, c.logprobs) if c.logprobs is not None else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        } for c in final.outputs]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": _usage(len(final.prompt_token_ids), completion_tokens)})

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    first = await _first(it)
    if isinstance(first, Response):
        return first

    def chunk(choices: list, usage: Any = ...) -> bytes:
        data = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices}
        if usage is not ...:
            data["usage"] = usage
        elif include_usage:
            data["usage"] = None
        return _sse(data)

    async def events() -> AsyncIterator[bytes]:
        sent_finish: set[int] = set()
        prompt_tokens = 0
        completion_tokens: dict[int, int] = {}
        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(params.n)])
            item = first
            while item is not None:
                _, out = item
                prompt_tokens = len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    if c.index in sent_finish:
                        continue
                    completion_tokens[c.index] = len(c.token_ids)
                    if not c.new_text and not c.new_token_ids and not c.finished:
                        continue
                    logprobs = None
                    if c.logprobs is not None:
                        k = len(c.new_token_ids)
                        logprobs = _chat_logprobs(tok, c.logprobs[len(c.logprobs) - k:] if k else [])
                    if c.finished:
                        sent_finish.add(c.index)
                    delta = {"content": c.new_text} if c.new_text or not c.finished else {}
                    choices.append({"index": c.index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": c.finish_reason})
                if choices:
                    yield chunk(choices)
                item = await anext(it, None)
            if include_usage:
                yield chunk([], _usage(prompt_tokens, sum(completion_tokens.values())))
        except Exception as e:
            yield _sse(_from_exception(e).body())
        finally:
            await it.aclose()
        yield _DONE

    return _EventStream(events(), media_type="text/event-stream")


# --- running it --------------------------------------------------------------------------------
def _uvicorn_server_class():
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGINT/SIGTERM end it with a graceful shutdown and exit
        code 0 (uvicorn re-raises the signal afterwards, which would turn SIGINT into a traceback)."""

        @contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def run_server(config: EngineConfig, *, access_log: bool = False, log_level: str = "info",
               start_timeout: float = 600.0, record_trace: str | None = None) -> int:
    """Bind ``server.host:server.port`` (before the model loads, so a taken port fails at once),
    start the engine in the background and serve until SIGINT/SIGTERM. Returns an exit code."""
    import socket

    import uvicorn

    host, port = config.server.host, config.server.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PagedError(f"server.host/server.port: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    port = sock.getsockname()[1]
    app = build_app(config, start_timeout=start_timeout, record_trace=record_trace)
    uv_config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                               timeout_graceful_shutdown=10)
    server = _uvicorn_server_class()(uv_config)
    app.state.paged.uvicorn_server = server
    shown = f"[{host}]" if ":" in host else host
    logger.info("listening on http://%s:%d (OpenAI API under /v1)", shown, port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 1 if app.state.paged.start_error else 0

