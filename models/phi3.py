"""Phi-3 (and Phi-3.5 / Phi-4-mini, which share its architecture) for causal LM: the Llama model
with the checkpoint's q/k/v projections fused into ``qkv_proj`` and gate/up into ``gate_up_proj``,
rotary over ``partial_rotary_factor`` of each head, ``longrope`` (or ``su``) rope scaling with
its short and long factors and attention factor (``paged.models.rotary``), and a sliding window
of ``sliding_window`` tokens on every layer where that is shorter than
``max_position_embeddings``.

The fused checkpoint tensors are loaded as their parts (``split_fused_rows``), so the layers are
Llama's: each tensor-parallel rank reads its q, k and v rows and its gate and up rows out of the
fused tensors, and quantization and the fused CPU kernels apply as they do to Llama.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from paged.core.errors import ModelLoadError
from paged.core.loading.weights import split_fused_rows
from paged.models.llama import LlamaForCausalLM, attention_shape, effective_sliding_window

__all__ = ["Phi3ForCausalLM", "attention_shape"]


class Phi3ForCausalLM(LlamaForCausalLM):
    architecture = "Phi3ForCausalLM"

    @classmethod
    def biases(cls, hf_config: Any) -> tuple[bool, bool, bool]:
        return False, False, False  # HF's Phi3 has no bias anywhere

    @classmethod
    def attention_options(cls, hf_config: Any, layer_idx: int) -> dict[str, Any]:
        window = effective_sliding_window(hf_config, getattr(hf_config, "sliding_window", None))
        return {} if window is None else {"sliding_window": window}

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        for name in ("attention_bias", "mlp_bias"):
            if getattr(hf_config, name, False):
                raise ModelLoadError(f"{cls.architecture}: {name}=true is not supported (Phi-3 has no biases)")

    def fused_parts(self) -> dict[str, list[tuple[str, int]]]:
        """The checkpoint's fused modules and their parts in row order (``split_fused_rows``)."""
        _, num_heads, num_kv_heads, head_dim = attention_shape(self.config)
        q, kv, inter = num_heads * head_dim, num_kv_heads * head_dim, int(self.config.intermediate_size)
        return {
            "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
            "gate_up_proj": [("gate_proj", inter), ("up_proj", inter)],
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Llama's ``load_weights`` after splitting ``qkv_proj`` and ``gate_up_proj`` into their
        parts (a checkpoint that stores the parts, as a converted GGUF does, loads as it is);
        errors name the parts (``...self_attn.q_proj.weight``)."""
        super().load_weights(split_fused_rows(weights, self.fused_parts()))
