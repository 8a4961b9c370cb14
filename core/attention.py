"""The paged-attention backend contract.

Once per step the model runner flattens the scheduled requests into ``BatchInputs``; the selected
backend turns that into its own metadata with ``build_metadata`` (shared by all layers); then each
attention layer calls ``forward``, which writes the new K/V into that layer's cache at
``slot_mapping`` and attends over each request's blocks: causal inside the new tokens, full over
the cached prefix, grouped-query (``num_heads`` a multiple of ``num_kv_heads``).

KV cache of one layer: a pair ``(k_cache, v_cache)``, each ``[num_blocks, block_size,
num_kv_heads, head_dim]``. Token ``j`` of a request lives in block ``block_table[j //
block_size]`` at offset ``j % block_size``; its slot is ``block_id * block_size + offset``.

Per-layer settings (``AttentionSettings``): a layer may attend over a sliding window of the last
``sliding_window`` positions (a query at position ``p`` sees keys at ``p - W < j <= p``, as HF
transformers does), soft-cap its logits (``scores = cap * tanh(scores / cap)`` on the scaled
scores, before the softmax) and use its own softmax scale (default ``head_dim ** -0.5``). The
contract for them, chosen so that backends written before them keep working:

- A layer whose settings are all default calls ``backend.forward(q, k, v, kv_cache, metadata)``
  exactly as before. A layer with any non-default setting calls ``backend.forward(q, k, v,
  kv_cache, metadata, settings=AttentionSettings(...))`` (keyword argument; the object is built
  once when the layer is, so a step costs nothing extra: no hook call, no allocation).
- A backend declares what it honours in the class attribute ``layer_features``: a frozenset of
  ``AttentionSettings`` field names (``FEATURES``); without the attribute, none.
  ``check_backend_supports`` is called when the layer is built (start-up): a layer that needs a
  feature its backend does not declare raises ``ConfigError`` naming the backend, the setting and
  its value; nothing is ever silently ignored.
- The metadata of ``build_metadata`` is per step and shared by every layer, whatever its
  settings; a backend that needs window-dependent planning builds it lazily, once per distinct
  setting and step.
- With windows, block-table entries of positions outside a request's window may point at a
  placeholder block (the KV manager frees blocks that fell out of every layer's window, see
  ``paged.core.engine.kv_cache_manager``): a backend must not read positions ``<= p - W`` for a
  windowed layer (reading and masking them is not enough if the block holds NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch

from paged.core.errors import ConfigError
from paged.core.tensors import zeros_untouched


@dataclass(frozen=True)
class AttentionLayout:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize * self.num_layers


@dataclass(frozen=True)
class AttentionSettings:
    """One layer's attention settings; every field None means the default (full causal
    attention, no soft-cap, scale ``head_dim ** -0.5``), and a default field is never a feature a
    backend must support. Hashable: backends key their lazily built per-setting plans on it."""

    sliding_window: int | None = None  # attend to the last W positions (the query's own included)
    logits_soft_cap: float | None = None  # scores = cap * tanh(scores / cap), after the scale
    scale: float | None = None  # the softmax scale; None: head_dim ** -0.5

    def __post_init__(self) -> None:
        w, cap, scale = self.sliding_window, self.logits_soft_cap, self.scale
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConfigError(f"attention sliding_window must be a positive integer or None, got {w!r}")
        for name, value in (("logits_soft_cap", cap), ("scale", scale)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"attention {name} must be a positive finite number or None, got {value!r}")

    @property
    def is_default(self) -> bool:
        return self.sliding_window is None and self.logits_soft_cap is None and self.scale is None

    def features(self) -> dict[str, float | int]:
        """The non-default settings, by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def softmax_scale(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else float(self.scale)


DEFAULT_SETTINGS = AttentionSettings()
FEATURES = frozenset(f.name for f in fields(AttentionSettings))


def check_backend_supports(backend: Any, settings: AttentionSettings, layer: str = "") -> None:
    """Raise ``ConfigError`` if ``settings`` uses a feature ``backend`` does not declare in its
    ``layer_features`` (see the module docstring); ``layer`` names the layer in the message."""
    supported = frozenset(getattr(backend, "layer_features", ()) or ())
    for name, value in settings.features().items():
        if name not in supported:
            where = f" (layer {layer})" if layer else ""
            raise ConfigError(
                f"attention backend {getattr(backend, 'name', type(backend).__name__)!r} does not support "
                f"{name}={value!r}{where}: it declares layer_features={sorted(supported)}; choose an attention "
                "backend that does (the bundled torch, triton and flashinfer backends support "
                f"{sorted(FEATURES)})"
            )


def kv_sliding_window(model: Any, num_layers: int) -> int | None:
    """The window the KV manager may free blocks behind: the largest ``sliding_window`` when
    every one of the model's ``num_layers`` layers declares one (a module attribute
    ``attn_settings``, as ``paged.models.layers.Attention`` has), else None. A model whose layers
    do not declare their settings counts as global: nothing is freed early."""
    windows = [m.attn_settings.sliding_window for m in model.modules()
               if isinstance(getattr(m, "attn_settings", None), AttentionSettings)]
    if len(windows) != num_layers or not windows or any(w is None for w in windows):
        return None
    return max(windows)


@dataclass
class BatchInputs:
    """One step's batch, flattened. Requests are ordered decodes first (query length 1), then
    prefill chunks; ``num_decodes`` says where the prefills start.

    Device tensors (on the model's device):
      query_start_loc [num_reqs + 1] int32: cumulative query lengths (0, q0, q0+q1, ...)
      seq_lens        [num_reqs] int32: tokens in context after this step (computed + new)
      block_table     [num_reqs, max_blocks_per_req] int32, padded with 0
      slot_mapping    [num_tokens] int64: where each new token's K/V is written
    CPU copies (for planning without a device sync): query_start_loc_cpu, seq_lens_cpu.
    """

    num_reqs: int
    num_tokens: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor


@runtime_checkable
class AttentionBackend(Protocol):
    """``layer_features`` (optional class attribute, a frozenset of ``FEATURES``): the
    ``AttentionSettings`` fields the backend honours; ``forward`` then takes ``settings=``."""

    name: str

    def __init__(self, layout: AttentionLayout, options: Any = None) -> None: ...

    def allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (k_cache, v_cache) pair per layer."""
        ...

    def build_metadata(self, batch: BatchInputs) -> Any:
        """Called once per step; the result is passed to every layer's ``forward``."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: Any,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def default_allocate_kv_cache(layout: AttentionLayout, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [
        (
            zeros_untouched(shape, layout.dtype, layout.device),
            zeros_untouched(shape, layout.dtype, layout.device),
        )
        for _ in range(layout.num_layers)
    ]


def write_kv_by_slot(
    key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write each new token's K/V at its slot; returns the caches viewed as
    ``[num_blocks * block_size, num_kv_heads, head_dim]`` (``view``: a non-contiguous cache fails
    loudly instead of being copied)."""
    k_cache, v_cache = kv_cache
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
    return k_flat, v_flat
