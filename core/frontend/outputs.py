"""What the engine hands back for each request, and how often (``RequestOutputKind``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class RequestOutputKind(enum.Enum):
    """What a request's consumer is handed, chosen when the request is added (as vLLM's
    ``RequestOutputKind``). ``new_text`` / ``new_token_ids`` are always what was added since the
    previous output handed to this consumer.

    CUMULATIVE: an output at every step with the whole output so far. ``token_ids`` and
        ``logprobs`` are the request's own growing lists, shared rather than copied: an output
        kept while the request runs sees the later tokens too (copy them to keep a snapshot).
        ``text`` is the text so far (a new string each step: the one thing rebuilt).
    DELTA: an output at every step in which a sample changed, holding only those samples and
        only what changed: ``text``, ``token_ids`` and ``logprobs`` are the increments (equal to
        ``new_text`` / ``new_token_ids``); concatenated, they are the final output. A sample's
        finish reason comes once, with its last increment.
    FINAL_ONLY: one output, once every sample has finished, with the whole text, token ids
        and logprobs.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "rejected" | "error"
    # the stop string or stop token that ended it; with "rejected" the policy's reason, with
    # "error" the failure (who raised, in which method, what)
    stop_reason: str | int | None = None
    logprobs: list[Any] | None = None  # per generated token: paged.core.engine.sampler.TokenLogprobs
    new_text: str = ""  # text added since the previous output of this request (streaming)
    new_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    tool_calls: list[Any] | None = None  # LLM.chat with tools: the parsed calls (paged.core.frontend.tools.ToolCall)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one TokenLogprobs
    # (the prompt's token, its rank, the top-k) per prompt token; from the first output on
    prompt_logprobs: list[Any] | None = None


@dataclass
class PoolingOutput:
    """A pooling request's vector (float32), after ``normalize`` and ``dimensions``. For a
    classifier (the checkpoint's score head, or ``pooling.classifier_from_tokens``) ``data``
    holds the labels' probabilities (the head's activation applied) and ``score`` the last
    label's: a one-label cross-encoder's relevance, or "yes" of ``no,yes``."""

    data: np.ndarray
    score: float | None = None

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        """A classifier's label probabilities (vLLM's ``ClassificationOutput.probs``)."""
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    """One pooling request's result (``LLM.embed`` / ``encode`` / ``score``, ``/v1/embeddings``):
    ``outputs`` is None when it did not finish normally (``finish_reason`` "abort", "rejected",
    "error"; ``error`` says why)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None
    finished: bool = True
    finish_reason: str | None = "stop"
    error: str | None = None
    metrics: RequestMetrics | None = None


def pooled_output(raw: bytes, normalize: bool | None, dimensions: int | None, info: dict) -> PoolingOutput:
    """The engine's raw vector as the request asked for it: a classifier's logits become
    probabilities (``info["activation"]``); an embedding keeps its first ``dimensions`` values and
    is L2-normalised when ``normalize`` (None: the engine's ``pooling.normalize``) or
    ``dimensions`` says so."""
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    if info.get("labels"):
        probs = _ACTIVATIONS[info.get("activation") or "softmax"](vector).astype(np.float32)
        return PoolingOutput(probs, float(probs[-1]))
    vector = vector.astype(np.float32)
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize is None:  # the engine's default; a truncated Matryoshka vector is renormalised
        normalize = info.get("normalize", True) or dimensions is not None
    if normalize:
        norm = float(np.linalg.norm(vector))
        if norm > 0:
            vector = vector / norm
    return PoolingOutput(vector.astype(np.float32))


def _softmax(x: np.ndarray) -> np.ndarray:
    exp = np.exp(x - x.max())
    return exp / exp.sum()


_ACTIVATIONS = {"sigmoid": lambda x: 0.5 * (1.0 + np.tanh(0.5 * x)), "softmax": _softmax, "tanh": np.tanh,
                "none": lambda x: x}
