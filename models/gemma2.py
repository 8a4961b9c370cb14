"""Gemma 2 for causal LM over a paged KV cache (``Gemma2ForCausalLM`` of HF transformers).

What differs from Llama, each as HF computes it:

- RMSNorm scales by ``1 + w`` (the checkpoint stores ``w`` centred on zero) and multiplies in
  float32 before the one rounding to the model dtype (``GemmaRMSNorm``).
- Four norms per layer: ``input_layernorm`` and ``post_attention_layernorm`` around the attention,
  ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around the MLP; the residual
  adds the *normed* branch outputs.
- The embedding is multiplied by ``sqrt(hidden_size)`` rounded to the model dtype (HF casts the
  float32 scalar to the weight's dtype first: 55.4256 becomes 55.5 in bfloat16).
- The softmax scale is ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``), attention
  logits are soft-capped (``attn_logit_softcapping``) and so are the final logits
  (``final_logit_softcapping``, in ``compute_logits``): ``cap * tanh(x / cap)``.
- GeGLU MLP (``gelu_pytorch_tanh``), tied embeddings by default.
- Layers alternate local (sliding-window) and global attention: ``config.layer_types`` as the
  installed transformers sets it (``sliding_attention`` for even layers when the config does not
  list them, as HF's default).

Window, soft-cap and scale go to ``paged.models.layers.Attention`` (``sliding_window``,
``logits_soft_cap``, ``scale``); a window that covers ``max_position_embeddings`` is passed as
none (it cannot change a result). Gemma 3 (``paged.models.gemma3``) builds on these classes.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from paged.core.errors import ModelLoadError
from paged.core.loading.weights import load_checkpoint
from paged.core.model import AttentionShape
from paged.models import cpu_layer_ops
from paged.models.layers import (
    Attention,
    GatedMLP,
    ParallelLMHead,
    RotaryEmbedding,
    VocabParallelEmbedding,
    prepack_cpu_linears,
    quantize_weights,
    rope_settings,
    weight_bytes,
)
from paged.models.llama import attention_block
from paged.models.llama import attention_shape as _llama_attention_shape

LAYER_TYPES = ("sliding_attention", "full_attention")


def attention_shape(hf_config: Any) -> AttentionShape:
    """As Llama's: Gemma configs always state ``head_dim`` (256 for most sizes, not hidden / heads)."""
    return _llama_attention_shape(hf_config)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``, in HF's order of operations (divide, tanh, multiply)."""
    return torch.tanh(x / cap) * cap


