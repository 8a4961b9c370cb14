"""Llama's decoder layers as direct calls: on a CPU, in eager mode, a step runs each layer as
nine calls (two norms, four projections, rotary, attention, SiLU-and-mul) with no ``nn.Module``
dispatch in between.

Why: at batch 1 the kernels of a decode step take ~3.4 ms on the default model (2-core EPYC);
the module tree around them (``__call__`` and its hook checks, ~300 submodule calls, each
layer's own checks of dtype and strides) took another ~1.4 ms, a quarter of the step. The direct
path does the same arithmetic, call for call, in the same order: its hidden states are bitwise
equal to the modules' (``tests/models/test_direct_decoder.py``).

It is used only where it is that same arithmetic (checked once, when ``DirectDecoder.of`` builds
it, and per forward where it can change):

- every layer is exactly paged's ``LlamaDecoderLayer`` with ``Attention``, ``RMSNorm``,
  ``GatedMLP`` (SiLU) and the fused linears, none of their ``forward`` methods replaced, and
  full-width rotary (Llama, Qwen2, Mistral and the plugins that subclass ``LlamaForCausalLM``
  without their own attention; an architecture with its own attention or layer keeps its
  modules);
- one tensor-parallel rank (the row-parallel layers' all-reduce stays in their ``forward``);
- per forward: a CPU tensor in the fused kernels' dtypes, not under ``torch.compile``, the
  layer kernels built (``paged.models.cpu_layer_ops``), and no forward hook on any module it
  skips (nor a global one). A projection with a LoRA adapter goes through the layer's own
  ``_linear``.

``PAGED_DIRECT_LAYERS=0`` keeps the modules (A/B measurements, debugging).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from paged.models import cpu_layer_ops
from paged.models.layers import (
    Attention,
    GatedMLP,
    Linear,
    MergedColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
)

# The methods the direct path stands in for, as this module found them: a class patched after
# import (a researcher's experiment) keeps its modules.
_STOCK = {(cls, name): getattr(cls, name) for cls, name in [
    (Attention, "forward"), (RMSNorm, "forward"), (GatedMLP, "forward"), (RotaryEmbedding, "forward"),
    (RotaryEmbedding, "_rotate_both"), (MergedColumnParallelLinear, "forward"),
    (MergedColumnParallelLinear, "_linear"), (RowParallelLinear, "forward"), (RowParallelLinear, "_linear"),
]}


class _Layer:
    """One decoder layer's modules and constants, read once."""

    __slots__ = ("input_norm", "input_eps", "post_norm", "post_eps", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
                 "gate_up_bias", "down", "down_bias", "qkv_sizes", "num_heads", "num_kv_heads", "head_dim", "q_size",
                 "attention", "settings_kwargs", "rotary")

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.input_eps = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.post_norm, self.post_eps = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self.qkv, self.qkv_bias = attn.qkv_proj, attn.qkv_proj.bias
        self.o, self.o_bias = attn.o_proj, attn.o_proj.bias
        self.gate_up, self.gate_up_bias = mlp.gate_up_proj, mlp.gate_up_proj.bias
        self.down, self.down_bias = mlp.down_proj, mlp.down_proj.bias
        self.qkv_sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        self.num_heads, self.num_kv_heads, self.head_dim, self.q_size = (
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.q_size)
        self.attention = attn.backend.forward
        self.settings_kwargs = attn._settings_kwargs
        self.rotary = attn.rotary


