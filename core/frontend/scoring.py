"""Scores of (query, document) pairs for ``LLM.score``, ``/score`` and ``/rerank``, the way vLLM
scores: with a classifier (the checkpoint's score head, or ``pooling.classifier_from_tokens``)
each pair is one prompt, ``pooling.score_template`` with the two texts put in, and its score
the classifier's probability of the last label; with an embedding model each text is embedded once and a pair's score is the
cosine similarity of the two embeddings."""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from paged.core.errors import InvalidRequestError

# what a classification request to an embedding model is told (LLM.classify, /classify)
NOT_A_CLASSIFIER = ("model: this engine embeds (no classifier); classification needs a *ForSequenceClassification "
                    "checkpoint or pooling.classifier_from_tokens")

_PLACEHOLDER = re.compile(r"\{query\}|\{document\}")


def pair_up(text_1: str | Sequence[str], text_2: str | Sequence[str], names=("text_1", "text_2")) -> list[tuple[str, str]]:
    """One query with each document, or the i-th of each list with each other."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in zip(names, (first, second)):
        if not texts:
            raise InvalidRequestError(f"{name}: must not be empty")
        if not all(isinstance(t, str) for t in texts):
            raise InvalidRequestError(f"{name}: must be a string or a list of strings")
    if len(first) == 1:
        return [(first[0], d) for d in second]
    if len(first) != len(second):
        raise InvalidRequestError(f"{names[0]}: {len(first)} texts for {len(second)} in {names[1]}; give one, "
                                  f"or as many as {names[1]} has")
    return list(zip(first, second))


def render_pair(template: str, query: str, document: str) -> str:
    """The template with ``{query}`` and ``{document}`` replaced in one pass (text inside either
    is never replaced again)."""
    return _PLACEHOLDER.sub(lambda m: query if m.group(0) == "{query}" else document, template)


def classifier_prompts(info: dict[str, Any], pairs: list[tuple[str, str]]) -> list[str] | None:
    """The prompts a classifier scores, or None for an embedding model (cosine similarity)."""
    if not info.get("labels"):
        return None
    return [render_pair(info["score_template"], q, d) for q, d in pairs]


def cosine_scores(pairs: list[tuple[str, str]], vectors: dict[str, np.ndarray]) -> list[float]:
    out = []
    for q, d in pairs:
        a, b = vectors[q], vectors[d]
        denom = float(np.linalg.norm(a) * np.linalg.norm(b))
        out.append(float(a @ b) / denom if denom > 0 else 0.0)
    return out
