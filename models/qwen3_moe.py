"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) for causal LM: Qwen3's attention (per-head q/k
RMSNorm, ``paged.models.qwen3.QKNormAttention``; biases only with ``attention_bias``) and a
``FusedMoE`` in each sparse layer, without a shared expert.

Sparse layers by HF's rule (``paged.models.qwen2_moe.is_sparse_layer``: ``mlp_only_layers``,
``decoder_sparse_step``), dense ``GatedMLP`` of ``intermediate_size`` elsewhere. Routing: softmax
in float32, top ``num_experts_per_tok``, renormalised when ``norm_topk_prob`` (true in the
released checkpoints), weights rounded to the activations' dtype. The sliding window, where
``use_sliding_window``, is Qwen3's (``qwen3_layer_window``).
"""

from __future__ import annotations

from typing import Any

from paged.models.layers import GatedMLP, RotaryEmbedding
from paged.models.moe import FusedMoE, check_moe_config
from paged.models.qwen2_moe import is_sparse_layer
from paged.models.qwen3 import QKNormAttention, qwen3_layer_window
from paged.models.sparse_decoder import SparseMoeForCausalLM

__all__ = ["Qwen3MoeForCausalLM"]


class Qwen3MoeForCausalLM(SparseMoeForCausalLM):
    architecture = "Qwen3MoeForCausalLM"

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        if any(is_sparse_layer(hf_config, i) for i in range(int(hf_config.num_hidden_layers))):
            check_moe_config(cls.architecture, hf_config, "num_experts")
        cls.check_window_value(hf_config)
        for i in range(int(hf_config.num_hidden_layers)):
            qwen3_layer_window(hf_config, i)  # a bad layer_types entry fails here, named

    @classmethod
    def attention_options(cls, hf_config: Any, layer_idx: int) -> dict[str, Any]:
        return cls.window_options(qwen3_layer_window(hf_config, layer_idx))

    @classmethod
    def build_attention(cls, hf_config: Any, layer_idx: int, rotary: RotaryEmbedding, backend: Any, *, dtype, device):
        """Qwen3's ``QKNormAttention``, biases as ``attention_bias`` (Llama's ``biases``)."""
        _, num_heads, num_kv_heads, head_dim = cls.attention_shape(hf_config)
        qkv_bias, o_bias, _ = cls.biases(hf_config)
        return QKNormAttention(
            hf_config.hidden_size, num_heads, num_kv_heads, head_dim, rotary, backend,
            eps=float(hf_config.rms_norm_eps), qkv_bias=qkv_bias, o_bias=o_bias, dtype=dtype, device=device,
            **cls.attention_options(hf_config, layer_idx),
        )

    @classmethod
    def build_mlp(cls, hf_config: Any, layer_idx: int, *, dtype, device):
        if is_sparse_layer(hf_config, layer_idx):
            return FusedMoE(
                hf_config.hidden_size, int(hf_config.num_experts), int(hf_config.num_experts_per_tok),
                int(hf_config.moe_intermediate_size), norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
                dtype=dtype, device=device,
            )
        return GatedMLP(hf_config.hidden_size, int(hf_config.intermediate_size), dtype=dtype, device=device)
