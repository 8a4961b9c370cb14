"""Qwen2 for causal LM: the Llama model with biases on the q, k and v projections (none on
o_proj or the MLP). The config names it reads are the same as Llama's."""

from __future__ import annotations

from typing import Any

from paged.core.errors import ModelLoadError
from paged.models.llama import LlamaForCausalLM, attention_shape

__all__ = ["Qwen2ForCausalLM", "attention_shape"]


class Qwen2ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen2ForCausalLM"

    @classmethod
    def biases(cls, hf_config: Any) -> tuple[bool, bool, bool]:
        return True, False, False

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        if getattr(hf_config, "use_sliding_window", False):
            raise ModelLoadError(
                f"{cls.architecture}: use_sliding_window=true is not supported (sliding_window="
                f"{getattr(hf_config, 'sliding_window', None)}); every layer would need full attention"
            )
