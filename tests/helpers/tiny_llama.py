"""A random tiny Llama in safetensors with the default model's tokenizer, and HF's greedy tokens
for ``PROMPT`` (the independent reference), shared by the tests of model sources and defaults."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

TINY = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
PROMPT = [1, 504, 3575, 282, 4649, 314]


def save_tiny_llama(path: Path, default_model_dir: str | Path, **config) -> transformers.LlamaForCausalLM:
    """Save a random float32 Llama built from ``config`` (seed 0) to ``path`` with the default
    model's tokenizer files (its vocabulary is 49152); returns the model."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.float32).eval()
    model.save_pretrained(path)
    for f in Path(default_model_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, Path(path) / f.name)
    return model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, default_model_dir):
    """A random tiny Llama in safetensors with the default model's tokenizer (same vocab)."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    model = save_tiny_llama(path, default_model_dir, **TINY)
    with torch.inference_mode():
        ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, pad_token_id=2)
    return path, ids[0, len(PROMPT):].tolist()


