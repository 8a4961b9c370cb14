"""The modules the README calls public keep exporting what plugins import from them, and every
import line of the README's code examples works."""

import importlib
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"

PUBLIC = {
    "paged": ["LLM", "SamplingParams"],
    "paged.core.hookspecs": ["hookimpl", "hookspec", "PolicySpec", "AttentionBackendSpec", "ModelSpec",
                             "AttentionShape", "CausalLM", "ModelClass"],
    "paged.core.policy": ["BasePolicy"],
    "paged.core.attention": ["AttentionBackend", "AttentionLayout", "BatchInputs"],
    "paged.core.model": ["AttentionShape", "CausalLM", "ModelClass"],
    "paged.core.errors": ["PagedError", "ConfigError", "PluginError", "InvalidRequestError", "ModelLoadError"],
    "paged.core.loading.weights": ["CheckpointSlice", "whole_parameters", "expected_tensors", "load_checkpoint"],
    "paged.models.layers": ["CheckpointSlice", "whole_parameters", "Linear", "RowParallelLinear",
                            "MergedColumnParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "RMSNorm",
                            "RotaryEmbedding", "GatedMLP", "Attention", "prepack_cpu_linears"],
    "paged.models.llama": ["LlamaForCausalLM", "attention_shape"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_modules_export_their_names(module):
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lost {missing}"


def test_readme_names_the_public_modules():
    text = README.read_text()
    for module in PUBLIC:
        if module != "paged":
            assert f"`{module}`" in text, module


def test_every_import_in_the_readme_examples_works():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()
             if re.match(r"\s*(from paged|import paged)", line)]
    assert any("paged.core.hookspecs" in line for line in lines)
    for line in lines:
        exec(line, {})
