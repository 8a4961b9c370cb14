"""The decoder of the sparse MoE families (Qwen2-MoE, Mixtral, Qwen3-MoE): Llama's layer and
model loop (pre-norm, residual folded into the next RMSNorm, one rotary table for every layer)
with each layer's attention and MLP built by the family (``SparseMoeForCausalLM`` hooks), so a
layer's MLP can be a ``paged.models.moe.FusedMoE`` or a dense ``GatedMLP``.

``SparseMoeForCausalLM`` is ``LlamaForCausalLM`` in everything the engine calls (forward,
compute_logits, load_weights, quantize_weights, prepack_weights, weight_bytes,
attention_shape) and in its attention hooks (``biases``, ``attention_options``,
``build_attention``); only the layers' MLPs differ. A family sets ``architecture``, ``mlp_name``
(the checkpoint's module name of a layer's MLP: ``mlp``, Mixtral's ``block_sparse_moe``) and
overrides ``build_mlp``, ``check_config`` and the attention hooks it needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paged.core.errors import ModelLoadError
from paged.models.layers import ParallelLMHead, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from paged.models.llama import LlamaForCausalLM, LlamaModel, attention_block, attention_shape


class SparseDecoderLayer(nn.Module):
    """``x += attn(norm(x)); x += mlp(norm(x))`` with the residual kept apart (as Llama's)."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module, mlp_name: str,
                 *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype=dtype, device=device)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)

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
        return self._modules[self.mlp_name](hidden_states), residual


class SparseDecoderModel(nn.Module):
    def __init__(self, family: type["SparseMoeForCausalLM"], config: Any, backend: Any, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        _, _, _, head_dim = attention_shape(config)
        eps = float(config.rms_norm_eps)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # rope_theta, any rope scaling and partial_rotary_factor, as the config states them
        self.rotary_emb = RotaryEmbedding.from_config(config, head_dim, device=device)
        self.layers = nn.ModuleList(
            SparseDecoderLayer(
                config.hidden_size, eps,
                family.build_attention(config, i, self.rotary_emb, backend, dtype=dtype, device=device),
                family.build_mlp(config, i, dtype=dtype, device=device),
                family.mlp_name, dtype=dtype, device=device,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    # Llama's: embed, the rotary table looked up once, the layers, the final norm (same attributes)
    forward = LlamaModel.forward


class SparseMoeForCausalLM(LlamaForCausalLM):
    """Base of the MoE families; see the module docstring for what a family overrides."""

    architecture = "SparseMoeForCausalLM"
    mlp_name = "mlp"

    def __init__(self, hf_config: Any, backend: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        nn.Module.__init__(self)  # LlamaForCausalLM.__init__ would build Llama's layers
        self.check_config(hf_config)
        self.config = hf_config
        self.dtype = dtype
        self.device = torch.device(device)
        self.model = SparseDecoderModel(type(self), hf_config, backend, dtype=dtype, device=self.device)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype, device="meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype, device=self.device)

    # ---- what a family overrides -----------------------------------------------------------------
    # (with Llama's hooks: ``biases``, ``attention_options`` (a layer's window), ``build_attention``)

    @classmethod
    def window_options(cls, window: int | None) -> dict[str, Any]:
        """``attention_options`` for a layer whose window is ``window`` (None: full attention)."""
        return {} if window is None else {"sliding_window": window}

    @classmethod
    def build_mlp(cls, hf_config: Any, layer_idx: int, *, dtype, device) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def check_window_value(cls, hf_config: Any) -> None:
        """ModelLoadError for a ``sliding_window`` that is neither null nor a positive integer."""
        window = getattr(hf_config, "sliding_window", None)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ModelLoadError(
                f"{cls.architecture}: sliding_window={window!r} is not usable (a positive integer or null is: "
                "the number of positions a windowed layer attends to)"
            )
