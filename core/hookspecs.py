"""The extension points of paged, and where their contracts are.

Each hook is a *registration* hook: it is called once, when plugins are loaded at start-up, and
returns plain objects (specs) that the core keeps in registries. Nothing here is called per step
or per request: a pluggy call costs microseconds, the hot path costs none.

A plugin is a module (found through the ``paged`` entry-point group) that implements any of::

    from paged.core.hookspecs import hookimpl, PolicySpec

    @hookimpl
    def register_policies():
        return [PolicySpec(name="shortest-first", factory=ShortestFirst, options=ShortestOptions)]

The contracts the specs' factories meet: ``paged.core.policy`` (scheduling policies),
``paged.core.attention`` (attention backends), ``paged.core.structured_output`` (grammar
backends for structured outputs), ``paged.core.quantization`` (weight-only quantization
methods; ``QuantizationMethodSpec`` is re-exported here), ``paged.core.model`` (model
architectures; ``AttentionShape``, ``CausalLM`` and ``ModelClass`` are re-exported here) and
``paged.core.speculative`` (speculative-decoding proposers), ``paged.core.pooling`` (poolers of
the pooling runner: embeddings) and ``paged.core.lora`` (the kernels that apply LoRA adapters).

What a plugin's code may raise while the engine serves, and what the engine then does (the
request ends with an error, or the engine stops), is in ``paged.core.engine.plugin_faults``. A model plugin builds
its layers from ``paged.models.layers`` (tensor-parallel linears, embeddings, norms, rotary,
attention) and loads its checkpoint with ``paged.core.loading.weights.load_checkpoint``;
``tests/fixtures/paged-gpt2-plugin`` is a complete example.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy
from pydantic import BaseModel

from paged.core.model import AttentionShape, CausalLM, ModelClass
from paged.core.quantization import QuantizationMethodSpec

__all__ = [
    "AttentionBackendSpec", "AttentionShape", "CausalLM", "ModelClass", "ModelSpec", "PagedHookSpecs",
    "LoRAKernelSpec", "PolicySpec", "PoolerSpec", "QuantizationMethodSpec", "SpeculativeProposerSpec", "StructuredOutputBackendSpec", "hookimpl",
    "hookspec",
]

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

    ``factory`` meets ``ModelClass`` (see ``paged.core.model`` for the whole contract, in the
    order the engine uses it): ``factory.attention_shape(hf_config) -> AttentionShape`` (without
    it, the shape is read off a Llama-like config), optionally ``factory.check_config(hf_config)``,
    and ``factory(hf_config, backend, dtype,
    device) -> CausalLM`` with ``load_weights``, ``forward(input_ids, positions, kv_caches,
    attn_metadata)``, ``compute_logits`` (rank 0 returns the logits, other ranks None) and
    optionally ``prepack_weights``. ``paged.models.llama`` is the reference implementation.
    """

    architecture: str
    factory: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class StructuredOutputBackendSpec:
    """A grammar engine for structured outputs (see paged.core.structured_output).

    ``factory(tokenizer, vocab_size, eos_token_ids, options) -> StructuredOutputBackend`` (built
    in the engine core, off the step, on the first constrained request); ``validate(params,
    options)`` checks a ``StructuredOutputParams`` without a tokenizer (the front-end calls it before
    queueing) and raises ``ValueError`` naming the problem. ``is_available()`` returns
    ``(ok, reason)`` (e.g. the engine's package is not installed) and never raises.
    """

    name: str
    factory: Callable[..., Any]
    validate: Callable[[Any, Any], None]
    options: type[BaseModel] | None = None
    description: str = ""
    is_available: Callable[[], tuple[bool, str]] = field(default=lambda: (True, ""))


@dataclass(frozen=True)
class SpeculativeProposerSpec:
    """A speculative-decoding proposer (see paged.core.speculative), selected by
    ``speculative.method``: ``factory(options, context) -> SpeculativeProposer``, built once in the
    engine core; ``options`` validates ``speculative.options`` (and the extra keys of
    ``--speculative-config``)."""

    name: str
    factory: Callable[..., Any]
    options: type[BaseModel] | None = None
    description: str = ""


@dataclass(frozen=True)
class PoolerSpec:
    """A pooler of the pooling runner (see paged.core.pooling), selected by ``pooling.pooler``:
    ``factory(options, context) -> Pooler``, built once in the engine core; ``options`` validates
    ``pooling.options``."""

    name: str
    factory: Callable[..., Any]
    options: type[BaseModel] | None = None
    description: str = ""


@dataclass(frozen=True)
class LoRAKernelSpec:
    """A kernel that adds the requests' LoRA adapters to a linear layer's output (see
    paged.core.lora), selected by ``lora.kernel``: ``factory(options, context) -> LoRAKernel``,
    built once per engine core when LoRA is enabled. ``is_available(device)`` returns ``(ok,
    reason)``, cheap and never raising: whether ``lora.kernel=auto`` may pick it (the available
    kernel with the highest ``auto_priority`` wins) and what error selecting it gives."""

    name: str
    factory: Callable[..., Any]
    options: type[BaseModel] | None = None
    description: str = ""
    is_available: Callable[[str], tuple[bool, str]] = field(default=lambda device: (True, ""))
    auto_priority: int = 0


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
    def register_structured_output_backends(self) -> list[StructuredOutputBackendSpec]:
        """Return the structured-output (grammar) backends this plugin provides."""

    @hookspec
    def register_quantization_methods(self) -> list[QuantizationMethodSpec]:
        """Return the weight-only quantization methods this plugin provides, selected by
        ``model.quantization`` (contract: ``paged.core.quantization``; ``QuantizationMethodSpec``
        is re-exported here)."""

    @hookspec
    def register_speculative_proposers(self) -> list[SpeculativeProposerSpec]:
        """Return the speculative-decoding proposers this plugin provides, selected by
        ``speculative.method`` (contract: ``paged.core.speculative``)."""

    @hookspec
    def register_poolers(self) -> list[PoolerSpec]:
        """Return the poolers this plugin provides, selected by ``pooling.pooler`` (contract:
        ``paged.core.pooling``)."""

    @hookspec
    def register_lora_kernels(self) -> list[LoRAKernelSpec]:
        """Return the LoRA kernels this plugin provides, selected by ``lora.kernel`` (contract:
        ``paged.core.lora``)."""
