"""Sampling defaults from the model's generation_config.json (issue 13 item 9): applied to the
fields a request leaves unset, shipped for the embedded default model (SmolLM2's recommended
temperature 0.2 / top-p 0.9), and `paged run` greedy unless its flags say otherwise."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from paged.core.loading.generation_config import generation_defaults
from helpers.tiny_llama import PROMPT, tiny_dir  # noqa: F401 -- a fixture


def test_generation_defaults_maps_the_explicit_fields(tmp_path, caplog):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 7}))
    assert generation_defaults(tmp_path) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 5}))
    with caplog.at_level(logging.WARNING, logger="paged"):
        assert generation_defaults(tmp_path) == {"temperature": 0.7}  # advice, never fatal
    assert any("top_p=5" in r.getMessage() for r in caplog.records)


def test_the_default_model_ships_smollm2_recommended_sampling(default_model_dir):
    assert generation_defaults(default_model_dir) == {"temperature": 0.2, "top_p": 0.9}


def _with_generation_config(tiny_dir, tmp_path, config: dict):
    model_dir, hf_tokens = tiny_dir
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **config}))
    return path, hf_tokens


@pytest.mark.slow
def test_llm_applies_the_model_defaults_unless_params_are_given(tiny_dir, tmp_path, caplog):
    from paged import LLM, SamplingParams

    path, hf_tokens = _with_generation_config(tiny_dir, tmp_path, {"temperature": 0.0, "max_new_tokens": 3})
    with caplog.at_level(logging.INFO, logger="paged"):
        llm = LLM(str(path), device="cpu", attention="torch", num_kv_blocks=16, max_model_len=64)
    with llm:
        assert any("temperature=0.0" in r.getMessage() and "max_tokens=3" in r.getMessage() for r in caplog.records)
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens, defaults.top_p) == (0.0, 3, 1.0)
        # no params: the model's greedy 3 tokens (SamplingParams alone would sample 16 at temperature 1)
        out = llm.generate([PROMPT], use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_tokens[:3]
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_tokens[:5]  # explicit params are used as given


@pytest.mark.slow
def test_paged_run_stays_greedy_over_a_sampling_generation_config(tiny_dir, tmp_path, capsys):
    from paged.core.cli.main import main

    path, hf_tokens = _with_generation_config(tiny_dir, tmp_path, {"temperature": 1.5, "top_k": 50, "max_new_tokens": 2})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    rc = main(["run", "--json", "--model", str(path), "--device", "cpu", "--attention", "torch", "--num-kv-blocks", "16",
               "--max-model-len", "64", "--max-tokens", "6", "--ignore-eos", "--prompts-file", str(prompts)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"][0]["token_ids"] == hf_tokens


@pytest.mark.slow
def test_readme_chat_question_with_the_default_sampling():
    """The README's `llm.chat(...)` France question with no SamplingParams samples at SmolLM2's
    recommended temperature 0.2 / top-p 0.9. On the embedded Q4_1 quant the first token is nearly
    a tie (HF on the same weights, temperature 0.2: "The" 0.545, "L" 0.362), so about 60% of the
    answers are "The capital of France is Paris." (SamplingParams' own temperature 1.0: ~25%);
    greedy always is."""
    from paged import LLM, SamplingParams

    with LLM() as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p) == (0.2, 0.9)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        sampled = [o.outputs[0].text for o in llm.chat([question] * 24, use_tqdm=False)]
        greedy = llm.chat(question, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert greedy[0].outputs[0].text == "The capital of France is Paris."
    # fails by chance with p ~ 0.002 at the measured 0.6
    assert sum("Paris" in t for t in sampled) >= 8, sampled


def test_server_requests_get_the_model_defaults_for_unset_fields(monkeypatch):
    """completions and chat build their SamplingParams over AsyncLLM.default_sampling."""
    import asyncio
    from types import SimpleNamespace

    from paged.core.config import ServerConfig
    from paged.core.server import chat as chat_module
    from paged.core.server import completions as completions_module

    seen = []

    async def capture(state, fmt, request_id, prompts, params, *rest, **options):
        seen.append(params)
        return None

    llm = SimpleNamespace(default_sampling={"temperature": 0.2, "top_p": 0.9, "max_tokens": 7},
                          apply_chat_template=lambda messages: "chat prompt", tokenizer=None,
                          input_processor=SimpleNamespace(validate_structured_output=lambda constraint: None),
                          model_info=SimpleNamespace(model_dir="no-such-model-dir"))
    state = SimpleNamespace(require_llm=lambda: llm, check_model=lambda model: None, tokens=None,
                            config=SimpleNamespace(server=ServerConfig()), tool_parser=None, reasoning_parser=None)

    async def render_chat(messages, tools=None, chat_template_kwargs=None):
        return "chat prompt"

    state.inputs = SimpleNamespace(render_chat=render_chat)
    for module in (completions_module, chat_module):
        monkeypatch.setattr(module, "respond", capture)
    asyncio.run(completions_module.completions(state, {"prompt": "Hello"}))
    asyncio.run(completions_module.completions(state, {"prompt": "Hello", "temperature": 1.0, "max_tokens": 3}))
    asyncio.run(chat_module.chat(state, {"messages": [{"role": "user", "content": "Hi"}]}))
    assert [(p.temperature, p.top_p, p.max_tokens) for p in seen] == [(0.2, 0.9, 7), (1.0, 0.9, 3), (0.2, 0.9, 7)]
