"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) for causal LM: Qwen2 attention (q/k/v biases), and
in each sparse layer a ``FusedMoE`` plus a shared expert every token goes through, scaled by
``sigmoid(shared_expert_gate(x))``.

Which layers are sparse (as HF): layer ``i`` unless ``i in mlp_only_layers``, when
``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``; the others have a dense MLP of
``intermediate_size``. Routing: softmax in float32, top ``num_experts_per_tok``, renormalised
when ``norm_topk_prob``, weights rounded to the activations' dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from paged.core.errors import ModelLoadError
from paged.models.layers import GatedMLP
from paged.models.llama import effective_sliding_window
from paged.models.moe import ExpertMLP, FusedMoE, Router, check_moe_config
from paged.models.qwen2 import sliding_layers
from paged.models.sparse_decoder import SparseMoeForCausalLM

__all__ = ["Qwen2MoeForCausalLM", "Qwen2MoeSparseBlock", "is_sparse_layer"]


def is_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """HF's rule (Qwen2-MoE and Qwen3-MoE) for a layer whose MLP is the mixture of experts."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    return (
        layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and int(getattr(hf_config, "num_experts", 0) or 0) > 0
        and (layer_idx + 1) % step == 0
    )


class Qwen2MoeSparseBlock(FusedMoE):
    """``FusedMoE`` + ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``. The shared
    expert is split over ranks like every expert; its gate (one column) is replicated, so the
    gated partial outputs add up to the gated output in the block's one all-reduce."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, device) -> None:
        super().__init__(
            hf_config.hidden_size, int(hf_config.num_experts), int(hf_config.num_experts_per_tok),
            int(hf_config.moe_intermediate_size), norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
            dtype=dtype, device=device,
        )
        self.shared_expert = ExpertMLP(hf_config.hidden_size, int(hf_config.shared_expert_intermediate_size),
                                       dtype=dtype, device=device)
        self.shared_expert_gate = Router(hf_config.hidden_size, 1, dtype=dtype, device=device)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        shared = F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x)
        return self.experts_partial(x) + shared


class Qwen2MoeForCausalLM(SparseMoeForCausalLM):
    architecture = "Qwen2MoeForCausalLM"

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        if any(is_sparse_layer(hf_config, i) for i in range(int(hf_config.num_hidden_layers))):
            check_moe_config(cls.architecture, hf_config, "num_experts")
            shared = getattr(hf_config, "shared_expert_intermediate_size", None)
            if not isinstance(shared, int) or shared < 1:
                raise ModelLoadError(
                    f"{cls.architecture}: shared_expert_intermediate_size must be a positive integer, got {shared!r}"
                )
        if getattr(hf_config, "use_sliding_window", False):
            cls.check_window_value(hf_config)
            layer_types = getattr(hf_config, "layer_types", None)
            if layer_types is not None and (len(layer_types) != int(hf_config.num_hidden_layers) or any(
                    t not in ("full_attention", "sliding_attention") for t in layer_types)):
                raise ModelLoadError(
                    f"{cls.architecture}: layer_types={list(layer_types)!r} must name 'full_attention' or "
                    f"'sliding_attention' for each of the {hf_config.num_hidden_layers} layers"
                )

    @classmethod
    def biases(cls, hf_config: Any) -> tuple[bool, bool, bool]:
        return bool(getattr(hf_config, "qkv_bias", True)), False, False  # qkv_bias: transformers 5; 4.x: always

    @classmethod
    def attention_options(cls, hf_config: Any, layer_idx: int) -> dict[str, Any]:
        if not sliding_layers(hf_config)[layer_idx]:
            return {}
        return cls.window_options(effective_sliding_window(hf_config, hf_config.sliding_window))

    @classmethod
    def build_mlp(cls, hf_config: Any, layer_idx: int, *, dtype, device):
        if is_sparse_layer(hf_config, layer_idx):
            return Qwen2MoeSparseBlock(hf_config, dtype=dtype, device=device)
        return GatedMLP(hf_config.hidden_size, int(hf_config.intermediate_size), dtype=dtype, device=device)
