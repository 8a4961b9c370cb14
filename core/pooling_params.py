"""Per-request parameters of a pooling request (an embedding or a score), validated when made."""

from __future__ import annotations

from dataclasses import dataclass

from paged.core.errors import InvalidRequestError

# what a request for the other runner is told (front-end and engine core alike)
NOT_A_POOLING_ENGINE = ("model.runner: this engine generates (runner generate); embeddings and scores need an "
                        "engine started with --runner pooling")
NOT_A_GENERATING_ENGINE = ("model.runner: this engine pools (runner pooling: embeddings, /score, /rerank); "
                           "completions and chat need an engine started with --runner generate")


@dataclass
class PoolingParams:
    """``normalize``: L2-normalise the vector (None: the engine's ``pooling.normalize``);
    ``dimensions``: keep only the first d values, then normalise (Matryoshka embeddings; only
    where the model supports it). Both are applied by the front-end to the pooled vector."""

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize: invalid value {self.normalize!r}; must be true, false or null")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions: invalid value {self.dimensions!r}; must be an integer >= 1")
