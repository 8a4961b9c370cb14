"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of ``AsyncLLM``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent
events or not), ``POST /v1/responses`` with ``GET``/``DELETE /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` (``paged.core.server.responses``), ``POST /tokenize`` and
``POST /detokenize`` (vLLM's shapes); with ``--runner pooling`` ``POST /v1/embeddings``, ``/score``,
``/rerank`` and ``/classify`` (``paged.core.server.pooling``); ``GET /v1/models`` (with the LoRA
adapters; ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with
``lora.allow_runtime_lora_updating``: ``paged.core.server.lora``), ``GET /health`` (503 until the engine core is ready and
whenever it is dead), ``GET /metrics`` (Prometheus text), ``GET /version`` and
``GET /debug/engine`` (core pid, KV blocks free / total, running / waiting requests).
When the engine core dies the server exits non-zero or restarts the engine
(``server.on_engine_death``; see ``paged.core.server.state``).

With ``--data-parallel-size N`` the engine is N core processes behind this one front-end (see
``paged.core.frontend.async_llm``): /health is 200 only while all N run, the core metrics and
/debug/engine's ``core`` are combined over the cores (``paged.core.frontend.dp_stats``), and /debug/engine's
``cores`` lists each core's own stats plus the front-end's load on it; /metrics adds per-core
gauges labelled ``dp_rank`` when N > 1.

Errors, every one (unexpected ones too), are OpenAI-shaped: ``{"error": {"message", "type",
"param", "code"}}`` with 400 for an invalid request (paged's InvalidRequestError messages, which
name the field), 401 for a missing or wrong API key (see ``guard``), 404 for an unknown model or
path, 413 for a body over ``server.max_body_bytes``, 415 for a body that is not JSON and 503
while the engine core is not running or the server is shutting down. The engine starts in the background, so the server
answers /health (with 503) while the model loads.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager, suppress
from typing import Any, Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged.core.config import EngineConfig
from paged.core.errors import PagedError
from paged.core.frontend.async_llm import AsyncLLM
from paged.core.server.chat import chat
from paged.core.server.completions import completions
from paged.core.server.errors import APIError, engine_unavailable, from_exception, invalid
from paged.core.server.guard import Guard, read_json
from paged.core.server.protocol import TENANT_HEADER, tenant_header
from paged.core.server.state import ServerState
from paged.core.server.streaming import unless_disconnected
from paged.core.server import lora, pooling, responses
from paged.core.server.lora import check_lora_serving
from paged.core.server.responses import ResponseStore
from paged.core.server.tokenize import detokenize, tokenize

logger = logging.getLogger("paged")


class _ModelInfoView(msgspec.Struct):
    model_dir: str
    max_model_len: int
    num_blocks: int
    block_size: int

    @classmethod
    def of(cls, llm: AsyncLLM) -> "_ModelInfoView":
        m = llm.model_info
        return cls(m.model_dir, m.max_model_len, m.num_blocks, m.block_size)


def build_app(config: EngineConfig, start_timeout: float = 600.0,
              make_trace_recorder: Callable[[], Any] | None = None) -> FastAPI:
    """``make_trace_recorder``: called once the engine is up, returns an observer of the served
    requests (``add``/``discard``/``finish``; ``paged serve --record-trace`` passes the lab's)."""
    from paged.core.server.state import default_served_model_name

    check_lora_serving(config, default_served_model_name(config))
    state = ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.begin_start(start_timeout, make_trace_recorder)
        try:
            yield
        finally:
            await state.close()

    # No docs pages: they would be one more unauthenticated surface (and the OpenAI API is documented).
    app = FastAPI(title="paged", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.paged = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return invalid(f"request: {e.errors()[0].get('msg', 'invalid')}").response()

    @app.exception_handler(PagedError)
    async def _paged_error(request: Request, e: PagedError):
        return from_exception(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", "invalid_request_error",
                        None, code).response()

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, e: Exception):
        logger.exception("unexpected error answering %s %s", request.method, request.url.path)
        return from_exception(e).response()

    app.add_middleware(Guard, server=config.server)

    @app.get("/health")
    async def health():
        reason = state.engine_down()
        if reason is not None:
            return engine_unavailable(reason).response()
        lost = state.llm.lost_ranks
        if lost:  # data_parallel_on_core_loss: continue, with cores lost: serving, on fewer cores
            return JSONResponse({"status": "degraded", "data_parallel_size": state.llm.num_cores,
                                 "cores_serving": state.llm.num_cores - len(lost),
                                 "lost_cores": {str(rank): why for rank, why in lost.items()}})
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
                try:
                    core = await llm.get_stats(timeout=5.0)
                    loads = llm.core_loads()
                    cores = [{"front_end_load": loads[stats["dp_rank"]], **stats} for stats in llm.last_core_stats]
                except Exception as e:  # e.g. a core too busy to answer in time: say why there are no stats
                    detail = str(e) or ("no answer from the engine cores within 5 s"
                                        if isinstance(e, TimeoutError) else "no message")
                    info["stats_error"] = f"{type(e).__name__}: {detail}"
                else:
                    info["core"], info["cores"] = core, cores
            if llm.lost_ranks:
                info["lost_cores"] = {str(rank): why for rank, why in llm.lost_ranks.items()}
        return info

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        llm = state.llm
        state.metrics.core_alive = llm is not None and llm.is_alive
        state.metrics.cores_serving = llm.num_cores - len(llm.lost_ranks) if state.metrics.core_alive else 0
        if state.metrics.core_alive:
            with suppress(Exception):
                state.metrics.core_stats = await llm.get_stats(timeout=5.0)
                state.metrics.per_core_stats = llm.last_core_stats if llm.num_cores > 1 else None
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        llm = state.require_llm()
        return {"object": "list", "data": lora.model_cards(state, llm.model_info.max_model_len)}

    if config.lora.allow_runtime_lora_updating:  # off by default: the routes do not exist then (404)
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter_route(request: Request):
            return await lora.load_adapter(state, await read_json(request, config.server.max_body_bytes))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter_route(request: Request):
            return await lora.unload_adapter(state, await read_json(request, config.server.max_body_bytes))

    @app.post("/v1/completions")
    async def completions_route(request: Request):
        body = await read_json(request, config.server.max_body_bytes)
        tenant = tenant_header(request.headers.get(TENANT_HEADER))
        return await unless_disconnected(request, completions(state, body, tenant))

    @app.post("/v1/chat/completions")
    async def chat_completions_route(request: Request):
        body = await read_json(request, config.server.max_body_bytes)
        tenant = tenant_header(request.headers.get(TENANT_HEADER))
        return await unless_disconnected(request, chat(state, body, tenant))

    response_store = ResponseStore(config.server.max_stored_responses)

    @app.post("/v1/responses")
    async def responses_route(request: Request):
        body = await read_json(request, config.server.max_body_bytes)
        tenant = tenant_header(request.headers.get(TENANT_HEADER))
        return await unless_disconnected(request, responses.create(state, response_store, body, tenant))

    @app.get("/v1/responses/{response_id}")
    async def get_response_route(response_id: str):
        return await responses.retrieve(state, response_store, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response_route(response_id: str):
        return await responses.cancel(state, response_store, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response_route(response_id: str):
        return await responses.delete(state, response_store, response_id)

    @app.post("/v1/embeddings")
    async def embeddings_route(request: Request):
        body = await read_json(request, config.server.max_body_bytes)
        tenant = tenant_header(request.headers.get(TENANT_HEADER))
        return await unless_disconnected(request, pooling.embeddings(state, body, tenant))

    async def score_route(request: Request):
        body = await read_json(request, config.server.max_body_bytes)
        tenant = tenant_header(request.headers.get(TENANT_HEADER))
        return await unless_disconnected(request, pooling.score(state, body, tenant))

    async def rerank_route(request: Request):
        body = await read_json(request, config.server.max_body_bytes)
        tenant = tenant_header(request.headers.get(TENANT_HEADER))
        return await unless_disconnected(request, pooling.rerank(state, body, tenant))

    async def classify_route(request: Request):
        body = await read_json(request, config.server.max_body_bytes)
        tenant = tenant_header(request.headers.get(TENANT_HEADER))
        return await unless_disconnected(request, pooling.classify(state, body, tenant))

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score_route, methods=["POST"])
    for path in ("/classify", "/v1/classify"):
        app.add_api_route(path, classify_route, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank_route, methods=["POST"])

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenize(state, await read_json(request, config.server.max_body_bytes))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await detokenize(state, await read_json(request, config.server.max_body_bytes))

    return app

