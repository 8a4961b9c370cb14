"""Rotary position embeddings (RoPE), shared by the decoder-only models: the default schedule
and the scaled variants of HF transformers (``rope_type`` linear, dynamic, yarn, longrope and
llama3; Phi-3's older name ``su`` for longrope), optionally over only the first part of each head
(``partial_rotary_factor``), with the settings read from an HF config. Re-exported by
``paged.models.layers``, where model plugins import them.

Every variant is a table of angles ``position * inv_freq`` for positions ``[0,
max_position_embeddings)`` (the engine never runs past them: ``model.max_model_len`` is capped
there), and a factor on cos and sin (yarn's and longrope's attention scaling; 1 otherwise)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paged.core.errors import ModelLoadError
from paged.models import cpu_layer_ops


SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")
_ROPE_ALIASES = {"su": "longrope"}  # Phi-3's first name for longrope
# the types whose parameters include the pretraining context (HF defaults it as rope_settings does)
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")


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
    scaling = dict(scaling) if scaling else None
    if scaling and rope_type_of(scaling) in _NEEDS_ORIGINAL and "original_max_position_embeddings" not in scaling:
        # as HF: Phi-3 keeps it beside rope_scaling; otherwise the config's own context
        original = getattr(hf_config, "original_max_position_embeddings", None) or getattr(
            hf_config, "max_position_embeddings", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
    return float(theta if theta is not None else 10000.0), scaling


def rope_type_of(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    name = str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")
    return _ROPE_ALIASES.get(name, name)


def rotary_dim_of(hf_config: Any, head_dim: int) -> int:
    """How many leading dimensions of each head rotate: ``head_dim * partial_rotary_factor``
    (read from ``rope_parameters`` or the config itself, as HF does; 1.0 when absent)."""
    params = getattr(hf_config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None)
    dim = int(head_dim * float(factor if factor is not None else 1.0))
    if dim < 2 or dim % 2 or dim > head_dim:
        raise ModelLoadError(
            f"partial_rotary_factor: {factor!r} gives {dim} rotary dimensions of a {head_dim}-wide head; "
            "it must give an even number between 2 and head_dim"
        )
    return dim


def _need(scaling: dict, key: str) -> Any:
    if scaling.get(key) is None:
        raise ModelLoadError(f"rope_scaling: rope_type {rope_type_of(scaling)!r} needs {key!r}; got {scaling!r}")
    return scaling[key]


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


def _yarn_inv_freq(dim: int, base: float, scaling: dict, max_positions: int) -> torch.Tensor:
    """YaRN: each frequency interpolated (divided by ``factor``) or kept by how many turns it
    makes over the pretraining context, with a linear ramp between ``beta_fast`` and
    ``beta_slow`` turns (HF's ``_compute_yarn_parameters``)."""
    factor = _yarn_factor(scaling, max_positions)
    original = float(_need(scaling, "original_max_position_embeddings"))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:  # the dimension whose wavelength makes `turns` turns over `original`
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _yarn_factor(scaling: dict, max_positions: int) -> float:
    factor = scaling.get("factor")
    if factor is None:
        return max_positions / float(_need(scaling, "original_max_position_embeddings"))
    return float(factor)


def _longrope_factor(scaling: dict, max_positions: int) -> float:
    # Phi-3 states no factor: the ratio of its context to the pretraining one (as HF)
    factor = scaling.get("factor")
    if factor is None:
        return max_positions / float(_need(scaling, "original_max_position_embeddings"))
    return float(factor)


def attention_factor(rope_scaling: dict | None, max_positions: int) -> float:
    """The factor on cos and sin (so on q and k): ``attention_factor`` when the config gives one,
    else yarn's ``0.1 ln(factor) + 1`` (or its mscale ratio) and longrope's ``sqrt(1 + ln(factor)
    / ln(original))``, both 1 for ``factor <= 1``; 1 for the other types."""
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    scaling = rope_scaling or {}
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if rope_type == "longrope":
        factor = _longrope_factor(scaling, max_positions)
        original = float(_need(scaling, "original_max_position_embeddings"))
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor = _yarn_factor(scaling, max_positions)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"])))
    return mscale()


def _longrope_inv_freq(dim: int, base: float, scaling: dict, key: str) -> torch.Tensor:
    ext = torch.tensor([float(x) for x in _need(scaling, key)], dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ModelLoadError(
            f"rope_scaling: longrope {key} has {ext.numel()} entries, the {dim} rotary dimensions need {dim // 2}"
        )
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def compute_inv_freq(
    head_dim: int, base: float, rope_scaling: dict | None, max_positions: int | None = None
) -> torch.Tensor:
    """The inverse frequencies ``[head_dim // 2]`` (``head_dim``: the rotary dimensions) of
    ``rope_scaling``'s type; longrope: its short factors (positions below
    ``original_max_position_embeddings``; ``rope_angles`` uses the long ones from there on).
    ``max_positions`` (the config's ``max_position_embeddings``) is where yarn and longrope take
    a missing ``factor`` from; dynamic NTK is the default schedule up to it (HF rescales only
    for sequences longer than that)."""
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_scaling: rope_type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}, or 'su' for longrope (or no rope_scaling)"
        )
    scaling = rope_scaling or {}
    if rope_type in ("yarn", "longrope") and max_positions is None:
        max_positions = int(scaling.get("original_max_position_embeddings") or 0) or None
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling, int(max_positions or 0))
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, base, scaling, "short_factor")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / float(_need(scaling, "factor"))
    elif rope_type == "dynamic":
        _need(scaling, "factor")  # used by HF only past max_position_embeddings, where the engine never runs
    return inv_freq