# ---- norm ------------------------------------------------------------------------------------


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)``, all in float32, rounded once to ``x``'s dtype (HF's Gemma norm;
    Llama's rounds before the weight instead). ``weight`` holds the checkpoint's ``w``;
    ``prepare()`` (called by ``load_weights``) derives the float32 ``1 + w`` used from then on.

    With ``residual`` it first adds ``x + residual`` (in ``x``'s dtype, as HF's residual add) and
    returns ``(normed, new_residual)``. On CPUs this is one fused C++ op
    (``cpu_layer_ops.gemma_rms_norm`` / ``gemma_add_rms_norm``) with these roundings.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.register_buffer("scale", torch.empty(0, dtype=torch.float32, device=device), persistent=False)

    def prepare(self) -> None:
        """Derive ``scale = 1 + float32(weight)`` after the weight is loaded (or changed)."""
        self.scale = 1.0 + self.weight.detach().float()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.scale).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = cpu_layer_ops.enabled(x)
        if ops is not None:  # one fused op instead of ten
            if residual is None:
                return ops.gemma_rms_norm(x, self.scale, self.eps)
            if residual.dtype == x.dtype and residual.shape == x.shape:  # else: the torch ops broadcast
                return ops.gemma_add_rms_norm(x, residual, self.scale, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def prepare_gemma_norms(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, GemmaRMSNorm):
            module.prepare()


# ---- config ----------------------------------------------------------------------------------


def hidden_activation(hf_config: Any) -> str:
    """The MLP activation: ``hidden_activation`` (Gemma 2/3's field), else ``hidden_act``."""
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
    return str(act or "gelu_pytorch_tanh")


def layer_types(hf_config: Any, default_pattern: int) -> list[str]:
    """Per layer ``"sliding_attention"`` or ``"full_attention"``: ``config.layer_types`` where the
    config has it (transformers 5 always fills it), else HF's rule: layer ``i`` is global when
    ``(i + 1) % pattern == 0`` (``sliding_window_pattern``, Gemma 2: 2, Gemma 3: 6)."""
    n = int(hf_config.num_hidden_layers)
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        pattern = int(getattr(hf_config, "sliding_window_pattern", None)
                      or getattr(hf_config, "_sliding_window_pattern", None) or default_pattern)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    types = list(types)
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(
            f"layer_types {types!r}: expected {n} entries (num_hidden_layers), each one of {', '.join(LAYER_TYPES)}"
        )
    return types


def layer_window(hf_config: Any, layer_type: str) -> int | None:
    """The sliding window of a layer of ``layer_type``; None for global layers, and where the
    window covers every position the model can see (then it cannot change a result)."""
    window = getattr(hf_config, "sliding_window", None)
    if layer_type != "sliding_attention" or window is None:
        return None
    window = int(window)
    if window < 1:
        raise ModelLoadError(f"sliding_window {window!r}: must be a positive number of positions (or null)")
    return None if window >= int(hf_config.max_position_embeddings) else window


def attention_scale(hf_config: Any) -> float | None:
    """``query_pre_attn_scalar ** -0.5``; None when that is the default ``head_dim ** -0.5``."""
    scalar = getattr(hf_config, "query_pre_attn_scalar", None)
    head_dim = attention_shape(hf_config).head_dim
    if scalar is None or float(scalar) == float(head_dim):
        return None
    if float(scalar) <= 0:
        raise ModelLoadError(f"query_pre_attn_scalar {scalar!r}: must be positive")
    return float(scalar) ** -0.5


def _positive_or_none(hf_config: Any, name: str) -> float | None:
    value = getattr(hf_config, name, None)
    if value is None:
        return None
    if float(value) <= 0:
        raise ModelLoadError(f"{name} {value!r}: must be a positive number or null (no soft-capping)")
    return float(value)


# ---- layers ----------------------------------------------------------------------------------


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around attention and MLP. The residual stream is carried separately and
    its adds folded into the next norm (``GemmaRMSNorm(x, residual)``), as Llama's layers do:
    the layer returns ``(mlp branch after its post-norm, residual before that branch)``."""

    def __init__(self, config: Any, attention: nn.Module, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, float(config.rms_norm_eps)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype, device=device)
        self.self_attn = attention
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype, device=device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype, device=device)
        self.mlp = GatedMLP(
            hidden, config.intermediate_size, False, dtype=dtype, device=device, activation=hidden_activation(config)
        )
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype=dtype, device=device)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: Any,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = attention_block(self, positions, hidden_states, residual, kv_cache, attn_metadata,
                                                  cos_sin)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return self.post_feedforward_layernorm(hidden_states), residual


class GemmaModel(nn.Module):
    """Scaled embedding, the decoder layers, final norm. ``rotaries`` maps a layer type to its
    rotary embedding (Gemma 2: one for both; Gemma 3: its own base per type); ``layers[i]``
    uses ``rotaries[types[i]]``."""

    def __init__(
        self, config: Any, types: list[str], rotaries: dict[str, RotaryEmbedding], layers: list[nn.Module],
        *, dtype: torch.dtype, device,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # HF: torch.tensor(sqrt(hidden)) (float32) cast to the weight's dtype, then multiplied in it
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size**0.5).to(dtype=dtype, device=device), persistent=False
        )
        self.rotaries = nn.ModuleDict(rotaries)
        self.layer_types = types
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, float(config.rms_norm_eps), dtype=dtype, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Any,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale
        # once per forward for every rotary, shared by the layers that use it
        cos_sin = {kind: rotary.lookup(positions, hidden_states.dtype) for kind, rotary in self.rotaries.items()}
        residual = None
        for layer, kind, kv_cache in zip(self.layers, self.layer_types, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata, cos_sin[kind])
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(nn.Module):
    """``Gemma2ForCausalLM`` of HF (see the module docstring for what it computes)."""

    architecture = "Gemma2ForCausalLM"
    window_pattern = 2  # HF's default layer_types: every second layer global

    def __init__(self, hf_config: Any, backend: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.config = hf_config
        self.dtype = dtype
        self.device = torch.device(device)
        types = layer_types(hf_config, self.window_pattern)
        rotaries = self.build_rotaries(hf_config, types, self.device)
        layers = [
            GemmaDecoderLayer(
                hf_config, self.build_attention(hf_config, t, rotaries[t], backend, dtype, self.device),
                dtype=dtype, device=self.device,
            )
            for t in types
        ]
        self.model = GemmaModel(hf_config, types, rotaries, layers, dtype=dtype, device=self.device)
        self.final_logit_softcapping = _positive_or_none(hf_config, "final_logit_softcapping")
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype, device="meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype, device=self.device)

    # ---- what Gemma 3 changes ------------------------------------------------------------------

    @classmethod
    def build_rotaries(cls, hf_config: Any, types: list[str], device: torch.device) -> dict[str, RotaryEmbedding]:
        """One rotary embedding (``rope_theta``, ``rope_scaling``) shared by both layer types."""
        theta, scaling = rope_settings(hf_config)
        rotary = RotaryEmbedding(
            attention_shape(hf_config).head_dim, int(hf_config.max_position_embeddings), theta, scaling, device=device
        )
        return {t: rotary for t in sorted(set(types))}

    @classmethod
    def build_attention(
        cls, hf_config: Any, layer_type: str, rotary: RotaryEmbedding, backend: Any, dtype: torch.dtype, device
    ) -> nn.Module:
        _, num_heads, num_kv_heads, head_dim = attention_shape(hf_config)
        return Attention(
            hf_config.hidden_size, num_heads, num_kv_heads, head_dim, rotary, backend,
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            o_bias=bool(getattr(hf_config, "attention_bias", False)),
            sliding_window=layer_window(hf_config, layer_type),
            logits_soft_cap=_positive_or_none(hf_config, "attn_logit_softcapping"),
            scale=attention_scale(hf_config),
            dtype=dtype, device=device,
        )

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        act = hidden_activation(hf_config)
        if act not in ("gelu_pytorch_tanh",):
            raise ModelLoadError(
                f"{cls.architecture}: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh', "
                "the tanh-approximated GELU every Gemma 2/3 checkpoint uses)"
            )
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ModelLoadError(
                f"{cls.architecture}: use_bidirectional_attention=true (an encoder) is not supported; "
                "a causal LM needs false"
            )
        _, num_heads, num_kv_heads, _ = attention_shape(hf_config)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{cls.architecture}: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        layer_types(hf_config, cls.window_pattern)
        for t in LAYER_TYPES:
            layer_window(hf_config, t)
        attention_scale(hf_config)
        _positive_or_none(hf_config, "final_logit_softcapping")
        _positive_or_none(hf_config, "attn_logit_softcapping")

    attention_shape = staticmethod(attention_shape)

    # ---- forward ---------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Any,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)  # float32 on rank 0, None elsewhere
        if logits is None or self.final_logit_softcapping is None:
            return logits
        return soft_cap(logits, self.final_logit_softcapping)

    def quantize_weights(self, quantizer: Any) -> int:
        """Quantize the linear layers, LM head and embedding after loading
        (``paged.models.layers.quantize_weights``); returns the number of modules quantized."""
        return quantize_weights(self, quantizer)

    def weight_bytes(self) -> int:
        return weight_bytes(self)

    # ---- weights ---------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors into the (fused) parameters; ``lm_head.weight`` is ignored when the
        embeddings are tied. Then every norm derives its float32 ``1 + w``."""
        tied = self.tie_word_embeddings
        load_checkpoint(
            self, weights, self.architecture,
            ignore=lambda name: "rotary_emb." in name or (tied and name == "lm_head.weight"),
        )
        prepare_gemma_norms(self)

    def prepack_weights(self) -> int:
        """bfloat16 on a CPU: oneDNN-packed copies of the linear weights (``prepack_cpu_linears``)."""
        return prepack_cpu_linears(self)
