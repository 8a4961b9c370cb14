"""Shared fixtures: the embedded default model and an independent HF transformers reference."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# A test that needs the default model skips without it; under PAGED_REQUIRE_MODEL=1 (CI) it fails.
pytest_plugins = ["helpers.default_model"]


@pytest.fixture(scope="session")
def default_model_dir():
    from helpers.default_model import default_gguf
    from paged.core.loading.gguf import converted_model_dir

    return str(converted_model_dir(default_gguf()))


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
