"""Llama (and, through a subclass, Qwen2) for causal LM over a paged KV cache.

Contract relied on by the model runner::

    model = LlamaForCausalLM(hf_config, backend, dtype, device)
    model.load_weights(iter_of_(hf_name, tensor))
    hidden = model(input_ids[T], positions[T], kv_caches, attn_metadata)   # [T, hidden_size]
    logits = model.compute_logits(hidden[N])     # [N, vocab] float32 (None on ranks other than 0)
    LlamaForCausalLM.attention_shape(hf_config) -> AttentionShape

(the engine's side of it is ``paged.core.model``).

Module names follow the HF checkpoint except for the fused projections: ``qkv_proj`` (loaded
from ``q_proj``, ``k_proj``, ``v_proj``) and ``gate_up_proj`` (from ``gate_proj``, ``up_proj``).
Under tensor parallelism each rank builds and loads only its share (``paged.models.layers``).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from paged.core.errors import ModelLoadError
from paged.core.loading.weights import load_checkpoint
from paged.core.model import AttentionShape
from paged.models.direct_decoder import DirectDecoder
from paged.models.layers import (
    Attention,
    GatedMLP,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    prepack_cpu_linears,
    quantize_weights,
    weight_bytes,
)


def attention_shape(hf_config: Any) -> AttentionShape:
    """``(num_layers, num_heads, num_kv_heads, head_dim)``; ``head_dim`` is the config's when it
    has one, else ``hidden_size // num_attention_heads``."""
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return AttentionShape(int(hf_config.num_hidden_layers), num_heads, num_kv_heads, int(head_dim))


def effective_sliding_window(hf_config: Any, window: Any) -> int | None:
    """``window`` (a config's ``sliding_window``) as the layer's attention window, or None where
    it cannot matter: no window, or one no shorter than ``max_position_embeddings`` (which caps
    every sequence the engine runs)."""
    if window is None:
        return None
    limit = getattr(hf_config, "max_position_embeddings", None)
    return None if limit is not None and int(window) >= int(limit) else int(window)


