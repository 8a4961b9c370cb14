"""Shared fixtures: the embedded default model and an independent HF transformers reference."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402



@pytest.fixture(scope="session")
def default_model_dir():
    from paged.core.loading.gguf import default_model_dir as convert

    return str(convert())


@pytest.fixture(scope="session")
def hf_greedy(default_model_dir):
    """Greedy continuations from HF transformers on the same weights, one prompt at a time
    (no padding), keyed by (prompt token ids, max_new_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    cache = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                    max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                )
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]

    return generate
