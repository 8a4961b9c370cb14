"""Bundled model architectures: ``LlamaForCausalLM`` and ``Qwen2ForCausalLM``."""

from __future__ import annotations

from paged.core.hookspecs import ModelSpec, hookimpl
from paged.models.llama import LlamaForCausalLM
from paged.models.qwen2 import Qwen2ForCausalLM


@hookimpl
def register_models():
    return [
        ModelSpec(
            "LlamaForCausalLM", LlamaForCausalLM, "Llama family incl. SmolLM (GQA; default or llama3 rope scaling)"
        ),
        ModelSpec("Qwen2ForCausalLM", Qwen2ForCausalLM, "Qwen2 / Qwen2.5 (q/k/v biases; no sliding window)"),
    ]
