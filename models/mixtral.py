"""Mixtral for causal LM: Llama attention (no biases) and in every layer a ``FusedMoE``
(``block_sparse_moe``: router ``gate``, experts' ``w1`` gate, ``w3`` up, ``w2`` down).

Routing as HF: softmax in float32, top ``num_experts_per_tok`` always renormalised, expert
outputs multiplied by the float32 weights. ``sliding_window`` (where it is smaller than
``max_position_embeddings``) is every layer's attention window.
"""

from __future__ import annotations

from typing import Any

from paged.models.llama import effective_sliding_window
from paged.models.moe import FusedMoE, check_moe_config
from paged.models.sparse_decoder import SparseMoeForCausalLM

__all__ = ["MixtralForCausalLM"]


class MixtralForCausalLM(SparseMoeForCausalLM):
    architecture = "MixtralForCausalLM"
    mlp_name = "block_sparse_moe"

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        check_moe_config(cls.architecture, hf_config, "num_local_experts")
        cls.check_window_value(hf_config)

    @classmethod
    def attention_options(cls, hf_config: Any, layer_idx: int) -> dict[str, Any]:
        return cls.window_options(effective_sliding_window(hf_config, getattr(hf_config, "sliding_window", None)))

    @classmethod
    def build_mlp(cls, hf_config: Any, layer_idx: int, *, dtype, device):
        return FusedMoE(
            hf_config.hidden_size, int(hf_config.num_local_experts), int(hf_config.num_experts_per_tok),
            int(hf_config.intermediate_size), norm_topk_prob=True, float32_routing_weights=True,
            expert_names=("w1", "w3", "w2"), dtype=dtype, device=device,
        )
