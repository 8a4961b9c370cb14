"""Qwen3 for causal LM: the Llama model with an RMSNorm over each head of q and of k (weights of
``head_dim``, shared by the heads) after the projections and before rotary, no q/k/v bias unless
``attention_bias``, an explicit ``head_dim`` (``hidden_size`` need not be ``heads * head_dim``),
and a sliding window on the layers ``layer_types`` marks ``sliding_attention``.

``QKNormAttention`` is the attention layer with those norms; Qwen3-MoE builds its layers from it.
"""

from __future__ import annotations

from typing import Any

import torch

from paged.core.errors import ModelLoadError
from paged.models.direct_decoder import register_qk_norm_attention
from paged.models.layers import Attention, RMSNorm, RotaryEmbedding
from paged.models.llama import LlamaForCausalLM, attention_shape, effective_sliding_window

__all__ = ["QKNormAttention", "Qwen3ForCausalLM", "attention_shape", "qwen3_layer_window"]


class QKNormAttention(Attention):
    """``Attention`` with ``q_norm`` and ``k_norm``: RMSNorm over each head's ``head_dim`` values
    of q and k (one weight ``[head_dim]`` each, replicated on every tensor-parallel rank, as
    every rank's heads use it), applied after the fused QKV projection and before rotary, as
    HF's Qwen3 does. Everything else (fused QKV, per-layer settings, backend, o_proj) is
    ``Attention``'s."""

    norm_class: type = RMSNorm  # Gemma 3 uses its (1 + w) norm

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        backend: Any,
        *,
        eps: float,
        dtype: torch.dtype,
        device,
        **options: Any,
    ) -> None:
        """``options``: ``Attention``'s keyword arguments (biases, sliding_window, ...)."""
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, rotary, backend,
                         dtype=dtype, device=device, **options)
        self.q_norm = self.norm_class(head_dim, eps, dtype=dtype, device=device)
        self.k_norm = self.norm_class(head_dim, eps, dtype=dtype, device=device)

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
        # the norms read each head's values: [T, heads, head_dim] (the fused CPU RMSNorm takes it)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k, cos_sin)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata, **self._settings_kwargs)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


register_qk_norm_attention(QKNormAttention)  # its layers run as direct calls (paged.models.direct_decoder)


def qwen3_layer_window(hf_config: Any, layer_idx: int) -> int | None:
    """Layer ``layer_idx``'s sliding window as a Qwen3 (or Qwen3-MoE) config states it:
    ``sliding_window`` on the layers ``layer_types`` marks ``sliding_attention`` (a config
    without ``layer_types``: the layers from ``max_window_layers`` on, when
    ``use_sliding_window``), None elsewhere or where the window cannot matter."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != int(hf_config.num_hidden_layers):
            raise ModelLoadError(
                f"layer_types: {len(layer_types)} entries for num_hidden_layers {hf_config.num_hidden_layers}"
            )
        kind = layer_types[layer_idx]
        if kind not in ("full_attention", "sliding_attention"):
            raise ModelLoadError(
                f"layer_types[{layer_idx}]: {kind!r} is not supported; supported: 'full_attention', 'sliding_attention'"
            )
        sliding = kind == "sliding_attention"
    else:
        sliding = bool(getattr(hf_config, "use_sliding_window", False)) and layer_idx >= int(
            getattr(hf_config, "max_window_layers", 0) or 0)
    return effective_sliding_window(hf_config, window) if sliding else None


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``Qwen3ForCausalLM`` of HF: Llama's decoder with ``QKNormAttention``."""

    architecture = "Qwen3ForCausalLM"

    @classmethod
    def attention_options(cls, hf_config: Any, layer_idx: int) -> dict[str, Any]:
        window = qwen3_layer_window(hf_config, layer_idx)
        return {} if window is None else {"sliding_window": window}

    @classmethod
    def build_attention(
        cls, hf_config: Any, layer_idx: int, rotary: RotaryEmbedding, backend: Any, *, dtype: torch.dtype, device
    ) -> QKNormAttention:
        _, num_heads, num_kv_heads, head_dim = cls.attention_shape(hf_config)
        qkv_bias, o_bias, _ = cls.biases(hf_config)
        return QKNormAttention(
            hf_config.hidden_size, num_heads, num_kv_heads, head_dim, rotary, backend,
            eps=float(hf_config.rms_norm_eps), qkv_bias=qkv_bias, o_bias=o_bias, dtype=dtype, device=device,
            **cls.attention_options(hf_config, layer_idx),
        )

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        for i in range(int(hf_config.num_hidden_layers)):
            qwen3_layer_window(hf_config, i)  # a bad layer_types entry fails here, named
