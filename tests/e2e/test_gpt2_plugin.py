"""A model plugin that is not Llama: the GPT-2 example package (tests/fixtures/paged-gpt2-plugin),
pip-installed and found through its entry point, run by ``paged run`` on a tiny random GPT-2 and
compared token for token with HF transformers on the same weights."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers.fixture_packages import pip_install_fixture
from helpers import FIXTURES

PROMPTS = ["The quick brown fox", "Paged attention keeps the KV cache in blocks, and"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def gpt2_site(tmp_path_factory):
    return pip_install_fixture("paged-gpt2-plugin", tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory, default_model_dir):
    """A random-weight GPT-2 saved with save_pretrained, with the default model's tokenizer."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # larger than the default init, so the greedy tokens depend on the context
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path_factory.mktemp("tiny-gpt2")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, model, tokenizer


def _paged(args, site, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([sys.executable, "-m", "paged.core.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding by full forward passes: the independent reference."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_paged_run_with_the_gpt2_plugin_matches_hf(gpt2_site, tiny_gpt2):
    model_dir, hf_model, tokenizer = tiny_gpt2
    listing = json.loads(_paged(["plugins", "--json"], gpt2_site).stdout)
    gpt2 = {p["name"]: p for p in listing["plugins"]}["gpt2"]
    assert gpt2["distribution"] == "paged-gpt2-plugin" and gpt2["provides"] == {"models": ["GPT2LMHeadModel"]}

    proc = _paged(["run", "-q", "--json", "--model", str(model_dir), "--max-tokens", str(MAX_TOKENS),
                   "--ignore-eos", "--block-size", "4", *PROMPTS], gpt2_site)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)["requests"]
    for prompt, result in zip(PROMPTS, results, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        assert result["num_prompt_tokens"] == len(prompt_ids)
        assert result["token_ids"] == _hf_greedy(hf_model, prompt_ids, MAX_TOKENS), prompt
    assert len({tuple(r["token_ids"]) for r in results}) == 2  # not one constant continuation


def test_a_gpt2_config_mistake_is_a_config_error_before_any_weight_loads(gpt2_site, tiny_gpt2, tmp_path):
    model_dir, _, _ = tiny_gpt2
    config = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    # no weights at all in tmp_path: had they been read first, the error would be about them
    proc = _paged(["run", "-q", "--model", str(tmp_path), "hello"], gpt2_site)
    assert proc.returncode == 2, proc.stderr
    assert "activation_function 'relu' is not supported" in proc.stderr and "safetensors" not in proc.stderr
    too_long = _paged(["run", "-q", "--model", str(model_dir), "--max-model-len", "4096", "hi"], gpt2_site)
    assert too_long.returncode == 2 and "model.max_model_len: 4096 exceeds" in too_long.stderr
    without_plugin = subprocess.run([sys.executable, "-m", "paged.core.cli", "run", "-q", "--model", str(model_dir), "hi"],
                                    capture_output=True, text=True, timeout=300)
    assert without_plugin.returncode == 2 and "no plugin provides 'GPT2LMHeadModel'" in without_plugin.stderr


LLAMA_CONFIG_NAMES = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "intermediate_size",
    "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "hidden_act", "head_dim",
)


def test_the_gpt2_plugin_uses_no_llama_config_names():
    source = "\n".join(p.read_text() for p in (FIXTURES / "paged-gpt2-plugin").rglob("*.py"))
    used = [name for name in LLAMA_CONFIG_NAMES if re.search(rf"\b{name}\b", source)]
    assert not used and "paged.models.llama" not in source
