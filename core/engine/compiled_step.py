"""``model.compile``: small steps through a compiled forward (``torch.compile``, inductor), with
each layer's attention an opaque custom op.

The model keeps calling ``backend.forward(q, k, v, kv_cache, attn_metadata)`` (with
``settings=`` for a layer with a sliding window, soft-cap or its own scale); when compiling, the
backend it holds is an ``OpaqueAttention``, whose ``forward`` is the custom op
``paged::attention(q, k, v, layer, backend_id, sliding_window, logits_soft_cap, scale)`` (the
settings as plain numbers, 0 for a default: constants of the graph), and the model gets the
layer indices where it would get the KV caches. Dynamo traces the dense part (embedding, norms, projections, rotary,
MLP) and never the paged cache or the backend's metadata object: the runner's ``CompiledForward``
keeps the step's caches and metadata here, and the op hands them to the real backend.

Only steps of at most ``model.compile_max_tokens`` tokens run compiled (by default 2: decode of
one or two requests, where eager per-op overhead is largest against the work); larger ones run
the same modules eagerly. Why not more: with quantized weights, larger batches use oneDNN's
packed dense copies (``mkldnn._linear_pointwise`` on a packed weight), which inductor cannot
lower; where that happens (or anything else fails to compile) the forward warns once and stays
eager. Measured (``benchmarks/compiled_step.py``, which runs this class): 1.16x at one request
and 1.18x at two with freezing and the C++ wrapper (the default here), 1.13x / 1.16x without, at
a start-up cost of 20-120 s on 2 cores (inductor's caches make later start-ups shorter).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from typing import Any

import torch
from torch import Tensor

from paged.core.attention import AttentionSettings

logger = logging.getLogger("paged")

# The step's KV caches and attention metadata (one engine core per process, one step at a
# time), and the backends the op can reach by id: ints cross the op boundary, objects cannot.
_step: dict[str, Any] = {"kv_caches": None, "metadata": None}
_backends: list[Any] = []


@functools.cache
def _settings_kwargs(sliding_window: int, logits_soft_cap: float, scale: float) -> dict[str, Any]:
    """``backend.forward``'s keyword arguments for the op's numbers (0: the default), built once."""
    settings = AttentionSettings(sliding_window or None, logits_soft_cap or None, scale or None)
    return {} if settings.is_default else {"settings": settings}


@torch.library.custom_op("paged::attention", mutates_args=())
def paged_attention(q: Tensor, k: Tensor, v: Tensor, layer: int, backend_id: int, sliding_window: int = 0,
                    logits_soft_cap: float = 0.0, scale: float = 0.0) -> Tensor:
    """The backend's paged attention for the current step's layer ``layer``: ``[T, H, D]`` like
    ``q``. It writes K/V into the step's cache, which lives outside the graph: the compiler sees
    no cache, so none is copied, functionalized or guarded. The last three: the layer's
    ``AttentionSettings`` (0 for a default field)."""
    kwargs = _settings_kwargs(sliding_window, logits_soft_cap, scale)
    out = _backends[backend_id].forward(q, k, v, _step["kv_caches"][layer], _step["metadata"], **kwargs)
    return out.reshape(q.shape).contiguous()  # a fresh tensor from the backend, never an input


@paged_attention.register_fake
def _(q, k, v, layer, backend_id, sliding_window=0, logits_soft_cap=0.0, scale=0.0):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@functools.cache
def _op_schema_in_cache_key() -> Any:
    """A post-grad pass that changes nothing and puts the schemas of paged's ops into inductor's
    cache key. Inductor's caches (in ``/tmp`` by default, kept across runs and
    versions) key a graph by its own code, which names the op but not its arguments: a graph
    compiled by a paged whose ops took other arguments would be reused and compute garbage.
    Built on first use: importing ``torch._inductor`` takes seconds."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class OpSchemaInCacheKey(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            # every op of paged's namespaces (attention, and the C++ kernels a graph may call)
            schemas = sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("paged"))
            return hashlib.sha256("\n".join(schemas).encode()).hexdigest()

    return OpSchemaInCacheKey()


class OpaqueAttention:
    """Stands for an attention backend inside a compiled model. In a compiled forward the
    model's "KV caches" are the layer indices (the model passes each layer its entry untouched,
    as the model contract says) and ``forward`` goes through ``paged::attention``; in an eager
    forward they are the real caches and ``forward`` is the backend's. Every other attribute is
    the backend's."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._id = len(_backends)
        _backends.append(backend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Any, attn_metadata: Any,
                settings: AttentionSettings | None = None) -> Tensor:
        if isinstance(kv_cache, int):  # decided while tracing: the compiled graph has only the op
            if settings is None:
                return torch.ops.paged.attention(q, k, v, kv_cache, self._id)
            return torch.ops.paged.attention(q, k, v, kv_cache, self._id, settings.sliding_window or 0,
                                             float(settings.logits_soft_cap or 0.0), float(settings.scale or 0.0))
        if settings is None:  # a backend written before the settings takes no such argument
            return self._backend.forward(q, k, v, kv_cache, attn_metadata)
        return self._backend.forward(q, k, v, kv_cache, attn_metadata, settings=settings)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class CompiledForward:
    """``forward(input_ids, positions, kv_caches, metadata)`` of a model built around an
    ``OpaqueAttention``: compiled for steps of at most ``max_tokens`` tokens, eager otherwise and
    for good after a compilation failure (one warning)."""

    # Freezing (weights as constants) and the C++ wrapper: 1.16-1.18x against 1.13-1.16x
    # without (benchmarks/compiled_step.py [--inductor-defaults], one run each).
    DEFAULT_OPTIONS = {"freezing": True, "cpp_wrapper": True}

    def __init__(self, model: torch.nn.Module, max_tokens: int, options: dict | None = None) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.failed = False
        self._layers: list[int] = []  # what the model passes on to each layer's attention
        options = dict(self.DEFAULT_OPTIONS if options is None else options)
        options.setdefault("post_grad_custom_post_pass", _op_schema_in_cache_key())
        self._compiled = torch.compile(model, dynamic=True, options=options)

    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches: list, metadata: Any) -> Tensor:
        if self.failed or input_ids.shape[0] > self.max_tokens:
            return self.model(input_ids, positions, kv_caches, metadata)
        _step["kv_caches"], _step["metadata"] = kv_caches, metadata
        if len(self._layers) != len(kv_caches):
            self._layers = list(range(len(kv_caches)))
        try:
            return self._compiled(input_ids, positions, self._layers, metadata)
        except Exception as e:  # inductor/dynamo errors have no common base: any failure falls back
            self.failed = True
            logger.warning("model.compile: compiling the forward failed, running eager from now on (%s: %s)",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return self.model(input_ids, positions, kv_caches, metadata)

    def warm_up(self, dummy_step) -> float:
        """Compile now for 1..max_tokens tokens (``dummy_step(n)`` runs one n-token forward
        through this object); returns the seconds it took."""
        start = time.perf_counter()
        for num_tokens in sorted({1, min(2, self.max_tokens), self.max_tokens}):
            if self.failed:
                break
            dummy_step(num_tokens)
        return time.perf_counter() - start
