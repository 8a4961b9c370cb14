"""Plugins written exactly as earlier READMEs showed them keep working, and a plugin that raises
while the engine serves is contained.

``tests/fixtures/paged-legacy-plugins`` is pip-installed and found through its entry points:
``readme_402312c`` (a policy reading ``request.sampling_params``, an attention backend, a model
factory without ``attention_shape``), ``readme_1bbcf68`` (every policy example of that README)
and ``faulty`` (plugins that raise on a trigger). References are independent: HF transformers'
greedy tokens on the same weights, and orders worked out by hand.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.fixture_packages import pip_install_fixture
from helpers.tiny_llama import TINY, save_tiny_llama
from helpers import FIXTURES

PROMPTS = ["The quick brown fox", "Paged attention keeps the KV cache in blocks, and", "Hello"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def legacy_site(tmp_path_factory):
    return pip_install_fixture("paged-legacy-plugins", tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="module")
def registry(legacy_site):
    """The process registry with the fixture package on sys.path (found by its entry points)."""
    import importlib

    import paged.core.registry as reg

    sys.path.insert(0, str(legacy_site))
    importlib.invalidate_caches()
    saved = reg._REGISTRY, reg._REGISTRY_KEY
    reg._REGISTRY = None
    try:
        yield reg.get_registry()
    finally:
        reg._REGISTRY, reg._REGISTRY_KEY = saved
        sys.path.remove(str(legacy_site))


def _tiny(path: Path, default_model_dir, architecture: str | None = None):
    model = save_tiny_llama(path, default_model_dir, **TINY)
    if architecture:
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = [architecture]
        (path / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    """Three copies of one random tiny Llama: as Llama, as the 402312c plugin's architecture and
    as the exploding one; with the HF model (the reference) and its tokenizer."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tiny-llamas")
    hf = _tiny(root / "llama", default_model_dir)
    _tiny(root / "legacy", default_model_dir, "LegacyLlamaForCausalLM")
    _tiny(root / "exploding", default_model_dir, "ExplodingLlamaForCausalLM")
    return root, hf, AutoTokenizer.from_pretrained(root / "llama")


def _hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=2,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def _paged(args, site, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "paged.core.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


# --- plugins written against the README at 402312c ----------------------------------------------
def test_402312c_policy_backend_and_model_run_together_and_match_hf(legacy_site, tiny):
    """``paged run`` with all three 402312c plugins selected: HF's greedy tokens, with chunked
    prefill (16-token budget) and preemption (8 blocks of 4), and the shortest job first."""
    root, hf, tokenizer = tiny
    proc = _paged(["run", "-q", "--json", "--model", str(root / "legacy"), "--dtype", "float32",
                   "--policy", "sjf-402312c", "--policy-option", "output_weight=0.5", "--attention", "gather-402312c",
                   "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--block-size", "4", "--num-kv-blocks", "12",
                   "--max-num-batched-tokens", "16", "--max-num-seqs", "1", *PROMPTS], legacy_site)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    results = json.loads(proc.stdout)["requests"]
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result["token_ids"] == _hf_greedy(hf, tokenizer(prompt).input_ids, MAX_TOKENS), prompt
    # One seat: the policy's order is the order of first tokens. Same max_tokens, so shortest
    # prompt first: "Hello" (1 token), then the fox (4), then the long one.
    ttft = [r["ttft_s"] for r in results]  # they all arrive at once
    assert ttft[2] < ttft[0] < ttft[1], ttft


def test_a_402312c_policy_reads_what_the_request_offered_then():
    from paged.core.engine.request import Request
    from paged.core.sampling_params import SamplingParams

    sys.path.insert(0, str(FIXTURES / "paged-legacy-plugins"))
    try:
        from paged_legacy_plugins.readme_402312c import ShortestJobFirst, ShortestJobOptions
    finally:
        sys.path.pop(0)
    policy = ShortestJobFirst(ShortestJobOptions(output_weight=2.0))
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=10), priority=3, arrival_time=1.5)
    assert policy.sort_key(request.view) == (3 + 2.0 * 10, 3, 3, 1.5)
    for name in ("request_id", "prompt_token_ids", "output_token_ids", "all_token_ids", "num_computed_tokens",
                 "num_cached_tokens", "num_preemptions", "block_hashes", "sort_key", "status", "cache_salt",
                 "eos_token_id", "max_tokens", "first_scheduled_time", "first_token_time", "finished_time",
                 "num_prompt_tokens", "num_tokens", "num_output_tokens", "is_finished", "priority", "arrival_time"):
        assert getattr(request.view, name) == getattr(request, name) or name.endswith("_token_ids") or name == "block_hashes", name
    assert request.view.all_token_ids == (5, 6, 7) and request.view.sampling_params.stop == ()


