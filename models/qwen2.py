"""Qwen2 for causal LM: the Llama model with biases on the q, k and v projections (none on
o_proj or the MLP). The config names it reads are the same as Llama's.

Sliding window (``use_sliding_window``): HF's rule, per layer. The config's ``layer_types`` says
which layers are ``"sliding_attention"`` (transformers >= 4.53 writes it, and derives it when
absent as: layer ``i`` slides iff ``use_sliding_window`` and ``i >= max_window_layers``); a
sliding layer attends over the last ``sliding_window`` positions, the others over everything.
Without ``use_sliding_window`` HF ignores ``sliding_window`` and ``layer_types`` alike."""

from __future__ import annotations

from typing import Any

from paged.core.errors import ModelLoadError
from paged.models.llama import LlamaForCausalLM, attention_shape, effective_sliding_window

__all__ = ["Qwen2ForCausalLM", "attention_shape", "sliding_layers"]

_LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_layers(hf_config: Any) -> list[bool]:
    """Which layers attend over a sliding window, by HF's rule (see the module docstring)."""
    num_layers = int(hf_config.num_hidden_layers)
    if not getattr(hf_config, "use_sliding_window", False) or getattr(hf_config, "sliding_window", None) is None:
        return [False] * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        first = int(getattr(hf_config, "max_window_layers", num_layers))
        return [i >= first for i in range(num_layers)]
    return [t == "sliding_attention" for t in layer_types]


class Qwen2ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen2ForCausalLM"

    @classmethod
    def biases(cls, hf_config: Any) -> tuple[bool, bool, bool]:
        return True, False, False

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        if not getattr(hf_config, "use_sliding_window", False):
            return
        window = getattr(hf_config, "sliding_window", None)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ModelLoadError(
                f"{cls.architecture}: sliding_window={window!r} is not usable with use_sliding_window=true "
                "(a positive integer is: the number of positions a sliding layer attends to)"
            )
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types is not None:
            bad = [t for t in layer_types if t not in _LAYER_TYPES]
            if len(layer_types) != int(hf_config.num_hidden_layers) or bad:
                raise ModelLoadError(
                    f"{cls.architecture}: layer_types={list(layer_types)!r} must name one of {list(_LAYER_TYPES)} "
                    f"for each of the {hf_config.num_hidden_layers} layers"
                )

    @classmethod
    def attention_options(cls, hf_config: Any, layer_idx: int) -> dict[str, Any]:
        if not sliding_layers(hf_config)[layer_idx]:
            return {}
        return {"sliding_window": effective_sliding_window(hf_config, hf_config.sliding_window)}
