"""The README's "Writing a plugin" examples, installed as one pip package (its own pyproject and
entry point, as a third party would ship them) and run: each hook kind registers, and each
plugin serves a request end to end, compared with an independent reference (HF transformers'
greedy tokens on the same weights, or a fact the example states)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers.tiny_llama import TINY, save_tiny_llama
from helpers import REPO_ROOT

README = REPO_ROOT / "README.md"
PROMPT = "The quick brown fox"


def _section() -> str:
    text = README.read_text()
    return text.split("### Writing a plugin\n", 1)[1].split("\n### ", 1)[0]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The section's python blocks as the module of a package with the section's entry point."""
    section = _section()
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert len(blocks) == 7, "one example per hook kind"
    entry = re.search(r"^```toml\n(.*?)^```", section, flags=re.S | re.M).group(1)
    name = re.search(r'^(\w+) = "(\w+)"', entry, flags=re.M)
    src = tmp_path_factory.mktemp("build") / "readme-plugin"
    (src / name.group(2)).mkdir(parents=True)
    (src / name.group(2) / "__init__.py").write_text("\n\n".join(blocks))
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=69"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "readme-plugin"\nversion = "0.1.0"\n\n{entry}\n'
        f'[tool.setuptools]\npackages = ["{name.group(2)}"]\n'
    )
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--target", str(target), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target, name.group(1)


def _paged(site, *args):
    env = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "paged.core.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    """A random tiny Llama saved twice: as Llama and as the example's ScaledLlamaForCausalLM."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("readme-tiny")
    hf = save_tiny_llama(root / "llama", default_model_dir, **TINY)
    save_tiny_llama(root / "scaled", default_model_dir, **TINY)
    config = json.loads((root / "scaled" / "config.json").read_text())
    (root / "scaled" / "config.json").write_text(json.dumps({**config, "architectures": ["ScaledLlamaForCausalLM"]}))
    ids = AutoTokenizer.from_pretrained(root / "llama")(PROMPT).input_ids
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=2,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return root, out[0, len(ids):].tolist()


def test_the_readme_plugin_registers_every_hook_kind(site):
    target, plugin = site
    listing = json.loads(_paged(target, "plugins", "--json").stdout)
    mine = {p["name"]: p for p in listing["plugins"]}[plugin]
    assert mine["status"] == "ok", mine
    assert mine["provides"] == {"policies": ["shortest-first"], "attention_backends": ["brute-force"],
                                "models": ["ScaledLlamaForCausalLM"], "quantization_methods": ["int8-rows"],
                                "structured_output_backends": ["choices"],
                                "speculative_proposers": ["last-token-lookup"], "lora_kernels": ["gather"]}


@pytest.mark.parametrize("model, flags", [
    ("llama", ["--policy", "shortest-first", "--policy-option", "tokens_per_s=2"]),
    ("llama", ["--attention", "brute-force", "--block-size", "4", "--max-num-batched-tokens", "4"]),
    ("scaled", []),
    ("llama", ["--speculative-config", '{"method": "last-token-lookup", "num_speculative_tokens": 3}']),
])
def test_the_readme_policy_backend_and_model_give_hf_greedy_tokens(site, tiny, model, flags):
    root, expected = tiny
    proc = _paged(site[0], "run", "-q", "--json", "--model", str(root / model), "--dtype", "float32",
                  "--max-tokens", "8", "--ignore-eos", *flags, PROMPT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["requests"][0]["token_ids"] == expected


def test_the_readme_quantization_method_quantizes_what_the_readme_says(site, tiny):
    root, expected = tiny
    proc = _paged(site[0], "run", "--json", "--model", str(root / "llama"), "--dtype", "float32",
                  "--quantization", "int8-rows", "--max-tokens", "8", "--ignore-eos", PROMPT)
    assert proc.returncode == 0, proc.stderr
    # 2 layers x (qkv, o, gate_up, down) + the embedding; the tied LM head shares it
    assert "quantized 9 weights (int8-rows: 9) for 10 modules; 1 share a weight quantized once" in proc.stderr
    tokens = json.loads(proc.stdout)["requests"][0]["token_ids"]
    assert len(tokens) == 8 and tokens[0] == expected[0]  # int8 rounding may move later tokens of a random model


def test_the_readme_structured_output_backend_constrains_to_the_choices(site, default_model_dir):
    proc = _paged(site[0], "run", "-q", "--json", "--structured-output-backend", "choices", "--choice", "Paris",
                  "--choice", "London", "--max-tokens", "8", "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)["requests"][0]
    assert result["text"] in ("Paris", "London") and result["finish_reason"] == "stop", result
    bad = _paged(site[0], "run", "-q", "--structured-output-backend", "choices", "--regex", "[0-9]+", "--max-tokens",
                 "4", "hi")
    assert bad.returncode != 0 and "the 'choices' backend serves choice only" in bad.stderr


def test_the_readme_proposer_drafts_and_its_drafts_are_verified(site, tiny):
    """On a prompt that repeats itself the example's drafts are accepted at times (and greedy
    tokens stay HF's: the parametrized test above)."""
    root, _ = tiny
    proc = _paged(site[0], "run", "-q", "--json", "--model", str(root / "llama"), "--dtype", "float32",
                  "--speculative-config", '{"method": "last-token-lookup", "num_speculative_tokens": 3}',
                  "--max-tokens", "24", "--ignore-eos", "a b c a b c a b c a b c a b c a b")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)["summary"]["speculative"]
    assert spec["method"] == "last-token-lookup" and spec["num_draft_tokens"] > 0, spec


def test_the_readme_lora_kernel_gives_hf_tokens_with_the_adapter_merged(site, tiny, tmp_path):
    """``paged run --lora-kernel gather`` with a PEFT adapter on the tiny Llama: HF's greedy tokens
    with the adapter merged (float32)."""
    from transformers import AutoTokenizer

    from helpers.lora_adapters import ALL_TARGETS, hf_greedy, save_adapter

    root, base_tokens = tiny
    merged = save_adapter(root / "llama", tmp_path / "adapter", 5, r=4, lora_alpha=8, target_modules=ALL_TARGETS)
    ids = AutoTokenizer.from_pretrained(root / "llama")(PROMPT).input_ids
    expected = hf_greedy(merged, ids, 8)
    assert expected != base_tokens
    proc = _paged(site[0], "run", "-q", "--json", "--model", str(root / "llama"), "--dtype", "float32",
                  "--enable-lora", "--lora-modules", f"mine={tmp_path / 'adapter'}", "--max-lora-rank", "4",
                  "--lora", "mine", "--lora-kernel", "gather", "--max-tokens", "8", "--ignore-eos", PROMPT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["requests"][0]["token_ids"] == expected
