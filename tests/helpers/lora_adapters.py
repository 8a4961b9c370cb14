"""Random LoRA adapters made with PEFT itself for a tiny random base model, and the independent
reference: HF transformers with the adapter merged into the base weights (``merge_and_unload``),
greedy in float32."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from helpers.tiny_llama import TINY, save_tiny_llama

# a tiny Llama with GQA, untied head and every projection shape distinct (64 in, 128 MLP)
BASE = dict(TINY, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_base(path: Path, tokenizer_dir: str, **overrides) -> Path:
    save_tiny_llama(path, tokenizer_dir, **{**BASE, **overrides})
    return path


def save_adapter(base_dir: Path, path: Path, seed: int, *, model_class=transformers.LlamaForCausalLM,
                 scale: float = 3.0, **lora_config) -> torch.nn.Module:
    """A random adapter (``init_lora_weights=False``: A and B both random, scaled by ``scale`` so
    it changes the greedy tokens) saved by PEFT to ``path``; returns the base with it merged."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = model_class.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_config))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    peft_model.save_pretrained(path)
    return peft_model.merge_and_unload().eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()
