"""The extension points of paged.

Each hook is a *registration* hook: it is called once, when plugins are loaded at start-up, and
returns plain objects (specs) that the core keeps in registries. Nothing here is called per step
or per request: a pluggy call costs microseconds, the hot path costs none.

A plugin is a module (found through the ``paged`` entry-point group) that implements any of::

    from paged.core.hookspecs import hookimpl, PolicySpec

    @hookimpl
    def register_policies():
        return [PolicySpec(name="shortest-first", factory=ShortestFirst, options=ShortestOptions)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy
from pydantic import BaseModel

PROJECT = "paged"
ENTRY_POINT_GROUP = "paged"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class PolicySpec:
    """A scheduling policy: ``factory(options) -> SchedulingPolicy`` (see paged.core.policy)."""

    name: str
    factory: Callable[[Any], Any]
    options: type[BaseModel] | None = None
    description: str = ""


@dataclass(frozen=True)
class AttentionBackendSpec:
    """A paged-attention backend: ``factory(layout, options) -> AttentionBackend``
    (see paged.core.attention).

    ``is_available()`` returns ``(ok, reason)`` and must be cheap and never raise: it decides
    whether ``attention=auto`` may pick the backend and what error selecting it gives.
    ``auto_priority``: higher is preferred by ``attention=auto`` among the available ones.
    """

    name: str
    factory: Callable[..., Any]
    options: type[BaseModel] | None = None
    description: str = ""
    is_available: Callable[[str], tuple[bool, str]] = field(default=lambda device: (True, ""))
    auto_priority: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """A model architecture, keyed by the HF ``architectures`` name in config.json.

    ``factory(hf_config, backend, dtype, device) -> nn.Module`` with ``load_weights``,
    ``forward(input_ids, positions, kv_caches, attn_metadata)`` and ``compute_logits`` (see
    paged.models.llama, the reference implementation).
    """

    architecture: str
    factory: Callable[..., Any]
    description: str = ""


class PagedHookSpecs:
    @hookspec
    def register_policies(self) -> list[PolicySpec]:
        """Return the scheduling policies this plugin provides."""

    @hookspec
    def register_attention_backends(self) -> list[AttentionBackendSpec]:
        """Return the paged-attention backends this plugin provides."""

    @hookspec
    def register_models(self) -> list[ModelSpec]:
        """Return the model architectures this plugin provides."""

    @hookspec
    def register_quantization_methods(self) -> list[Any]:
        """Return the weight-only quantization methods this plugin provides
        (``paged.core.quantization.QuantizationMethodSpec``), selected by ``model.quantization``."""
