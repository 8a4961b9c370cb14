"""The pooling runner's endpoints (``paged serve --runner pooling``): ``POST /v1/embeddings``
(OpenAI's shapes: ``input`` a string, a list of strings, token ids or lists of them;
``encoding_format`` float or base64, ``dimensions`` where the model has Matryoshka dimensions;
vLLM's ``normalize`` and ``add_special_tokens`` extras), ``POST /score`` and ``/v1/score``
(vLLM's: ``text_1`` against ``text_2``), and ``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``
(Jina's and Cohere's: ``query``, ``documents``, ``top_n``, ``return_documents``), and
``POST /classify`` and ``/v1/classify`` (vLLM's: ``input`` as for embeddings; each item's
``label``, ``probs`` and ``num_classes``) for a classifier. A score is a classifier's
probability or the cosine similarity of two embeddings (``paged.core.frontend.scoring``). Each
input is one engine request; they run batched."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from paged.core.frontend.outputs import PoolingRequestOutput, RequestOutputKind
from paged.core.frontend.scoring import NOT_A_CLASSIFIER, classifier_prompts, cosine_scores, pair_up
from paged.core.pooling_params import PoolingParams
from paged.core.sampling_params import INT64_MAX, INT64_MIN
from paged.core.server.errors import APIError, from_exception, invalid, rejected, shutting_down
from paged.core.server.generation import accept
from paged.core.server.protocol import STRICT_MODEL
from paged.core.server.state import ServerState
from paged.core.server.streaming import merged


class EmbeddingRequest(BaseModel):
    model_config = STRICT_MODEL
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    normalize: bool | None = None
    add_special_tokens: bool = True
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)


class ClassificationRequest(BaseModel):
    model_config = STRICT_MODEL
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)


class ScoreRequest(BaseModel):
    model_config = STRICT_MODEL
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)


class RerankDocument(BaseModel):
    model_config = STRICT_MODEL
    text: str


class RerankRequest(BaseModel):
    model_config = STRICT_MODEL
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True
    max_chunks_per_doc: int | None = None  # Cohere v1's; accepted, unused (documents are not split)
    user: str | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)


def _inputs(value: Any, field: str = "input") -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise invalid(f"{field}: must not be empty")
    if isinstance(value[0], int):
        return [value]
    if any(not v for v in value):
        raise invalid(f"{field}: must not contain an empty input")
    return list(value)


def _pooling_engine(state: ServerState, request_type: type, body: Any):
    req, llm = accept(state, request_type, body)
    if state.lora_of(getattr(req, "model", None)) is not None:
        raise invalid(f"model: {req.model!r} is a LoRA adapter; adapters apply to generation, not to pooling", "model")
    if llm.model_info.pooling is None:
        raise invalid("model: this server generates (model.runner generate); embeddings, /score and /rerank need "
                      "paged serve --runner pooling", "model")
    return req, llm


def _check_count(state: ServerState, field: str, count: int) -> None:
    limit = state.config.server.max_samples_per_request
    if count > limit:
        raise invalid(f"{field}: {count} inputs; at most {limit} (server.max_samples_per_request)", field)


async def pool(state: ServerState, llm, request_id: str, inputs: list[str | list[int]], params: PoolingParams,
               add_special_tokens: bool = True, priority: int = 0, tenant: str | None = None,
               field: str = "input") -> list[PoolingRequestOutput]:
    """One engine request per input, all sent in one message (the core's next step holds them
    all); their outputs in input order. A failed or rejected one raises the APIError for the response."""
    token_ids = await state.inputs.tokenize(inputs, add_special_tokens, field)
    if state.draining:
        raise shutting_down()
    streams = await llm.add_requests([f"{request_id}-{i}" for i in range(len(inputs))], inputs, params, priority,
                                     add_special_tokens, token_ids, tenant, output_kind=RequestOutputKind.FINAL_ONLY)
    outputs: dict[int, PoolingRequestOutput] = {}
    async for i, out in merged(streams, state.open_merges):
        outputs[i] = out
    for out in outputs.values():
        if out.outputs is None:
            if out.finish_reason == "rejected":
                raise rejected(str(out.error or "rejected by the scheduling policy"))
            raise APIError(500, str(out.error or "the engine failed on this request"), "server_error", None,
                           "engine_error")
    return [outputs[i] for i in range(len(inputs))]


def _usage(outputs: list[PoolingRequestOutput]) -> dict[str, int]:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


async def embeddings(state: ServerState, body: Any, tenant: str | None = None) -> Response:
    try:
        req, llm = _pooling_engine(state, EmbeddingRequest, body)
        if llm.model_info.pooling.get("labels"):
            raise invalid("model: this server runs a classifier (its labels: "
                          f"{llm.model_info.pooling['labels']}); it serves /classify, /score and /rerank, not embeddings",
                          "model")
        inputs = _inputs(req.input)
        _check_count(state, "input", len(inputs))
        params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
        outputs = await pool(state, llm, f"embd-{uuid.uuid4().hex}", inputs, params, req.add_special_tokens,
                             req.priority, req.user or tenant)
    except Exception as e:
        return from_exception(e).response()
    data = []
    for i, out in enumerate(outputs):
        vector = out.outputs.data
        embedding = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                     if req.encoding_format == "base64" else vector.tolist())
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return JSONResponse({"object": "list", "data": data, "model": state.served_model_name, "usage": _usage(outputs)})


async def classify(state: ServerState, body: Any, tenant: str | None = None) -> Response:
    try:
        req, llm = _pooling_engine(state, ClassificationRequest, body)
        labels = llm.model_info.pooling.get("labels")
        if not labels:
            raise invalid(NOT_A_CLASSIFIER, "model")
        inputs = _inputs(req.input)
        _check_count(state, "input", len(inputs))
        outputs = await pool(state, llm, f"classify-{uuid.uuid4().hex}", inputs, PoolingParams(),
                             req.add_special_tokens, req.priority, req.user or tenant)
    except Exception as e:
        return from_exception(e).response()
    data = []
    for i, out in enumerate(outputs):
        probs = out.outputs.data
        data.append({"index": i, "label": labels[int(probs.argmax())], "probs": probs.tolist(),
                     "num_classes": len(probs)})
    return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": state.served_model_name, "data": data, "usage": _usage(outputs)})


async def _scores(state: ServerState, llm, pairs: list[tuple[str, str]], priority: int, tenant: str | None,
                  ) -> tuple[list[float], dict[str, int]]:
    """Each pair's score and the usage: a classifier's prompt per pair, else each distinct text
    embedded once (normalised) and the pairs' cosine similarities."""
    info = llm.model_info.pooling
    request_id = f"score-{uuid.uuid4().hex}"
    prompts = classifier_prompts(info, pairs)
    if prompts is not None:
        _check_count(state, "documents", len(prompts))
        outputs = await pool(state, llm, request_id, prompts, PoolingParams(), priority=priority, tenant=tenant,
                             field="documents")
        return [o.outputs.score for o in outputs], _usage(outputs)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    _check_count(state, "documents", len(texts))
    outputs = await pool(state, llm, request_id, texts, PoolingParams(normalize=True), priority=priority,
                         tenant=tenant, field="documents")
    vectors = {t: o.outputs.data for t, o in zip(texts, outputs)}
    return cosine_scores(pairs, vectors), _usage(outputs)


async def score(state: ServerState, body: Any, tenant: str | None = None) -> Response:
    try:
        req, llm = _pooling_engine(state, ScoreRequest, body)
        pairs = pair_up(req.text_1, req.text_2)
        scores, usage = await _scores(state, llm, pairs, req.priority, req.user or tenant)
    except Exception as e:
        return from_exception(e).response()
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": state.served_model_name, "usage": usage,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]})


async def rerank(state: ServerState, body: Any, tenant: str | None = None) -> Response:
    try:
        req, llm = _pooling_engine(state, RerankRequest, body)
        if not req.documents:
            raise invalid("documents: must not be empty", "documents")
        if req.top_n is not None and req.top_n < 0:
            raise invalid(f"top_n: invalid value {req.top_n}; must be >= 0 (0 or unset: every document)", "top_n")
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        scores, usage = await _scores(state, llm, pair_up(req.query, texts, ("query", "documents")), req.priority,
                                      req.user or tenant)
    except Exception as e:
        return from_exception(e).response()
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[:req.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": texts[i]}
        results.append(item)
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": state.served_model_name,
                         "usage": {"total_tokens": usage["total_tokens"]}, "results": results})

