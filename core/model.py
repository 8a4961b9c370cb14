"""The model contract: what the engine needs from a model architecture a plugin registers.

A ``ModelSpec`` (``paged.core.hookspecs``) names an HF ``architectures`` entry and a ``factory``
that satisfies ``ModelClass``; what the factory builds satisfies ``CausalLM``. The engine relies
on nothing else, and in this order:

1. ``factory.check_config(hf_config)`` (optional): raise ``ConfigError`` for a config the
   implementation cannot run (or ``ModelLoadError``). Called when the model config is resolved, before any weight loads.
2. ``factory.attention_shape(hf_config) -> AttentionShape``: the whole model's layers and heads
   (optional: without it the engine reads them off the HF config as Llama does, ``num_hidden_layers``,
   ``num_attention_heads``, ``num_key_value_heads`` and ``head_dim`` or ``hidden_size // heads``).
   The engine splits the heads over the tensor-parallel ranks (``shard_heads``) and builds the
   KV cache and the attention backend for this rank's share *before* the model, since the model
   is built around the backend. KV layout: per layer one ``(key_cache, value_cache)`` pair of
   ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the backend's ``allocate_kv_cache``).
3. ``factory(hf_config, backend, dtype, device) -> CausalLM``: build this rank's share directly
   on ``dtype``/``device`` (parameters uninitialised). Under tensor parallelism the layers of
   ``paged.models.layers`` read the current group and hold only their slice of each weight.
4. ``model.load_weights(weights)``: ``weights`` iterates ``(checkpoint_name, tensor)`` over the
   whole checkpoint on every rank (memory-mapped, so unread slices cost nothing); each rank
   copies the slices it holds. ``paged.core.loading.weights.load_checkpoint`` does this for
   any model whose parameterised modules declare ``checkpoint_slices`` (or hold whole
   checkpoint tensors) and names every missing, unexpected or mis-shaped tensor.
5. ``model.prepack_weights()`` (optional): one-time preparation after loading; called when the
   model runs in bfloat16 on a CPU and ``model.cpu_prepack_weights`` is on.
6. Per step: ``model(input_ids[T], positions[T], kv_caches, attn_metadata) -> hidden [T, H]``
   over the flattened batch (every rank), then ``model.compute_logits(hidden[N]) -> [N, vocab]``
   float32 on rank 0 and ``None`` on every other rank (the vocabulary-parallel head gathers
   onto rank 0, where the sampler lives). Each layer hands its ``kv_caches`` entry and
   ``attn_metadata`` to ``backend.forward(q, k, v, kv_cache, attn_metadata)`` untouched: with
   ``model.compile`` the entries are layer indices and the backend an opaque custom op
   (``paged.core.engine.compiled_step``); a model that reads its caches itself runs eager.

Per-layer attention settings (sliding window, logit soft-cap, softmax scale; see
``paged.core.attention``): a layer with any of them passes ``settings=AttentionSettings(...)`` to
``backend.forward`` (``paged.models.layers.Attention`` does, from its keyword arguments
``sliding_window``, ``logits_soft_cap`` and ``scale``) and checks at build time that the backend
declares them (``check_backend_supports``: a ``ConfigError`` naming backend, setting and value).
After building, the engine looks for the layers' settings (modules with an ``attn_settings``
attribute, ``paged.core.attention.kv_sliding_window``): when every one of the ``num_layers``
layers has a window, the KV manager returns the blocks behind the largest window to the pool; a
model whose layers do not declare settings is treated as global (nothing is freed early).
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Protocol, runtime_checkable

import torch

from paged.core.errors import ConfigError


class AttentionShape(NamedTuple):
    """The attention geometry of the whole model (before any tensor-parallel split)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@runtime_checkable
class CausalLM(Protocol):
    """A built model (one rank's share): forward over the paged cache, logits, weight loading."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` of the flattened batch."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Float32 ``[N, vocab_size]`` on tensor-parallel rank 0, None on the other ranks."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from the checkpoint's tensors or raise ``ModelLoadError``."""

    def eval(self) -> Any: ...


class ModelClass(Protocol):
    """What ``ModelSpec.factory`` is: usually the ``nn.Module`` subclass itself."""

    def __call__(self, hf_config: Any, backend: Any, dtype: torch.dtype, device: torch.device) -> CausalLM: ...

    def attention_shape(self, hf_config: Any) -> AttentionShape: ...


def model_attention_shape(factory: Any, architecture: str, hf_config: Any) -> AttentionShape:
    """``factory.attention_shape(hf_config)``, checked; a ConfigError naming the architecture if
    the factory does not provide it or gives something unusable."""
    fn = getattr(factory, "attention_shape", None)
    if fn is None:
        # The first contract (README at 402312c) had no attention_shape: the engine read the
        # shape off the HF config, as Llama does. A factory written for it still works.
        fn = _shape_from_hf_config
        if not all(hasattr(hf_config, name) for name in ("num_hidden_layers", "num_attention_heads", "hidden_size")):
            raise ConfigError(
                f"model architecture {architecture!r}: its ModelSpec.factory ({factory!r}) has no "
                "attention_shape(hf_config), and the config lacks num_hidden_layers / num_attention_heads / "
                "hidden_size to derive it from; add attention_shape (see paged.core.model.ModelClass)"
            )
    shape = AttentionShape(*(int(x) for x in fn(hf_config)))
    if min(shape) < 1 or shape.num_heads % shape.num_kv_heads:
        raise ConfigError(
            f"model architecture {architecture!r}: attention shape {tuple(shape)} is not usable "
            "(every entry must be positive and num_heads a multiple of num_kv_heads)"
        )
    return shape


def _shape_from_hf_config(hf_config: Any) -> AttentionShape:
    """The shape a Llama-like HF config states (``head_dim`` when it has one)."""
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return AttentionShape(int(hf_config.num_hidden_layers), num_heads, num_kv_heads, int(head_dim))
