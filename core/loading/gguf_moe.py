"""The mixture-of-experts part of the GGUF conversion (``paged.core.loading.gguf``): the HF
config of a sparse model, and its expert tensors under HF's per-expert names.

llama.cpp stores a layer's experts stacked, one 3-D tensor per projection (``blk.N.ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps``: ``[n_expert, rows, cols]`` in PyTorch order), the router as
``ffn_gate_inp`` and Qwen2-MoE's shared expert as ``ffn_{gate,up,down}_shexp`` with its one-column
gate ``ffn_gate_inp_shexp`` (``[hidden]`` or ``[1, hidden]``). Metadata: ``{arch}.expert_count``,
``expert_used_count``, ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``
(``expert_weights_norm`` where the converter wrote it). Mixtral is ``general.architecture
"llama"`` with ``expert_count`` set (and Llama's permuted q/k rows, undone by the caller).

Each expert is written as its own HF tensor (``model.layers.N.mlp.experts.E.gate_proj.weight``;
Mixtral ``block_sparse_moe.experts.E.w1``): quantized experts keep their blocks, since the
blocks of a stacked tensor run along its last dimension and each expert's rows are whole
blocks, so every expert gets its own entry in the block-scales file and the quantization
methods keep its codes as for any linear weight.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from paged.core.errors import ModelLoadError
from paged.core.loading import gguf_blocks

# general.architecture -> (HF architecture, HF config class name, renormalise top-k by default);
# llama.cpp renormalises for Qwen3-MoE and Mixtral, not for Qwen2-MoE
_MOE = {
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", True),
    "llama": ("MixtralForCausalLM", "MixtralConfig", True),
}

_TENSOR = re.compile(r"blk\.(\d+)\.(ffn_gate_inp|ffn_(?:gate|up|down)_exps|ffn_(?:gate|up|down)_shexp|ffn_gate_inp_shexp)\.weight")
_PROJECTION = {"gate": 0, "up": 1, "down": 2}
_EXPERT_NAMES = {"MixtralForCausalLM": ("w1", "w3", "w2")}  # others: gate_proj, up_proj, down_proj
_MLP_NAME = {"MixtralForCausalLM": "block_sparse_moe"}  # others: mlp


def is_moe(meta: Any, arch: str) -> bool:
    """The GGUF is a sparse model this converter writes as one of the MoE families."""
    if arch == "llama":  # Mixtral; a dense Llama has no expert_count
        return int(meta.get(f"{arch}.expert_count", 0) or 0) > 0
    return arch in _MOE  # qwen2moe, qwen3moe: expert_count is required (hf_config says so)


def is_moe_tensor(gguf_name: str) -> bool:
    return _TENSOR.fullmatch(gguf_name) is not None


def hf_config(meta: Any, arch: str, head_dim: int, kwargs: dict[str, Any], tensor_names: set[str]) -> Any:
    """The HF config of a sparse GGUF, from the dense fields already read (``kwargs``)."""
    import transformers

    hf_arch, config_class, default_norm = _MOE[arch]
    num_experts = int(meta.need(f"{arch}.expert_count"))
    top_k = int(meta.need(f"{arch}.expert_used_count"))
    expert_width = int(meta.get(f"{arch}.expert_feed_forward_length", kwargs["intermediate_size"]))
    norm_topk_prob = bool(meta.get(f"{arch}.expert_weights_norm", default_norm))
    kwargs = {**kwargs, "architectures": [hf_arch], "num_experts_per_tok": top_k}
    if hf_arch == "MixtralForCausalLM":
        if not norm_topk_prob:
            raise ModelLoadError(f"model: GGUF {arch}.expert_weights_norm=false: Mixtral always renormalises its top-k")
        return transformers.MixtralConfig(
            **{**kwargs, "intermediate_size": expert_width}, num_local_experts=num_experts, head_dim=head_dim,
            sliding_window=None,
        )
    kwargs.update(num_experts=num_experts, moe_intermediate_size=expert_width, norm_topk_prob=norm_topk_prob,
                  decoder_sparse_step=1, mlp_only_layers=[])
    if hf_arch == "Qwen2MoeForCausalLM":
        shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
        if shared is None:
            raise ModelLoadError(f"model: the GGUF file has no {arch}.expert_shared_feed_forward_length metadata")
        return transformers.Qwen2MoeConfig(
            **kwargs, shared_expert_intermediate_size=int(shared), qkv_bias="blk.0.attn_q.bias" in tensor_names,
            use_sliding_window=False,
        )
    return transformers.Qwen3MoeConfig(**kwargs, head_dim=head_dim, attention_bias="blk.0.attn_q.bias" in tensor_names,
                                       use_sliding_window=False)


def _hf_names(gguf_name: str, config: Any) -> tuple[str, list[str] | str]:
    """``(kind, names)``: ``"experts"`` and the per-expert HF names in order, or ``"one"`` and
    the one HF name."""
    m = _TENSOR.fullmatch(gguf_name)
    assert m is not None
    layer, kind = m.groups()
    hf_arch = config.architectures[0]
    prefix = f"model.layers.{layer}.{_MLP_NAME.get(hf_arch, 'mlp')}"
    if kind == "ffn_gate_inp":
        return "one", f"{prefix}.gate.weight"
    if kind == "ffn_gate_inp_shexp":
        return "one", f"{prefix}.shared_expert_gate.weight"
    projection = kind.split("_")[1]
    if kind.endswith("_shexp"):
        return "one", f"{prefix}.shared_expert.{projection}_proj.weight"
    name = _EXPERT_NAMES.get(hf_arch, ("gate_proj", "up_proj", "down_proj"))[_PROJECTION[projection]]
    count = int(getattr(config, "num_local_experts", None) or config.num_experts)
    return "experts", [f"{prefix}.experts.{e}.{name}.weight" for e in range(count)]


def write_tensor(t: Any, config: Any, tensors: dict[str, np.ndarray], scales: dict[str, np.ndarray],
                 kinds: dict[str, str], block_fields: tuple[str, ...]) -> None:
    """Add the HF tensor(s) of GGUF tensor ``t`` to ``tensors`` (float32) and, for block types,
    their codes and scales to ``scales`` / ``kinds`` (the caller's formats)."""
    from gguf.quants import dequantize

    kind, names = _hf_names(t.name, config)
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
    raw = t.data.view(np.ndarray)
    try:
        w = np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32)
    except NotImplementedError as e:
        raise ModelLoadError(f"model: GGUF tensor {t.name!r}: {e}") from e
    if w.size != int(np.prod(shape)):
        raise ModelLoadError(f"model: GGUF tensor {t.name!r} dequantized to {w.shape}, expected {shape}")
    if kind == "one":
        if names.endswith("shared_expert_gate.weight"):
            shape = (1, w.size)  # HF: Linear(hidden, 1); llama.cpp may drop the unit dimension
        if len(shape) != 2:
            raise ModelLoadError(f"model: GGUF tensor {t.name!r} has shape {shape}, expected 2 dimensions")
        pieces = [(names, 0, shape[0])]
        rows, cols = shape
    else:
        if len(shape) != 3 or shape[0] != len(names):
            raise ModelLoadError(
                f"model: GGUF tensor {t.name!r} has shape {shape}, expected [{len(names)} experts, rows, cols]"
            )
        _, rows, cols = shape
        pieces = [(name, e * rows, rows) for e, name in enumerate(names)]
        rows = shape[0] * rows
    w = w.reshape(rows, cols)
    decoded = gguf_blocks.decode_blocks(raw, t.tensor_type.name, (rows, cols))  # blocks run along cols
    for name, start, length in pieces:
        tensors[name] = np.ascontiguousarray(w[start : start + length])
        if decoded is not None:
            for field in block_fields:
                a = getattr(decoded, "codes" if field == "stored_codes" else field)
                scales[f"{name}.{field}"] = np.ascontiguousarray(a[start : start + length])
            kinds[name] = decoded.kind
