"""Layers shared by the decoder-only models: the one place where norms, rotary, MLP and the
paged attention wrapper are defined.

All modules take flattened tokens: ``[num_tokens, ...]`` with a 1-D ``positions`` tensor, never
``[batch, seq, ...]``. Parameters are created uninitialised on the target dtype and device
(``load_weights`` fills every one of them, or fails) and never require grad.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged.core.errors import ModelLoadError

# ---- parameters without initialisation ------------------------------------------------------


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with an uninitialised weight ``[out_features, in_features]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype, device=device)
        if bias:
            self.bias = _empty_param(out_features, dtype=dtype, device=device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = _empty_param(num_embeddings, embedding_dim, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


# ---- RMSNorm ---------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back before the weight (as HF does).

    With ``residual`` it first adds ``x + residual`` and returns ``(normed, new_residual)``:
    the decoder layers keep the residual stream separate and fold the add into the norm.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param(hidden_size, dtype=dtype, device=device)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


# ---- rotary embedding ------------------------------------------------------------------------

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
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}"


# ---- MLP -------------------------------------------------------------------------------------


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one projection
    (``gate_up_proj.weight`` = rows of gate, then rows of up)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, *, dtype: torch.dtype, device
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# ---- attention -------------------------------------------------------------------------------


class Attention(nn.Module):
    """Fused QKV projection, rotary, the backend's paged attention, output projection.

    ``qkv_proj.weight`` = rows of q (``num_heads * head_dim``), then k, then v
    (``num_kv_heads * head_dim`` each). The attention itself (KV write + attend) is always
    ``backend.forward(q, k, v, kv_cache, attn_metadata)``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        backend: Any,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        dtype: torch.dtype,
        device,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, dtype=dtype, device=device)
        self.o_proj = Linear(self.q_size, hidden_size, o_bias, dtype=dtype, device=device)
        self.rotary = rotary  # one instance shared by all layers (buffers only, no weights)
        self.backend = backend  # not an nn.Module: holds no parameters

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: Any,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k, cos_sin)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))
