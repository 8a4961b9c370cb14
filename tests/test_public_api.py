"""The modules the README calls public keep exporting what plugins import from them, and every
import line of the README's code examples works."""

import importlib
import re

import pytest
from helpers import REPO_ROOT

README = REPO_ROOT / "README.md"

PUBLIC = {
    "paged": ["LLM", "SamplingParams"],
    "paged.core.hookspecs": ["hookimpl", "hookspec", "PolicySpec", "AttentionBackendSpec", "ModelSpec",
                             "QuantizationMethodSpec", "StructuredOutputBackendSpec", "AttentionShape", "CausalLM",
                             "ModelClass"],
    "paged.core.quantization": ["QuantizationMethodSpec", "QuantizedWeight", "BlockScales"],
    "paged.core.structured_output": ["StructuredOutputParams", "StructuredOutputBackend", "GrammarMatcher"],
    "paged.core.policy": ["BasePolicy"],
    "paged.core.attention": ["AttentionBackend", "AttentionLayout", "BatchInputs"],
    "paged.core.model": ["AttentionShape", "CausalLM", "ModelClass"],
    "paged.core.errors": ["PagedError", "ConfigError", "PluginError", "InvalidRequestError", "ModelLoadError",
                          "EngineError", "RequestRejectedError"],
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


def test_a_model_factory_without_attention_shape_is_a_config_error_naming_it():
    from paged.core.errors import ConfigError
    from paged.core.model import model_attention_shape

    class NoShape:
        pass

    with pytest.raises(ConfigError, match="'MyArch'.*attention_shape.*num_hidden_layers"):
        model_attention_shape(NoShape, "MyArch", object())
    # the first contract's factories had none: the shape comes from a Llama-like config
    from transformers import LlamaConfig as _Config
    assert model_attention_shape(NoShape, "MyArch", _Config(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=5)) == (5, 6, 2, 16)

    class BadShape:
        @staticmethod
        def attention_shape(hf_config):
            return (2, 6, 4, 8)  # 6 query heads cannot share 4 KV heads

    with pytest.raises(ConfigError, match=r"\(2, 6, 4, 8\)"):
        model_attention_shape(BadShape, "MyArch", object())
    from paged.models.llama import LlamaForCausalLM
    from transformers import LlamaConfig

    shape = model_attention_shape(LlamaForCausalLM, "LlamaForCausalLM", LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3))
    assert shape == (3, 4, 2, 16) and shape.head_dim == 16


def test_every_hook_has_a_typed_spec_re_exported_from_hookspecs():
    import typing

    from paged.core import hookspecs

    for name in ("register_policies", "register_attention_backends", "register_models",
                 "register_quantization_methods", "register_structured_output_backends"):
        hook = getattr(hookspecs.PagedHookSpecs, name)
        returned = typing.get_type_hints(hook, vars(hookspecs))["return"]
        (spec,) = typing.get_args(returned)
        assert getattr(hookspecs, spec.__name__) is spec and spec.__name__ in hookspecs.__all__, name
