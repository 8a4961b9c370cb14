"""Llama's decoder layers as direct calls: on a CPU, in eager mode, a step runs each layer as
nine calls (two norms, four projections, rotary, attention, SiLU-and-mul; Qwen3 two more for its
q/k norms) with no ``nn.Module`` dispatch in between.

Why: at batch 1 the kernels of a decode step take ~3.4 ms on the default model (2-core EPYC);
the module tree around them (``__call__`` and its hook checks, ~300 submodule calls, each
layer's own checks of dtype and strides) took another ~1 ms. The direct path does the same
arithmetic, call for call, in the same order: its hidden states and KV writes are bitwise the
modules' (``tests/models/test_direct_decoder.py``).

It is used only where it is that same arithmetic. Checked when ``DirectDecoder.of`` reads the
layers (at the model's first eager forward, after loading, quantization and LoRA set-up):

- every layer is exactly paged's ``LlamaDecoderLayer`` with ``Attention`` (or a registered
  q/k-norm attention: Qwen3's ``QKNormAttention``), ``RMSNorm``, ``GatedMLP`` (SiLU) and the
  fused linears, no module with a ``forward`` of its own or compiled by ``Module.compile``
  (Llama, Qwen2, Qwen3, Mistral, Phi-3, whose partial rotary runs as its module, and the plugins
  that subclass ``LlamaForCausalLM`` without their own attention; an architecture with its own
  attention or layer keeps its modules);
- one tensor-parallel rank (the row-parallel layers' all-reduce stays in their ``forward``).

Checked per forward (``usable``; ``LlamaModel.forward`` checks its own methods): a CPU tensor in
the fused kernels' dtypes, not under ``torch.compile``, the layer kernels built
(``paged.models.cpu_layer_ops``), the layer classes' methods still those they were defined with
(``paged.models.layers.STOCK_METHODS``), and no forward hook on any module it skips (nor a global
one). Per projection: a LoRA adapter goes through the layer's own ``_linear``; a product in
another dtype than the model's or with a strided last dimension (a quantization plugin outside
``QuantizedWeight``'s contract) ends the direct path for good, with one log line, and that
forward is run again through the modules (the KV written until then is the same values).

A step of decodes only (the attention backend's ``fused_decode_only``: plain decodes, or the
grouped rows of speculative verifications) runs the same loop as one C++ call where every call
in it has a C++ function: ``cpu_layer_ops.DecoderPlan``, built at the first such step from the
GGUF weights' kernel (``native_gemm``: each projection a ``GGUFWeight`` or row blocks of them)
and the torch backend's fused KV write and decode (``native_decode``), bfloat16, without q/k
norms, partial rotary or LoRA; elsewhere (dense or other quantized weights, prefill steps, other
backends) the Python loop runs. The same calls in the same order: bitwise the same hidden
states (``tests/models/test_direct_decoder.py``). Why: the loop's ~270 calls a step cost ~1 ms
of interpreter and argument conversion at batch 1 (the default model on the 2-core EPYC, a
step 7.06 -> 6.59 ms; decode 1.1-1.2x faster end to end, README Performance).
``PAGED_DIRECT_PLAN=0`` keeps the Python loop (A/B measurements).

The modules are read once: a model whose layers are replaced after its first forward must set
``LlamaModel._direct = False`` to have them read again. An attention backend set on the
``Attention`` modules after that (``attn.backend = ...``, as ``benchmarks/gpu_check_throughput.py``
does) is followed: ``usable`` sees it, the layers call the new backends, and the plan is built
again where they allow one. ``PAGED_DIRECT_LAYERS=0`` keeps the modules (A/B measurements,
debugging).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from paged.models import cpu_layer_ops
from paged.models.layers import (
    STOCK_METHODS,
    Attention,
    GatedMLP,
    Linear,
    MergedColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
)

logger = logging.getLogger(__name__)


# Attention classes that add an RMSNorm over each head of q and of k before rotary (Qwen3's
# ``QKNormAttention``, which registers itself with its forward as defined), else ``Attention``.
QK_NORM_ATTENTIONS: dict[type, Any] = {}


def register_qk_norm_attention(cls: type) -> None:
    """Let layers whose attention is exactly ``cls`` (``q_norm``/``k_norm`` RMSNorms, then
    ``Attention``'s rotary, backend and ``o_proj``) run direct while ``cls.forward`` is the one
    it has now."""
    QK_NORM_ATTENTIONS[cls] = cls.forward


class _NotDirect(Exception):
    """A product the fused kernels cannot take as the modules would (``_project``)."""


class _Layer:
    """One decoder layer's modules and constants, read once."""

    __slots__ = ("input_norm", "input_eps", "post_norm", "post_eps", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
                 "gate_up_bias", "down", "down_bias", "qkv_sizes", "num_heads", "num_kv_heads", "head_dim", "q_size",
                 "attention", "settings_kwargs", "q_norm", "q_norm_eps", "k_norm", "k_norm_eps", "rotary",
                 "backend", "settings")

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
        self.backend, self.settings = attn.backend, attn.attn_settings
        self.settings_kwargs = attn._settings_kwargs
        qk_norm = type(attn) in QK_NORM_ATTENTIONS
        self.q_norm, self.q_norm_eps = (attn.q_norm.weight, attn.q_norm.eps) if qk_norm else (None, 0.0)
        self.k_norm, self.k_norm_eps = (attn.k_norm.weight, attn.k_norm.eps) if qk_norm else (None, 0.0)
        # None: full-width rotary, the fused op; else the module (Phi-3's partial rotary)
        self.rotary = None if attn.rotary.rotary_dim == attn.head_dim else attn.rotary


def _project(proj: Linear, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``proj(x)`` without the module call: the quantized product, or the layer's own
    ``_linear`` (dense or packed weights, LoRA adapters)."""
    qweight = proj.qweight
    y = qweight.linear(x, bias) if qweight is not None and proj.lora is None else proj._linear(x, bias)
    if y.dtype != x.dtype or y.stride(-1) != 1:
        raise _NotDirect(f"{type(qweight or proj).__name__}.linear returned {y.dtype} with strides {y.stride()} for {x.dtype}")
    return y


def _stock_attention(attn: nn.Module, dtype: torch.dtype) -> bool:
    """``Attention``, or a registered q/k-norm attention with its forward as registered and
    RMSNorms of the model's dtype."""
    if type(attn) is Attention:
        return True
    forward = QK_NORM_ATTENTIONS.get(type(attn))
    return (forward is not None and type(attn).forward is forward and type(attn.q_norm) is RMSNorm
            and type(attn.k_norm) is RMSNorm and attn.q_norm.weight.dtype == dtype and attn.k_norm.weight.dtype == dtype)


def _own_call(module: nn.Module) -> bool:
    """A module whose call does not end in its class's ``forward``: an instance ``forward`` (a
    wrapper set on the object) or ``Module.compile``."""
    return "forward" in module.__dict__ or getattr(module, "_compiled_call_impl", None) is not None


class DirectDecoder:
    """``LlamaModel``'s layers and final norm as direct calls (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [_Layer(layer) for layer in model.layers]
        self.attentions = [layer.self_attn for layer in model.layers]  # their backends, checked per forward
        self.norm, self.norm_eps = model.norm.weight, model.norm.eps
        self.dtype = self.norm.dtype
        self.failed = False
        # the C++ plan of a decode step (cpu_layer_ops.DecoderPlan): None until a step of decodes
        # only builds it, False where it cannot run (_build_plan); for the KV caches it was built with
        self.use_plan = os.environ.get("PAGED_DIRECT_PLAN", "1") != "0"
        self.plan: Any = None if self.use_plan else False
        self.plan_kv_caches: Any = None
        self.plan_steps = 0  # steps run by the plan (tests, benchmarks)
        # the hooks of every module the direct path skips, checked per forward (a dict per module,
        # filled in place by register_forward_hook)
        skipped = [m for layer in model.layers for m in layer.modules()] + [model.norm]
        self.hook_dicts = [d for m in skipped for d in (m._forward_hooks, m._forward_pre_hooks)]

    @classmethod
    def of(cls, model: nn.Module, layer_type: type) -> "DirectDecoder | None":
        """The direct path for a ``LlamaModel`` whose layers should be exactly ``layer_type``
        (``LlamaDecoderLayer``, its methods unpatched: the caller checks), or None where its
        modules must run (module docstring)."""
        if os.environ.get("PAGED_DIRECT_LAYERS", "1") == "0" or not len(model.layers) or type(model.norm) is not RMSNorm:
            return None
        dtype = model.norm.weight.dtype
        for layer in model.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if (type(layer) is not layer_type or not _stock_attention(attn, dtype) or type(mlp) is not GatedMLP
                    or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm
                    or type(attn.qkv_proj) is not MergedColumnParallelLinear
                    or type(attn.o_proj) is not RowParallelLinear
                    or type(mlp.gate_up_proj) is not MergedColumnParallelLinear
                    or type(mlp.down_proj) is not RowParallelLinear
                    or type(attn.rotary) is not RotaryEmbedding
                    or mlp.activation != "silu" or attn.o_proj.tp.size != 1 or mlp.down_proj.tp.size != 1
                    or layer.input_layernorm.weight.dtype != dtype or layer.post_attention_layernorm.weight.dtype != dtype
                    or any(_own_call(m) for m in layer.modules())):
                return None
        return None if _own_call(model.norm) else cls(model)

    def usable(self, hidden_states: torch.Tensor) -> Any | None:
        """The layer kernels when this forward can run direct, else None."""
        ops = cpu_layer_ops.enabled(hidden_states)
        if (ops is None or self.failed or hidden_states.dtype != self.dtype or nn_module._global_forward_hooks
                or nn_module._global_forward_pre_hooks or any(self.hook_dicts)
                or any(getattr(c, name) is not f for (c, name), f in STOCK_METHODS.items())
                or any(c.forward is not f for c, f in QK_NORM_ATTENTIONS.items())):
            return None
        if any(attn.backend is not layer.backend for attn, layer in zip(self.attentions, self.layers)):
            self._follow_backends()
        return ops

    def _follow_backends(self) -> None:
        """An attention backend swapped on the modules since they were read: call the new ones,
        and build the plan again (it holds the old backends' C++ decode)."""
        for attn, layer in zip(self.attentions, self.layers):
            layer.backend, layer.attention = attn.backend, attn.backend.forward
        self.plan, self.plan_kv_caches = (None if self.use_plan else False), None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_caches: list[Any], attn_metadata: Any) -> torch.Tensor | None:
        """What ``LlamaModel.forward`` computes after the embedding, call for call; None where
        this forward must run through the modules."""
        ops = self.usable(hidden_states)
        if ops is None:
            return None
        try:
            return self._layers(ops, positions, hidden_states, cos_sin, kv_caches, attn_metadata)
        except _NotDirect as e:
            self.failed = True
            logger.warning("direct decoder layers off, the modules run instead: %s", e)
            return None

    def _layers(self, ops: Any, positions: torch.Tensor, hidden_states: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor], kv_caches: list[Any], attn_metadata: Any) -> torch.Tensor:
        rms_norm, add_rms_norm, rotary, silu_and_mul = ops.rms_norm, ops.add_rms_norm, ops.rotary, ops.silu_and_mul
        cos, sin = cos_sin
        if self.plan is not False and getattr(attn_metadata, "fused_decode_only", False):
            plan = self.plan if self.plan_kv_caches is kv_caches else self._build_plan(ops, kv_caches)
            if plan:  # (usable() saw hidden_states in the model's dtype, which the plan requires to be bfloat16)
                self.plan_steps += 1
                decode = attn_metadata.decode
                return plan.run(hidden_states, cos, sin, attn_metadata.slot_mapping, decode.block_table,
                                decode.seq_lens, decode.groups)
        num_tokens = hidden_states.shape[0]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            if residual is None:
                residual, x = hidden_states, rms_norm(hidden_states, layer.input_norm, layer.input_eps)
            else:
                x, residual = add_rms_norm(hidden_states, residual, layer.input_norm, layer.input_eps)
            q, k, v = _project(layer.qkv, layer.qkv_bias, x).split(layer.qkv_sizes, dim=-1)
            q = q.reshape(num_tokens, layer.num_heads, layer.head_dim)
            k = k.reshape(num_tokens, layer.num_kv_heads, layer.head_dim)
            if layer.q_norm is not None:  # each head's q and k normed (Qwen3)
                q, k = rms_norm(q, layer.q_norm, layer.q_norm_eps), rms_norm(k, layer.k_norm, layer.k_norm_eps)
            q, k = rotary(q, k, cos, sin) if layer.rotary is None else layer.rotary(positions, q, k, cos_sin)
            out = layer.attention(q, k, v.view(num_tokens, layer.num_kv_heads, layer.head_dim), kv_cache,
                                  attn_metadata, **layer.settings_kwargs)
            del q, k, v  # not kept into the next layer (64-row steps measured slower when they were)
            x, residual = add_rms_norm(_project(layer.o, layer.o_bias, out.reshape(num_tokens, layer.q_size)),
                                       residual, layer.post_norm, layer.post_eps)
            del out
            hidden_states = _project(layer.down, layer.down_bias,
                                     silu_and_mul(_project(layer.gate_up, layer.gate_up_bias, x)))
            del x
        return add_rms_norm(hidden_states, residual, self.norm, self.norm_eps)[0]

    def _build_plan(self, ops: Any, kv_caches: list[Any]) -> Any:
        """The loop above for a step of decodes only as one C++ call (``cpu_layer_ops.DecoderPlan``),
        where every call it would make has a C++ function: each projection a GGUF weight's kernel
        (``native_gemm``), the attention the torch backend's fused KV write and decode
        (``native_decode``), bfloat16 throughout, no q/k norms, LoRA or partial rotary. Sets and
        returns ``self.plan`` (False: the Python loop runs every step)."""
        self.plan, self.plan_kv_caches = False, kv_caches
        plan_type = getattr(ops, "DecoderPlan", None)
        if plan_type is None or self.dtype != torch.bfloat16 or len(kv_caches) != len(self.layers):
            return False
        gemm_capsule, layers = None, []
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            native_decode = getattr(layer.backend, "native_decode", None)
            decode = native_decode() if native_decode is not None else None
            if (decode is None or layer.q_norm is not None or layer.rotary is not None
                    or k_cache.dtype != torch.bfloat16 or layer.attention != layer.backend.forward):
                return False
            projections = []
            for proj, bias in ((layer.qkv, layer.qkv_bias), (layer.o, layer.o_bias), (layer.gate_up, layer.gate_up_bias),
                               (layer.down, layer.down_bias)):
                native_gemm = getattr(proj.qweight, "native_gemm", None)
                gemm = native_gemm() if native_gemm is not None and proj.lora is None else None
                if gemm is None or (gemm_capsule is not None and gemm[0] is not gemm_capsule):
                    return False
                gemm_capsule = gemm[0]
                projections += [gemm[1], bias]
            s = layer.settings
            scale = layer.backend.layout.scale if s.scale is None else s.scale
            layers.append((layer.input_norm, layer.input_eps, layer.post_norm, layer.post_eps, *projections,
                           layer.num_heads, layer.num_kv_heads, layer.head_dim, k_cache, v_cache, float(scale),
                           s.sliding_window or 0, float(s.logits_soft_cap or 0.0)))
        plan = plan_type(gemm_capsule, *decode, self.norm, self.norm_eps)
        for args in layers:
            plan.add_layer(*args)
        self.plan = plan
        return plan
