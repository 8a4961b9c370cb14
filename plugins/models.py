"""Bundled model architectures: Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2/3 (text) and the
sparse MoE Qwen2-MoE, Mixtral and Qwen3-MoE (the README's "Models" table)."""

from __future__ import annotations

from paged.core.hookspecs import ModelSpec, hookimpl
from paged.models.gemma2 import Gemma2ForCausalLM
from paged.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from paged.models.llama import LlamaForCausalLM
from paged.models.mistral import MistralForCausalLM
from paged.models.mixtral import MixtralForCausalLM
from paged.models.phi3 import Phi3ForCausalLM
from paged.models.qwen2 import Qwen2ForCausalLM
from paged.models.qwen2_moe import Qwen2MoeForCausalLM
from paged.models.qwen3 import Qwen3ForCausalLM
from paged.models.qwen3_moe import Qwen3MoeForCausalLM


@hookimpl
def register_models():
    return [
        ModelSpec(
            "LlamaForCausalLM", LlamaForCausalLM, "Llama family incl. SmolLM (GQA; rope scaling linear, dynamic, yarn, llama3, longrope)"
        ),
        ModelSpec("Qwen2ForCausalLM", Qwen2ForCausalLM, "Qwen2 / Qwen2.5 (q/k/v biases; use_sliding_window honoured)"),
        ModelSpec("Qwen3ForCausalLM", Qwen3ForCausalLM, "Qwen3 dense (per-head q/k RMSNorm, explicit head_dim)"),
        ModelSpec("MistralForCausalLM", MistralForCausalLM, "Mistral (Llama layers, sliding window where set)"),
        ModelSpec("Phi3ForCausalLM", Phi3ForCausalLM,
                  "Phi-3 / Phi-3.5 / Phi-4-mini (fused qkv and gate-up, partial rotary, longrope)"),
        ModelSpec("Qwen2MoeForCausalLM", Qwen2MoeForCausalLM,
                  "Qwen1.5-MoE / Qwen2-MoE (fused CPU MoE: routed experts + gated shared expert)"),
        ModelSpec("MixtralForCausalLM", MixtralForCausalLM, "Mixtral (fused CPU MoE, top-k routed experts; sliding window where set)"),
        ModelSpec("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM,
                  "Qwen3-MoE, e.g. Qwen3-30B-A3B (fused CPU MoE; Qwen3's per-head q/k RMSNorm)"),
        ModelSpec("Gemma2ForCausalLM", Gemma2ForCausalLM,
                  "Gemma 2 (local/global sliding window, attention + final logit soft-caps, GeGLU)"),
        ModelSpec("Gemma3ForCausalLM", Gemma3ForCausalLM,
                  "Gemma 3 text (q/k norm, local/global rope bases, sliding window, GeGLU)"),
        ModelSpec("Gemma3ForConditionalGeneration", Gemma3ForConditionalGeneration,
                  "multimodal Gemma 3: refused with a clear error (use a text-only checkpoint or its GGUF)"),
    ]
