"""Config and tokenizer snapshots (``paged.core.loading.config_snapshot``) answer exactly as the
transformers objects they stand for, and a warm start reads them without transformers' model code.

The reference is transformers itself: ``AutoConfig`` / ``AutoTokenizer`` on the same directory,
compared attribute by attribute (every name ``dir()`` lists, values or the AttributeError)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from paged.core.loading import config_snapshot, loader
from paged.core.loading.gguf import default_model_dir

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        architectures=["LlamaForCausalLM"], dtype="bfloat16",
    ),
    "qwen2-windowed": lambda: transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=2,
        architectures=["Qwen2ForCausalLM"],
    ),
    # attribute_map aliases (num_hidden_layers -> n_layer) and a model type with other names
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=256,
                                            architectures=["GPT2LMHeadModel"]),
}


def _attributes(config) -> dict[str, object]:
    """Every non-callable attribute ``dir()`` names, as its value or the exception type it raises."""
    out: dict[str, object] = {}
    for name in set(dir(config)) | set(type(config).attribute_map):
        if name.startswith("__"):
            continue
        try:
            value = getattr(config, name)
        except Exception as e:
            out[name] = type(e)
            continue
        if not callable(value):
            out[name] = value
    return out


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_snapshot_answers_every_attribute_as_the_real_config(kind, tmp_path):
    model_dir = tmp_path / "model"
    CONFIGS[kind]().save_pretrained(model_dir)
    cache = tmp_path / "cache"
    reference = transformers.AutoConfig.from_pretrained(model_dir)

    first = config_snapshot.load(model_dir, loader._load_hf_config, cache)
    assert not isinstance(first, config_snapshot.ConfigSnapshot)  # the first load is the real one
    snapshot = config_snapshot.load(model_dir, loader._load_hf_config, cache)
    assert isinstance(snapshot, config_snapshot.ConfigSnapshot)

    expected = _attributes(reference)
    held = object.__getattribute__(snapshot, "_values")
    assert {"vocab_size", "num_attention_heads", "architectures", "model_type"} <= set(held)
    for name, value in expected.items():
        if value is AttributeError:
            assert not hasattr(snapshot, name), name
        elif isinstance(value, type) and issubclass(value, Exception):
            with pytest.raises(value):
                getattr(snapshot, name)
        elif config_snapshot._plain(value) or isinstance(value, torch.dtype):
            assert getattr(snapshot, name) == value, name
        else:  # an object (a nested config, ...): the real config's own, of the same kind
            assert type(getattr(snapshot, name)) is type(value), name


def test_plain_reads_do_not_build_the_real_config_and_the_rest_does(tmp_path):
    model_dir = tmp_path / "model"
    CONFIGS["llama"]().save_pretrained(model_dir)
    cache = tmp_path / "cache"
    built = []

    def build(path):
        built.append(path)
        return loader._load_hf_config(path)

    config_snapshot.load(model_dir, build, cache)
    snapshot = config_snapshot.load(model_dir, build, cache)
    assert len(built) == 1
    assert (snapshot.hidden_size, snapshot.num_key_value_heads, snapshot.rope_scaling["rope_type"]) == (64, 2, "llama3")
    assert snapshot.dtype is torch.bfloat16  # a torch dtype, as the real config holds it
    assert getattr(snapshot, "no_such_field", "absent") == "absent"
    assert len(built) == 1  # none of that needed transformers
    assert snapshot.to_dict() == transformers.AutoConfig.from_pretrained(model_dir).to_dict()
    assert len(built) == 2
    snapshot.hidden_size = 128  # a write goes to the real config and is read back from it
    assert snapshot.hidden_size == 128 and config_snapshot.real(snapshot).hidden_size == 128


def test_a_changed_config_json_is_read_again(tmp_path):
    model_dir = tmp_path / "model"
    CONFIGS["llama"]().save_pretrained(model_dir)
    cache = tmp_path / "cache"
    config_snapshot.load(model_dir, loader._load_hf_config, cache)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["num_hidden_layers"] = 5
    (model_dir / "config.json").write_text(json.dumps(raw))
    config = config_snapshot.load(model_dir, loader._load_hf_config, cache)
    assert not isinstance(config, config_snapshot.ConfigSnapshot) and config.num_hidden_layers == 5


def test_snapshots_can_be_turned_off(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    CONFIGS["llama"]().save_pretrained(model_dir)
    monkeypatch.setenv(config_snapshot.ENV, "0")
    for _ in range(2):
        config = config_snapshot.load(model_dir, loader._load_hf_config, tmp_path / "cache")
        assert isinstance(config, transformers.LlamaConfig)
    assert not (tmp_path / "cache").exists()


def test_the_tokenizer_from_its_snapshot_is_the_one_autotokenizer_gives(tmp_path):
    model_dir = default_model_dir()
    reference = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    cache = tmp_path / "cache"
    config_snapshot.load_tokenizer(model_dir, cache)
    tokenizer = config_snapshot.load_tokenizer(model_dir, cache)
    assert list(cache.glob("config-snapshots/tokenizer-*.json"))
    assert type(tokenizer) is type(reference)
    text = "Hello, world! Ünïcödé <|im_start|> 12345"
    assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (tokenizer.eos_token_id, tokenizer.all_special_ids) == (reference.eos_token_id, reference.all_special_ids)


def test_a_warm_start_reads_config_and_tokenizer_without_transformers_model_code(tmp_path):
    """The point of the snapshots: the second process imports neither the architecture's config
    module nor ``torch.distributed.tensor`` (1.5-2.5 s of imports)."""
    probe = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from paged.core.loading import config_snapshot, loader\n"
        f"d, cache = Path({str(default_model_dir())!r}), Path({str(tmp_path / 'cache')!r})\n"
        "config = config_snapshot.load(d, loader._load_hf_config, cache)\n"
        "tokenizer = config_snapshot.load_tokenizer(d, cache)\n"
        "print(json.dumps([type(config).__name__, config.num_hidden_layers,\n"
        "    [m for m in ('transformers.models.llama.configuration_llama', 'torch.distributed.tensor') if m in sys.modules]]))\n"
    )
    runs = [
        json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                                  check=True).stdout.strip().splitlines()[-1])
        for _ in range(2)
    ]
    assert runs[0][0] == "LlamaConfig" and runs[0][2]  # cold: through AutoConfig
    assert runs[1] == ["ConfigSnapshot", runs[0][1], []]