# --- plugins written against the README at 1bbcf68 ----------------------------------------------
def test_every_1bbcf68_policy_example_schedules_a_workload_to_completion(registry):
    """Each example of that README's "Writing a policy" (verbatim in the fixture), on the real
    Scheduler and KV cache manager: every request finishes, every block comes back."""
    from paged.core.engine.kv_cache_manager import KVCacheManager
    from paged.core.engine.request import Request
    from paged.core.engine.scheduler import Scheduler
    from paged.core.sampling_params import SamplingParams

    names = [n for n in registry.policies if n.endswith("-1bbcf68")]
    assert len(names) == 8, names
    for name in names:
        now = [0.0]
        kv = KVCacheManager(24, 4, True)
        sched = Scheduler(registry.policy(name).factory(None), kv, max_num_seqs=3, max_num_batched_tokens=16,
                          max_model_len=64, clock=lambda: now[0])
        if name == "shortest-first-1bbcf68":
            sched.policy.options = registry.policy(name).options()
        for k in range(10):
            sched.add_request(Request(f"{name}-{k}", list(range(100 * k, 100 * k + 4 + 3 * k)),
                                      SamplingParams(max_tokens=1 + k % 3, ignore_eos=True), arrival_time=k * 0.01,
                                      max_tokens=1 + k % 3, tenant="ab"[k % 2]))
        for _ in range(300):
            if not sched.has_unfinished_requests():
                break
            now[0] += 0.01
            out = sched.schedule()
            sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.is_sampled})
        assert not sched.has_unfinished_requests(), name
        assert kv.num_free_blocks == 24, name


def test_a_1bbcf68_policy_and_backend_serve_the_default_model(legacy_site, default_model_dir, hf_greedy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    proc = _paged(["run", "-q", "--json", "--dtype", "float32", "--quantization", "none", "--policy", "quota-1bbcf68",
                   "--attention", "gather-1bbcf68", "--max-tokens", "6", "--ignore-eos", *PROMPTS[:2]], legacy_site)
    assert proc.returncode == 0, proc.stderr
    for prompt, result in zip(PROMPTS, json.loads(proc.stdout)["requests"]):
        got = result["token_ids"]
        assert got == hf_greedy(tokenizer(prompt).input_ids, 6, candidate=got), prompt


# --- a failing plugin is contained ------------------------------------------------------------
TRIGGER = 13  # max_tokens that trips the faulty policies (paged_legacy_plugins.faulty)


def _llm(tiny, registry, name="llama", **settings):
    from paged import LLM

    root, _, _ = tiny
    return LLM(str(root / name), dtype="float32", block_size=4, **settings)


def _ids(tokenizer, prompt):
    return tokenizer(prompt).input_ids


def test_a_policy_key_failing_for_one_request_ends_it_and_the_others_go_on(tiny, registry):
    from paged import SamplingParams
    from paged.core.errors import EngineError

    _, hf, tokenizer = tiny
    llm = _llm(tiny, registry, policy="faulty-dynamic")
    try:
        prompts = [_ids(tokenizer, p) for p in PROMPTS[:2]]
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=TRIGGER, ignore_eos=True)]
        with pytest.raises(EngineError) as info:
            llm.generate(prompts, params, use_tqdm=False)
        message = str(info.value)
        assert "1 of 2 requests failed" in message
        assert "policy 'faulty-dynamic' (plugin 'faulty') raised in sort_key: ZeroDivisionError: division by zero" in message
        good, bad = info.value.outputs
        assert good.outputs[0].token_ids == _hf_greedy(hf, prompts[0], MAX_TOKENS)
        assert good.outputs[0].finish_reason == "length"
        assert bad.outputs[0].finish_reason == "error" and "raised in sort_key" in bad.outputs[0].stop_reason
        assert bad.outputs[0].token_ids == _hf_greedy(hf, prompts[1], 3)  # failed once it had 3 tokens
        again = llm.generate(prompts[:1], params[:1], use_tqdm=False)  # the engine kept serving
        assert again[0].outputs[0].token_ids == good.outputs[0].token_ids
        assert llm.engine.core.kv_cache_manager.num_free_blocks == llm.engine.core.kv_cache_manager.num_blocks
    finally:
        llm.shutdown()


