"""Mistral for causal LM: the Llama model (the same checkpoint names; ``head_dim`` may be given
explicitly) with a sliding window of ``sliding_window`` tokens on every layer, where that is
shorter than ``max_position_embeddings`` (else no sequence the engine runs can tell)."""

from __future__ import annotations

from typing import Any

from paged.models.llama import LlamaForCausalLM, attention_shape, effective_sliding_window

__all__ = ["MistralForCausalLM", "attention_shape"]


class MistralForCausalLM(LlamaForCausalLM):
    architecture = "MistralForCausalLM"

    @classmethod
    def attention_options(cls, hf_config: Any, layer_idx: int) -> dict[str, Any]:
        window = effective_sliding_window(hf_config, getattr(hf_config, "sliding_window", None))
        return {} if window is None else {"sliding_window": window}
