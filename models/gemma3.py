"""Gemma 3 (text) for causal LM: ``Gemma3ForCausalLM`` of HF transformers (``model_type``
``gemma3_text``: the 270M and 1B checkpoints, or the text part saved on its own).

Gemma 2's model (``paged.models.gemma2``) with:

- per-head RMSNorm of q and k (``self_attn.q_norm`` / ``k_norm``, the ``1 + w`` Gemma norm over
  ``head_dim``), after the projections and before the rotary embedding;
- two rotary embeddings: local (sliding-window) layers use ``rope_local_base_freq`` without
  scaling, global layers ``rope_theta`` with the config's ``rope_scaling`` (transformers 5 keeps
  both under ``rope_parameters["sliding_attention" / "full_attention"]``);
- the layer pattern from ``layer_types`` (else ``sliding_window_pattern``, default 6: every sixth
  layer global);
- no attention soft-capping: HF's Gemma 3 attention never applies ``attn_logit_softcapping``
  (every released checkpoint has it null), so a config that sets it is refused rather than run in
  a way HF would not; the final-logit soft-cap is applied when set, as HF does.

The multimodal ``Gemma3ForConditionalGeneration`` (4B and larger) is refused with a clear error
(``Gemma3ForConditionalGeneration`` below): its config nests the text model under
``text_config`` and its checkpoint holds a vision tower, so it is not this model's checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paged.core.errors import ModelLoadError
from paged.core.model import AttentionShape
from paged.models.gemma2 import Gemma2ForCausalLM, GemmaRMSNorm, attention_scale, attention_shape, layer_window
from paged.models.layers import RotaryEmbedding, rope_settings
from paged.models.qwen3 import QKNormAttention

__all__ = ["Gemma3Attention", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "gemma3_rope_settings"]


def gemma3_rope_settings(hf_config: Any) -> dict[str, tuple[float, dict | None]]:
    """``{"sliding_attention": (theta, scaling), "full_attention": (theta, scaling)}``.

    transformers 5: ``rope_parameters`` keyed by layer type. transformers 4: ``rope_theta`` and
    ``rope_scaling`` for global layers, ``rope_local_base_freq`` (default 10000) for local ones."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        out = {}
        for kind, default_theta in (("sliding_attention", 10000.0), ("full_attention", 1000000.0)):
            p = dict(params.get(kind) or {})
            out[kind] = (float(p.get("rope_theta", default_theta)), p)
        return out
    theta, scaling = rope_settings(hf_config)
    local = float(getattr(hf_config, "rope_local_base_freq", None) or 10000.0)
    return {"sliding_attention": (local, None), "full_attention": (theta, scaling)}


class Gemma3Attention(QKNormAttention):
    """``Attention`` with Gemma's RMSNorm over each head of q and of k before the rotary
    (Qwen3's layer with the (1 + w) norm)."""

    norm_class = GemmaRMSNorm


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    architecture = "Gemma3ForCausalLM"
    window_pattern = 6

    @classmethod
    def build_rotaries(cls, hf_config: Any, types: list[str], device: torch.device) -> dict[str, RotaryEmbedding]:
        head_dim = attention_shape(hf_config).head_dim
        max_positions = int(hf_config.max_position_embeddings)
        settings = gemma3_rope_settings(hf_config)
        return {
            kind: RotaryEmbedding(head_dim, max_positions, *settings[kind], device=device) for kind in sorted(set(types))
        }

    @classmethod
    def build_attention(
        cls, hf_config: Any, layer_type: str, rotary: RotaryEmbedding, backend: Any, dtype: torch.dtype, device
    ) -> nn.Module:
        _, num_heads, num_kv_heads, head_dim = attention_shape(hf_config)
        bias = bool(getattr(hf_config, "attention_bias", False))
        return Gemma3Attention(
            hf_config.hidden_size, num_heads, num_kv_heads, head_dim, rotary, backend,
            qkv_bias=bias, o_bias=bias,
            sliding_window=layer_window(hf_config, layer_type),
            scale=attention_scale(hf_config),
            eps=float(hf_config.rms_norm_eps), dtype=dtype, device=device,
        )

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        cap = getattr(hf_config, "attn_logit_softcapping", None)
        if cap is not None:
            raise ModelLoadError(
                f"{cls.architecture}: attn_logit_softcapping {cap!r} is not supported: HF transformers' Gemma 3 "
                "never applies it (every released Gemma 3 has null), so running it either way could disagree "
                "with the reference; set it to null"
            )
        super().check_config(hf_config)
        gemma3_rope_settings(hf_config)


class Gemma3ForConditionalGeneration:
    """Registered only to refuse clearly: the multimodal Gemma 3 (vision tower + text model).

    Not loaded as text-only: its config is a ``Gemma3Config`` with the text model's settings in
    ``text_config`` (the engine reads layers, heads, vocabulary and length off the top level) and
    its tensors live under ``language_model.`` / ``model.language_model.`` beside the vision
    tower's. Running its text part needs that config and those names remapped first."""

    architecture = "Gemma3ForConditionalGeneration"

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        raise ModelLoadError(
            "Gemma3ForConditionalGeneration (multimodal Gemma 3: vision tower + text model) is not supported; "
            "text-only Gemma 3 checkpoints (architectures ['Gemma3ForCausalLM'], model_type 'gemma3_text', "
            "e.g. gemma-3-270m / gemma-3-1b) are, and so are their GGUF files (general.architecture 'gemma3')"
        )

    @classmethod
    def attention_shape(cls, hf_config: Any) -> AttentionShape:
        cls.check_config(hf_config)
        raise AssertionError("unreachable")

    def __init__(self, hf_config: Any, *args: Any) -> None:
        self.check_config(hf_config)
