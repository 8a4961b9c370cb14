"""Rotary position embeddings (RoPE), shared by the decoder-only models: the default schedule
and Llama 3's frequency scaling, with the settings read from an HF config. Re-exported by
``paged.models.layers``, where model plugins import them."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paged.core.errors import ModelLoadError
from paged.models import cpu_layer_ops


SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_settings(hf_config: Any) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from an HF config, transformers 4.x (``rope_theta`` +
    ``rope_scaling``) or 5.x (``rope_parameters``, which holds both)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        scaling: dict | None = params
    else:
        theta = getattr(hf_config, "rope_theta", None)
        scaling = getattr(hf_config, "rope_scaling", None)
    return float(theta if theta is not None else 10000.0), (dict(scaling) if scaling else None)


def rope_type_of(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: wavelengths longer than ``original / low_freq_factor`` are
    divided by ``factor``, those shorter than ``original / high_freq_factor`` are kept, and the
    band in between is interpolated linearly in ``original / wavelength``."""
    try:
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ModelLoadError(
            f"rope_scaling: rope_type 'llama3' needs {e.args[0]!r}; got {scaling!r}"
        ) from None
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_band, interpolated, scaled)


def compute_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_scaling: rope_type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (or no rope_scaling)"
        )
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling or {})
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox / HF ``rotate_half`` rotary embedding over the whole head.

    ``cos`` and ``sin`` ``[max_positions, head_dim // 2]`` are computed once in float32; each call
    indexes them by ``positions`` (1-D, one per token) and rotates ``q [T, H, D]`` and
    ``k [T, Hkv, D]`` in their own dtype.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        rope_scaling: dict | None = None,
        *,
        device=None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ModelLoadError(f"head_dim: rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = compute_inv_freq(head_dim, base, rope_scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, 1, head_dim // 2]`` for ``positions``, in ``dtype``: computed once
        per forward by the model and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin if cos_sin is not None else self.lookup(positions, query.dtype)
        ops = cpu_layer_ops.enabled(query)
        if (ops is not None and cos.dtype == query.dtype == key.dtype and query.dim() == key.dim() == 3
                and query.stride(-1) == key.stride(-1) == 1):
            # one fused op instead of twelve
            return ops.rotary(query, key, cos, sin)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}"


# ---- MLP -------------------------------------------------------------------------------------
