"""``--model org/name``: hub ids resolved through huggingface_hub's cache, offline, against a cache
laid out here (blobs, snapshots, refs as huggingface_hub writes them); and a config.json whose
model_type transformers does not know, loaded for a plugin model."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import transformers

from paged.core.errors import ModelLoadError
from helpers.tiny_llama import PROMPT, tiny_dir  # noqa: F401 -- a fixture
from paged.core.loading import loader

def _blob(cache: Path, repo: str, data: bytes) -> Path:
    blob = cache / repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    return blob


def make_hub_cache(cache: Path, repo_id: str, snapshots: dict[str, Path], main: str) -> None:
    """The layout huggingface_hub keeps: models--org--name/{blobs/<sha>, snapshots/<commit>/<file>
    -> ../../blobs/<sha>, refs/main = <commit>}."""
    repo = "models--" + repo_id.replace("/", "--")
    for commit, source in snapshots.items():
        snap = cache / repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in source.iterdir():
            blob = _blob(cache, repo, f.read_bytes())
            (snap / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (cache / repo / "refs").mkdir(parents=True)
    (cache / repo / "refs" / "main").write_text(main)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolves_to_the_cached_snapshot_and_revision(tiny_dir, offline_hub, tmp_path):
    model_dir, _ = tiny_dir
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    main, old = "a" * 40, "b" * 40
    make_hub_cache(offline_hub, "tiny-org/tiny-llama", {main: model_dir, old: other}, main=main)
    resolved = loader.resolve_model_dir("tiny-org/tiny-llama")
    assert resolved.name == main and loader.load_hf_config(resolved).num_hidden_layers == 2
    at_old = loader.resolve_model_dir("tiny-org/tiny-llama", revision=old)
    assert at_old.name == old and loader.load_hf_config(at_old).num_hidden_layers == 1
    with pytest.raises(ModelLoadError) as e:
        loader.resolve_model_dir("tiny-org/not-there")
    assert "not in the Hugging Face cache" in str(e.value) and "HF_HUB_OFFLINE=1" in str(e.value)


@pytest.mark.slow
def test_llm_runs_a_hub_model_like_hf(tiny_dir, offline_hub):
    from paged import LLM, SamplingParams

    model_dir, hf_tokens = tiny_dir
    make_hub_cache(offline_hub, "tiny-org/tiny-llama", {"c" * 40: model_dir}, main="c" * 40)
    with LLM("tiny-org/tiny-llama", device="cpu", attention="torch", num_kv_blocks=16, max_model_len=64) as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_tokens


@pytest.mark.slow
def test_unknown_model_type_loads_for_a_plugin_model(tiny_dir, tmp_path, monkeypatch):
    """config.json with a model_type transformers does not know, architecture provided by a plugin."""
    from paged import LLM, SamplingParams
    from paged.core import registry as registry_module
    from paged.core.hookspecs import ModelSpec, hookimpl
    from paged.models.llama import LlamaForCausalLM

    model_dir, hf_tokens = tiny_dir
    toy = tmp_path / "toy"
    shutil.copytree(model_dir, toy)
    config = json.loads((toy / "config.json").read_text())
    config.update(model_type="toy_llama_not_in_transformers", architectures=["ToyLlamaForCausalLM"])
    (toy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError):  # what transformers itself says
        transformers.AutoConfig.from_pretrained(str(toy))

    class ToyPlugin:
        @staticmethod
        @hookimpl
        def register_models():
            return [ModelSpec("ToyLlamaForCausalLM", LlamaForCausalLM)]

    real = registry_module.load_plugins()
    registry = registry_module.load_plugins(modules=[("toy", ToyPlugin)])
    assert set(real.models) < set(registry.models)
    monkeypatch.setattr(registry_module, "get_registry", lambda: registry)
    with LLM(str(toy), device="cpu", attention="torch", num_kv_blocks=16, max_model_len=64) as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_tokens
