"""The dense GGUF architectures beyond Llama and Qwen2 (``paged.core.loading.gguf`` calls this):
Qwen3 (``general.architecture`` "qwen3": Llama's tensors plus ``attn_q_norm`` / ``attn_k_norm``,
an explicit ``attention.key_length``, rows not permuted) and Phi-3 ("phi3", Phi-3.5 and Phi-4-mini
too). Mistral needs nothing here: llama.cpp writes its GGUFs as "llama" (q/k rows permuted, the
sliding window not kept).

Phi-3 as llama.cpp's ``convert_hf_to_gguf.py`` writes it: the fused projections as they are in the
HF checkpoint (``attn_qkv`` = q rows, then k, then v; ``ffn_up`` = gate rows, then up:
``gate_up_proj``, read by its SwiGLU as first half gated, second half up), rotary over
``rope.dimension_count`` of each head (``partial_rotary_factor``), ``rope.scaling.
original_context_length`` beside ``context_length``, longrope's factors as the tensors
``rope_factors_long`` / ``rope_factors_short`` (no ``rope.scaling.type``; the attention factor
it stores is the one HF derives from the two lengths) and ``attention.sliding_window`` (0: none).
The converted directory holds the fused tensors as their parts (``q_proj``, ``k_proj``,
``v_proj``; ``gate_proj``, ``up_proj``, their block scales cut by the same rows), so the
quantized GGUF kernels see each part as they see Llama's; ``Phi3ForCausalLM`` loads either form.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from paged.core.errors import ModelLoadError

ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def is_rope_factor_tensor(gguf_name: str) -> bool:
    """Longrope's factors: rope parameters of the config, not weights."""
    return gguf_name in ROPE_FACTOR_TENSORS


def hf_config(meta: Any, arch: str, reader: Any, kwargs: dict[str, Any], head_dim: int, rope_dim: int) -> Any:
    """The HF config of a "qwen3" or "phi3" GGUF from the metadata every architecture shares
    (``kwargs``, as ``gguf._hf_config`` reads them) and the architecture's own."""
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(head_dim=head_dim, **kwargs)
    if arch == "phi3":
        return _phi3_config(meta, reader, kwargs, head_dim, rope_dim)
    raise ModelLoadError(f"model: GGUF architecture {arch!r} is not a dense architecture of this converter")


def _phi3_config(meta: Any, reader: Any, kwargs: dict[str, Any], head_dim: int, rope_dim: int) -> Any:
    from gguf.quants import dequantize
    from transformers import Phi3Config

    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ModelLoadError(f"model: GGUF phi3.rope.dimension_count {rope_dim} is not an even number <= head_dim {head_dim}")
    kwargs = dict(kwargs)
    max_positions = int(kwargs["max_position_embeddings"])
    original = int(meta.get("phi3.rope.scaling.original_context_length", max_positions))
    factors = {
        ROPE_FACTOR_TENSORS[t.name]: [float(x) for x in np.asarray(dequantize(t.data, t.tensor_type)).reshape(-1)]
        for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS
    }
    if factors:
        if set(factors) != set(ROPE_FACTOR_TENSORS.values()):
            raise ModelLoadError(
                f"model: this phi3 GGUF has {sorted(factors)} but longrope needs both rope_factors_long and "
                "rope_factors_short"
            )
        kwargs["rope_scaling"] = {"rope_type": "longrope", **factors, "original_max_position_embeddings": original}
    window = meta.get("phi3.attention.sliding_window")
    extra = {} if head_dim * int(kwargs["num_attention_heads"]) == int(kwargs["hidden_size"]) else {"head_dim": head_dim}
    return Phi3Config(
        **kwargs, **extra,
        original_max_position_embeddings=original,
        partial_rotary_factor=rope_dim / head_dim,
        sliding_window=int(window) if window else None,  # 0: no window (llama.cpp's mark for Phi-4)
    )


def split_fused(arch: str, config: Any, tensors: dict[str, np.ndarray], scales: dict[str, np.ndarray],
                kinds: dict[str, str], fields: tuple[str, ...]) -> None:
    """Phi-3: replace each fused tensor (``self_attn.qkv_proj``; ``mlp.up_proj``, which is
    llama.cpp's ``ffn_up`` = gate then up) by its parts, in ``tensors`` and in ``scales`` (the
    block fields, ``[rows, ...]`` each, cut by the same rows) and ``kinds``. Other
    architectures: nothing."""
    if arch != "phi3":
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv, inter = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, config.intermediate_size
    layouts = {
        "self_attn.qkv_proj": [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
        "mlp.up_proj": [("mlp.gate_proj", inter), ("mlp.up_proj", inter)],
    }
    for name in list(tensors):
        m = re.fullmatch(r"(model\.layers\.\d+)\.(self_attn\.qkv_proj|mlp\.up_proj)\.(weight|bias)", name)
        if m is None:
            continue
        prefix, parts, kind = m.group(1), layouts[m.group(2)], m.group(3)
        whole = tensors.pop(name)
        if whole.shape[0] != sum(n for _, n in parts):
            raise ModelLoadError(
                f"model: phi3 GGUF tensor for {name} has {whole.shape[0]} rows, expected "
                f"{' + '.join(f'{p} {n}' for p, n in parts)}"
            )
        stored = {f: scales.pop(f"{name}.{f}") for f in fields if f"{name}.{f}" in scales}
        kind_of = kinds.pop(name, None)
        start = 0
        for part, n in parts:
            part_name = f"{prefix}.{part}.{kind}"
            tensors[part_name] = np.ascontiguousarray(whole[start:start + n])
            for f, a in stored.items():
                scales[f"{part_name}.{f}"] = np.ascontiguousarray(a[start:start + n])
            if kind_of is not None:
                kinds[part_name] = kind_of
            start += n