def _project(proj: Linear, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``proj(x)`` without the module call: the quantized product, or the layer's own
    ``_linear`` (dense or packed weights, LoRA adapters)."""
    qweight = proj.qweight
    if qweight is not None and proj.lora is None:
        return qweight.linear(x, bias)
    return proj._linear(x, bias)


class DirectDecoder:
    """``LlamaModel``'s layers and final norm as direct calls (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [_Layer(layer) for layer in model.layers]
        self.norm, self.norm_eps = model.norm.weight, model.norm.eps
        self.dtype = self.norm.dtype
        # the hooks of every module the direct path skips, checked per forward (a dict per module,
        # filled in place by register_forward_hook)
        skipped = [m for layer in model.layers for m in layer.modules()] + [model.norm]
        self.hook_dicts = [d for m in skipped for d in (m._forward_hooks, m._forward_pre_hooks)]

    @classmethod
    def of(cls, model: nn.Module, layer_type: type) -> "DirectDecoder | None":
        """The direct path for a ``LlamaModel`` whose layers should be exactly ``layer_type``
        (``LlamaDecoderLayer``, its forward unpatched: the caller checks), or None where its
        modules must run (module docstring)."""
        if os.environ.get("PAGED_DIRECT_LAYERS", "1") == "0" or not len(model.layers) or type(model.norm) is not RMSNorm:
            return None
        if any(getattr(c, name) is not f for (c, name), f in _STOCK.items()):
            return None
        dtype = model.norm.weight.dtype
        for layer in model.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if (type(layer) is not layer_type or type(attn) is not Attention or type(mlp) is not GatedMLP
                    or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm
                    or type(attn.qkv_proj) is not MergedColumnParallelLinear
                    or type(attn.o_proj) is not RowParallelLinear
                    or type(mlp.gate_up_proj) is not MergedColumnParallelLinear
                    or type(mlp.down_proj) is not RowParallelLinear
                    or type(attn.rotary) is not RotaryEmbedding or attn.rotary.rotary_dim != attn.head_dim
                    or mlp.activation != "silu" or attn.o_proj.tp.size != 1 or mlp.down_proj.tp.size != 1
                    or layer.input_layernorm.weight.dtype != dtype or layer.post_attention_layernorm.weight.dtype != dtype):
                return None
        return cls(model)

    def usable(self, hidden_states: torch.Tensor) -> Any | None:
        """The layer kernels when this forward can run direct, else None."""
        ops = cpu_layer_ops.enabled(hidden_states)
        if (ops is None or hidden_states.dtype != self.dtype or nn_module._global_forward_hooks
                or nn_module._global_forward_pre_hooks or any(self.hook_dicts)):
            return None
        return ops

    def forward(self, ops: Any, positions: torch.Tensor, hidden_states: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor], kv_caches: list[Any], attn_metadata: Any) -> torch.Tensor:
        """What ``LlamaModel.forward`` computes after the embedding, call for call."""
        rms_norm, add_rms_norm, rotary, silu_and_mul = ops.rms_norm, ops.add_rms_norm, ops.rotary, ops.silu_and_mul
        cos, sin = cos_sin
        num_tokens = hidden_states.shape[0]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            if residual is None:
                residual, x = hidden_states, rms_norm(hidden_states, layer.input_norm, layer.input_eps)
            else:
                x, residual = add_rms_norm(hidden_states, residual, layer.input_norm, layer.input_eps)
            q, k, v = _project(layer.qkv, layer.qkv_bias, x).split(layer.qkv_sizes, dim=-1)
            q = q.view(num_tokens, layer.num_heads, layer.head_dim)
            k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
            v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
            if q.dtype == cos.dtype == k.dtype:
                q, k = rotary(q, k, cos, sin)
            else:  # a quantization plugin's product in another dtype: the module's torch ops
                q, k = layer.rotary(positions, q, k, cos_sin)
            out = layer.attention(q, k, v, kv_cache, attn_metadata, **layer.settings_kwargs)
            del q, k, v
            x, residual = add_rms_norm(_project(layer.o, layer.o_bias, out.reshape(num_tokens, layer.q_size)),
                                       residual, layer.post_norm, layer.post_eps)
            del out
            hidden_states = _project(layer.down, layer.down_bias,
                                     silu_and_mul(_project(layer.gate_up, layer.gate_up_bias, x)))
            del x
        return add_rms_norm(hidden_states, residual, self.norm, self.norm_eps)[0]

