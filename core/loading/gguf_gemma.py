"""Gemma 2 and Gemma 3 GGUFs (``general.architecture`` "gemma2" / "gemma3"; ``paged.core.loading.gguf``
calls this), as llama.cpp's ``convert_hf_to_gguf.py`` writes them and llama.cpp reads them.

Tensors: Llama's names for the projections and ``attn_norm`` (input_layernorm), plus
``post_attention_norm`` (post_attention_layernorm), ``ffn_norm`` (*pre*_feedforward_layernorm:
Gemma's, not Llama's post-attention norm), ``post_ffw_norm`` (post_feedforward_layernorm) and,
Gemma 3, ``attn_q_norm`` / ``attn_k_norm``. Rows are not permuted. The converter stores every
``*norm.weight`` with the ``+ 1`` of Gemma's ``(1 + w)`` norm already added (llama.cpp then runs a
plain RMSNorm); the HF checkpoint, and so the converted directory, holds ``w``: ``1`` is
subtracted back here. A tied head is left out of the file (``output.weight`` absent).

Config (what llama.cpp derives, which is not all in the metadata):
- softmax scale: ``query_pre_attn_scalar`` = hidden / heads for the 27B sizes (Gemma 2: 46
  layers, Gemma 3: 62), else ``head_dim``, as llama.cpp's ``f_attention_scale``;
- Gemma 2: ``attn_logit_softcapping`` / ``final_logit_softcapping`` (llama.cpp's defaults 50 and
  30 when absent), ``attention.sliding_window`` on every even layer;
- Gemma 3: every sixth layer global, the rest sliding with ``attention.sliding_window`` (none
  when the file has no window), local layers at ``rope.freq_base_swa`` (default 10000) without
  scaling, global ones at ``rope.freq_base`` with the file's rope scaling;
  ``final_logit_softcapping`` when present; no attention soft-cap.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from paged.core.errors import ModelLoadError

ARCHITECTURES = ("gemma2", "gemma3")

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LARGE_LAYER_COUNTS = {"gemma2": 46, "gemma3": 62}  # the 27B sizes: scale by hidden / heads
_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}  # layer i global when (i + 1) % pattern == 0


def is_gemma(arch: str) -> bool:
    return arch in ARCHITECTURES


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.ffn_norm.weight`` -> ``model.layers.3.pre_feedforward_layernorm.weight``."""
    base, dot, kind = gguf_name.rpartition(".")
    if dot and kind in ("weight", "bias"):
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{kind}"
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m and m.group(2) in _LAYER_TENSORS:
            return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{kind}"
    raise ModelLoadError(f"model: Gemma GGUF tensor {gguf_name!r} has no HF counterpart in this converter")


def is_shifted_norm(hf_name: str) -> bool:
    """The tensors llama.cpp's converter stored as ``1 + w``."""
    return hf_name.endswith("norm.weight")


def unshift_norm(hf_name: str, w: np.ndarray, quantized: bool) -> np.ndarray:
    """``w`` from the stored ``1 + w`` (float32)."""
    if quantized:  # the converter keeps 1-D tensors in float; a block-quantized norm is not its output
        raise ModelLoadError(f"model: Gemma GGUF norm {hf_name!r} is block-quantized; expected F32/F16/BF16")
    return (w - np.float32(1.0)).astype(np.float32)


def hf_config(meta: Any, arch: str, kwargs: dict[str, Any], head_dim: int) -> Any:
    """The HF config of a "gemma2" / "gemma3" GGUF from the metadata every architecture shares
    (``kwargs``, as ``gguf._hf_config`` reads them) and Gemma's own (see the module docstring)."""
    layers = int(kwargs["num_hidden_layers"])
    heads = int(kwargs["num_attention_heads"])
    scalar = kwargs["hidden_size"] // heads if layers == _LARGE_LAYER_COUNTS[arch] else head_dim
    window = meta.get(f"{arch}.attention.sliding_window")
    window = int(window) if window else None
    pattern = _WINDOW_PATTERN[arch]
    types = [
        "full_attention" if window is None or (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]
    common = dict(
        kwargs, head_dim=head_dim, query_pre_attn_scalar=scalar, hidden_activation="gelu_pytorch_tanh",
        sliding_window=window, layer_types=types,
    )
    final_cap = meta.get(f"{arch}.final_logit_softcapping")
    if arch == "gemma2":
        from transformers import Gemma2Config

        if window is None:
            raise ModelLoadError(f"model: the Gemma 2 GGUF has no {arch}.attention.sliding_window metadata")
        attn_cap = meta.get(f"{arch}.attn_logit_softcapping")
        return Gemma2Config(
            **common,
            attn_logit_softcapping=_f32(attn_cap if attn_cap is not None else 50.0),
            final_logit_softcapping=_f32(final_cap if final_cap is not None else 30.0),
        )
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **common,
        rope_local_base_freq=_f32(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        final_logit_softcapping=_f32(final_cap) if final_cap else None,
        attn_logit_softcapping=None,
    )


def _f32(value: Any) -> float:
    return float(str(np.float32(value)))