def test_a_policy_failing_on_arrival_refuses_that_request(tiny, registry):
    from paged import SamplingParams
    from paged.core.errors import EngineError

    _, _, tokenizer = tiny
    llm = _llm(tiny, registry, policy="faulty-key")
    try:
        with pytest.raises(EngineError, match=r"policy 'faulty-key' \(plugin 'faulty'\) raised in sort_key: "
                                              r"LookupError: no key for"):
            llm.generate([_ids(tokenizer, "Hello")], SamplingParams(max_tokens=TRIGGER), use_tqdm=False)
        out = llm.generate([_ids(tokenizer, "Hello")], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


@pytest.mark.parametrize("settings, trigger, expected", [
    ({"policy": "faulty-split"}, "max_tokens",
     r"policy 'faulty-split' \(plugin 'faulty'\) raised in split_budget: RuntimeError: budget state corrupt"),
    ({"attention": "faulty-attention"}, "7 tokens",
     r"attention backend 'faulty-attention' \(plugin 'faulty'\) raised in build_metadata: ValueError: cannot plan 7"),
    ({"quantization": "faulty-quant"}, "7 tokens",
     r"quantization method 'faulty-quant' \(plugin 'faulty'\) raised in linear: FloatingPointError: kernel overflow"),
    ({"name": "exploding"}, "token 4242",
     r"model 'ExplodingLlamaForCausalLM' \(plugin 'faulty'\) raised in forward: RuntimeError: forward exploded"),
])
def test_a_fatal_plugin_failure_stops_the_engine_with_a_message_naming_it(tiny, registry, settings, trigger, expected):
    from paged import SamplingParams
    from paged.core.errors import EngineError

    settings = dict(settings)
    llm = _llm(tiny, registry, settings.pop("name", "llama"), **settings)
    try:
        ok = llm.generate([[1, 504, 3575]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(ok[0].outputs[0].token_ids) == 3  # the plugin works until its trigger
        prompt = {"max_tokens": [1, 2, 3], "7 tokens": [1, 504, 3575, 282, 4649, 314, 28], "token 4242": [1, 4242]}[trigger]
        max_tokens = TRIGGER if trigger == "max_tokens" else 3
        with pytest.raises(EngineError, match="the engine stopped: " + expected):
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        with pytest.raises(EngineError, match="the engine stopped: " + expected):  # and stays stopped
            llm.generate([[1, 504]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_grammar_backend_failing_for_one_request_ends_only_it(tiny, registry):
    from paged import SamplingParams
    from paged.core.errors import EngineError

    _, _, tokenizer = tiny
    llm = _llm(tiny, registry, structured_output_backend="faulty-grammar")
    try:
        params = [SamplingParams(temperature=0, max_tokens=6, structured_output={"regex": "(boom)+"}),
                  SamplingParams(temperature=0, max_tokens=6, structured_output={"regex": "[0-9]{3}"})]
        with pytest.raises(EngineError) as info:
            llm.generate([_ids(tokenizer, "a"), _ids(tokenizer, "b")], params, use_tqdm=False)
        assert ("structured-output backend 'faulty-grammar' (plugin 'faulty') raised in fill_bitmask: "
                "MemoryError: bitmask buffer lost") in str(info.value)
        bad, good = info.value.outputs
        assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
        assert good.outputs[0].text.isdigit() and len(good.outputs[0].text) == 3
    finally:
        llm.shutdown()


def test_a_failing_policy_through_the_server_is_a_500_naming_it_and_the_server_keeps_serving(legacy_site, tiny,
                                                                                             tmp_path):
    import httpx

    from helpers.server import API_KEY, free_port, serve

    root, _, _ = tiny
    port = free_port()
    args = ["--model", str(root / "llama"), "--dtype", "float32", "--policy", "faulty-dynamic", "--port", str(port),
            "--api-key", API_KEY]
    with serve(args, tmp_path, port, env={"PYTHONPATH": str(legacy_site)}) as server:
        body = {"model": str(root / "llama"), "prompt": "Hello there", "max_tokens": TRIGGER, "ignore_eos": True,
                "temperature": 0}
        r = server.post("/v1/completions", body)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "engine_error" and "policy 'faulty-dynamic' (plugin 'faulty') raised in sort_key" in error["message"]
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        assert "raised in sort_key: ZeroDivisionError" in last["error"]["message"]
        assert len(events) >= 4  # tokens were streamed before the failure
        ok = server.post("/v1/completions", {**body, "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert server.get("/health").status_code == 200
        log = server.log.read_text()
        assert log.count("Traceback (most recent call last)") == 1  # the traceback once, then one line each
        assert log.count("raised in sort_key: ZeroDivisionError: division by zero (traceback logged before)") == 1