def attention_block(layer: nn.Module, positions: torch.Tensor, hidden_states: torch.Tensor,
                    residual: torch.Tensor | None, kv_cache: Any, attn_metadata: Any,
                    cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of a pre-norm decoder layer (Llama's, Gemma's, the sparse decoders'):
    ``layer.input_layernorm`` over the hidden states plus the residual carried from the layer
    before (none before the first), then ``layer.self_attn``; returns (attention output,
    residual)."""
    if residual is None:
        residual = hidden_states
        hidden_states = layer.input_layernorm(hidden_states)
    else:
        hidden_states, residual = layer.input_layernorm(hidden_states, residual)
    return layer.self_attn(positions, hidden_states, kv_cache, attn_metadata, cos_sin), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        backend: Any,
        biases: tuple[bool, bool, bool],
        *,
        dtype: torch.dtype,
        device,
        self_attn: nn.Module | None = None,
    ) -> None:
        """``self_attn``: the layer's attention when the architecture builds its own
        (``LlamaForCausalLM.build_attention``); None builds Llama's."""
        super().__init__()
        _, num_heads, num_kv_heads, head_dim = attention_shape(config)
        qkv_bias, o_bias, mlp_bias = biases
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = self_attn if self_attn is not None else Attention(
            config.hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary,
            backend,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            dtype=dtype,
            device=device,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, mlp_bias, dtype=dtype, device=device)

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
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: Any, backend: Any, biases: tuple[bool, bool, bool], *, dtype: torch.dtype, device,
        family: Any = None,
    ) -> None:
        """``family``: the ``LlamaForCausalLM`` (sub)class whose ``build_attention`` builds each
        layer's attention; None: Llama's attention in every layer."""
        super().__init__()
        _, _, _, head_dim = attention_shape(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # rope_theta, any rope scaling and partial_rotary_factor, as the config states them
        self.rotary_emb = RotaryEmbedding.from_config(config, head_dim, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, self.rotary_emb, backend, biases, dtype=dtype, device=device,
                self_attn=None if family is None else family.build_attention(
                    config, i, self.rotary_emb, backend, dtype=dtype, device=device),
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, float(config.rms_norm_eps), dtype=dtype, device=device)
        self._direct: DirectDecoder | None | bool = False  # False: not read yet (at the first eager forward)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: Any,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.lookup(positions, hidden_states.dtype)  # once, for every layer
        if not torch.compiler.is_compiling():
            direct = getattr(self, "_direct", False)  # a subclass may not run this __init__ (the sparse decoders)
            if direct is False:
                direct = self._direct = DirectDecoder.of(self, LlamaDecoderLayer) if type(self).forward is _MODEL_FORWARD else None
            if direct is not None and LlamaDecoderLayer.forward is _LAYER_FORWARD and attention_block is _ATTENTION_BLOCK:
                out = direct.forward(positions, hidden_states, cos_sin, kv_caches, attn_metadata)
                if out is not None:  # the same calls without the module tree (paged.models.direct_decoder)
                    return out
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata, cos_sin)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# as defined here: a subclass or a patch with another forward keeps the modules' path
_LAYER_FORWARD, _MODEL_FORWARD, _ATTENTION_BLOCK = LlamaDecoderLayer.forward, LlamaModel.forward, attention_block


class LlamaForCausalLM(nn.Module):
    """``LlamaForCausalLM`` of HF: RMSNorm, rotary (any rope type of ``paged.models.rotary``,
    partial_rotary_factor), GQA, gated SiLU. Subclasses change the layers' attention through
    ``attention_options`` / ``build_attention``."""

    architecture = "LlamaForCausalLM"

    def __init__(self, hf_config: Any, backend: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.config = hf_config
        self.dtype = dtype
        self.device = torch.device(device)
        self.model = LlamaModel(
            hf_config, backend, self.biases(hf_config), dtype=dtype, device=self.device, family=type(self)
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype, device="meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype, device=self.device)

    # ---- what differs between the architectures ------------------------------------------------

    @classmethod
    def biases(cls, hf_config: Any) -> tuple[bool, bool, bool]:
        """``(qkv_bias, o_proj_bias, mlp_bias)``."""
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return attention_bias, attention_bias, bool(getattr(hf_config, "mlp_bias", False))

    @classmethod
    def attention_options(cls, hf_config: Any, layer_idx: int) -> dict[str, Any]:
        """Layer ``layer_idx``'s keyword arguments of ``paged.models.layers.Attention`` beyond the
        shape and biases (``sliding_window``, ``logits_soft_cap``, ``scale``): none for Llama."""
        return {}

    @classmethod
    def build_attention(
        cls, hf_config: Any, layer_idx: int, rotary: RotaryEmbedding, backend: Any, *, dtype: torch.dtype, device
    ) -> nn.Module:
        """Layer ``layer_idx``'s attention: ``Attention`` with this architecture's biases and
        ``attention_options``. An architecture with another attention (Qwen3's q/k norms)
        overrides this; what it returns is called like ``Attention``."""
        _, num_heads, num_kv_heads, head_dim = cls.attention_shape(hf_config)
        qkv_bias, o_bias, _ = cls.biases(hf_config)
        return Attention(
            hf_config.hidden_size, num_heads, num_kv_heads, head_dim, rotary, backend,
            qkv_bias=qkv_bias, o_bias=o_bias, dtype=dtype, device=device,
            **cls.attention_options(hf_config, layer_idx),
        )

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{cls.architecture}: hidden_act {act!r} is not supported (only 'silu')")
        _, num_heads, num_kv_heads, _ = attention_shape(hf_config)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{cls.architecture}: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )

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
        return self.lm_head(hidden_states)

    def quantize_weights(self, quantizer: Any) -> int:
        """Quantize the linear layers, LM head and embedding after loading
        (``paged.models.layers.quantize_weights``); returns the number of modules quantized."""
        return quantize_weights(self, quantizer)

    def weight_bytes(self) -> int:
        """Bytes of the weights as held (dense, packed and quantized)."""
        return weight_bytes(self)

    # ---- weights ---------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters, converting dtype and device.

        Raises ModelLoadError naming every missing tensor, unexpected tensor and shape mismatch.
        ``rotary_emb.*`` buffers are ignored; so is ``lm_head.weight`` when embeddings are tied.
        """
        tied = self.tie_word_embeddings
        load_checkpoint(
            self, weights, self.architecture,
            ignore=lambda name: "rotary_emb." in name or (tied and name == "lm_head.weight"),
        )

    def prepack_weights(self) -> int:
        """bfloat16 on a CPU: oneDNN-packed copies of the linear weights (``prepack_cpu_linears``)."""
        return prepack_cpu_linears(self)