def rope_angles(rotary_dim: int, max_positions: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """``position * inv_freq`` for positions ``[0, max_positions)``, float32 ``[max_positions,
    rotary_dim // 2]``. Longrope: the short factors' frequencies below
    ``original_max_position_embeddings``, the long factors' from there on, so a sequence that
    grows past it keeps the keys it cached (as HF's generation does: short for a prompt within
    the pretraining context, long for each token after it)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    inv_freq = compute_inv_freq(rotary_dim, base, rope_scaling, max_positions)
    angles = torch.outer(positions, inv_freq)
    if rope_type_of(rope_scaling) == "longrope":
        original = int(_need(rope_scaling or {}, "original_max_position_embeddings"))
        if original < max_positions:
            long_inv = _longrope_inv_freq(rotary_dim, base, rope_scaling or {}, "long_factor")
            angles[original:] = torch.outer(positions[original:], long_inv)
    return angles


class RotaryEmbedding(nn.Module):
    """Neox / HF ``rotate_half`` rotary embedding over the first ``rotary_dim`` dimensions of
    each head (default: the whole head; the rest pass through unchanged).

    ``cos`` and ``sin`` ``[max_positions, rotary_dim // 2]`` are computed once in float32 (times
    the variant's attention factor, see ``attention_factor``); each call indexes them by
    ``positions`` (1-D, one per token) and rotates ``q [T, H, D]`` and ``k [T, Hkv, D]`` in their
    own dtype. ``max_positions`` is the config's ``max_position_embeddings``.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        rope_scaling: dict | None = None,
        *,
        rotary_dim: int | None = None,
        device=None,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if head_dim % 2 or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ModelLoadError(
                f"head_dim: rotary embedding needs an even head_dim and rotary dimensions, got head_dim "
                f"{head_dim}, rotary_dim {rotary_dim}"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        freqs = rope_angles(rotary_dim, max_positions, base, rope_scaling)
        scale = attention_factor(rope_scaling, max_positions)
        self.register_buffer("cos", (freqs.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(device), persistent=False)

    @classmethod
    def from_config(cls, hf_config: Any, head_dim: int, *, device=None) -> "RotaryEmbedding":
        """The rotary embedding an HF config states: ``rope_theta`` and the scaling of
        ``rope_settings``, ``partial_rotary_factor``, ``max_position_embeddings``."""
        theta, scaling = rope_settings(hf_config)
        return cls(head_dim, int(hf_config.max_position_embeddings), theta, scaling,
                   rotary_dim=rotary_dim_of(hf_config, head_dim), device=device)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, 1, rotary_dim // 2]`` for ``positions``, in ``dtype``: computed once
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
        if self.rotary_dim < self.head_dim:  # rotate the leading dimensions, pass the rest through
            r = self.rotary_dim
            q_rot, k_rot = self._rotate_both(query[..., :r], key[..., :r], cos, sin)
            return torch.cat((q_rot, query[..., r:]), dim=-1), torch.cat((k_rot, key[..., r:]), dim=-1)
        return self._rotate_both(query, key, cos, sin)

    def _rotate_both(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = cpu_layer_ops.enabled(query)
        if (ops is not None and cos.dtype == query.dtype == key.dtype and query.dim() == key.dim() == 3
                and query.stride(-1) == key.stride(-1) == 1):
            # one fused op instead of twelve
            return ops.rotary(query, key, cos, sin)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_positions={self.max_positions}"


# ---- MLP -------------------------------------------------------------------------------------
