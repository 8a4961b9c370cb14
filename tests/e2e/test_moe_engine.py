"""The sparse MoE families end to end through ``paged.LLM``: greedy tokens as HF transformers
with chunked prefill, prefix caching and preemption on, and tensor parallelism (2 ranks against
1). Tiny random Qwen2-MoE models (``tests/models/test_moe.py``'s config) with the default model's
tokenizer (vocabulary 49152)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from paged import LLM, SamplingParams

GREEDY = 32


COMMON = dict(
    vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    num_experts_per_tok=2, tie_word_embeddings=False,
)


def _tiny_qwen2_moe(path: Path, default_model_dir, seed: int, **overrides) -> transformers.PreTrainedModel:
    """A random float32 Qwen2-MoE (3 layers, 8 experts top-2, a shared expert, layer 1 dense) saved
    at ``path`` with the default model's tokenizer files."""
    fields = dict(
        COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
        norm_topk_prob=False, mlp_only_layers=[1], rope_theta=1000000.0, architectures=["Qwen2MoeForCausalLM"],
    )
    return _save_tiny(transformers.Qwen2MoeConfig(**{**fields, **overrides}), path, default_model_dir, seed)


def _save_tiny(config, path: Path, default_model_dir, seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms away from 1, biases away from 0, routers spread (no near ties)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight"):
                p.copy_(2.0 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    hf.save_pretrained(path)
    for f in Path(default_model_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, path / f.name)
    return hf


def test_engine_greedy_equals_hf_with_chunked_prefill_prefix_caching_and_preemption(tmp_path, default_model_dir):
    """``paged.LLM`` on a Qwen2-MoE directory (the default model's tokenizer, vocabulary 49152):
    prompts sharing a prefix, 8-token steps (every prompt chunked), a KV cache small enough that
    requests are preempted and recomputed; greedy tokens as HF ``generate``, one prompt at a time."""
    hf = _tiny_qwen2_moe(tmp_path, default_model_dir, seed=3)

    shared = "Once upon a time, in a small village at the edge of a dark forest, there lived"
    prompts = [shared + " a dragon", shared + " an old baker", "def fibonacci(n):", "The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY, ignore_eos=True)
    with LLM(str(tmp_path), device="cpu", dtype="float32", attention="torch", block_size=4, num_kv_blocks=30,
             max_num_batched_tokens=8, long_prefill_token_threshold=5, enable_prefix_caching=True, max_num_seqs=4) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokenizer = llm.tokenizer
        prefix_hits = llm.engine.kv_cache_manager.prefix_cache_stats.hits
        preemptions = llm.engine.core.snapshot_stats().num_preemptions
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
        assert output.outputs[0].token_ids == want, prompt
    assert prefix_hits > 0
    assert preemptions > 0


@pytest.mark.slow
def test_two_ranks_match_one(tmp_path, default_model_dir):
    """Tensor parallelism (2 CPU ranks, gloo): every expert split along its intermediate
    dimension (odd widths: 17 + 16 columns), the shared expert too, one all-reduce per block;
    the same greedy tokens and logprobs as one rank (as tests/core/engine/test_tensor_parallel.py
    checks for Llama)."""
    _tiny_qwen2_moe(tmp_path, default_model_dir, seed=4, moe_intermediate_size=33, shared_expert_intermediate_size=47)
    prompts = ["The capital of France is", "def fibonacci(n):", "The capital of France is a city of"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    settings = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=12, long_prefill_token_threshold=5)
    results = {}
    for size in (1, 2):
        with LLM(str(tmp_path), tensor_parallel_size=size, **settings) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        results[size] = ([o.outputs[0].token_ids for o in outputs], [[lp.logprob for lp in o.outputs[0].logprobs] for o in outputs])
    assert results[2][0] == results[1][0]
    np.testing.assert_allclose(results[2][1], results[1][1], atol=1e-4)
    assert len({t for ids in results[1][0] for t in ids}) > 3


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()


@pytest.mark.slow
def test_paged_run_and_the_server_with_two_ranks_give_hf_tokens(tmp_path, default_model_dir):
    """The CLIs a user starts with, each its own process reading the directory: ``paged run --model
    DIR`` gives HF's greedy token ids for a text; ``paged serve`` with two tensor-parallel ranks,
    4-token chunks and prefix caching gives HF's greedy text for two prompts sharing a prefix (the
    second partly served from the cache)."""
    import json
    import subprocess
    import sys

    from helpers.server import API_KEY, free_port, serve

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    hf = _tiny_qwen2_moe(model_dir, default_model_dir, seed=5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "The capital of France is"
    run = subprocess.run([sys.executable, "-m", "paged.core.cli", "run", "--model", str(model_dir), "--device", "cpu",
                          "--dtype", "float32", "--attention", "torch", "--max-tokens", "16", "--ignore-eos", "--json",
                          "-q", text], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (request,) = json.loads(run.stdout)["requests"]
    assert request["token_ids"] == _hf_greedy(hf, tokenizer(text)["input_ids"], 16)

    port = free_port()
    args = ["--model", str(model_dir), "--dtype", "float32", "--attention", "torch", "--port", str(port), "--api-key",
            API_KEY, "--block-size", "4", "--max-num-batched-tokens", "4", "--long-prefill-token-threshold", "4",
            "--enable-prefix-caching", "--tensor-parallel-size", "2"]
    with serve(args, tmp_path, port) as server:
        for prompt in ("def fibonacci(n): return", "def fibonacci(n): if n < 2"):
            r = server.post("/v1/completions", {"model": str(model_dir), "prompt": prompt, "max_tokens": 12,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            want = tokenizer.decode(_hf_greedy(hf, tokenizer(prompt)["input_ids"], 12), skip_special_tokens=True)
            assert r.json()["choices"][0]["text"] == want, prompt
        assert server.metrics().get("paged:prefix_cache_hits_total", 0) > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_paged_run_on_mixtral_and_qwen3_moe_gives_hf_tokens(tmp_path, default_model_dir, family):
    """``paged run --model DIR`` on Mixtral (a window of 8 on every layer) and Qwen3-MoE (q/k
    norms, sparse and dense layers, a window of 6), each shorter than the 28-token sequence:
    HF's greedy token ids for the same text."""
    import json
    import subprocess
    import sys

    if family == "mixtral":
        config = transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8, rope_theta=10000.0,
                                            sliding_window=8, architectures=["MixtralForCausalLM"])
    else:
        config = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                             norm_topk_prob=True, head_dim=24, decoder_sparse_step=2,
                                             rope_theta=1000000.0, use_sliding_window=True, sliding_window=6,
                                             architectures=["Qwen3MoeForCausalLM"])
    hf = _save_tiny(config, tmp_path, default_model_dir, seed=6)
    text = "Once upon a time, in a small village, there lived"
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"]
    assert len(ids) > 8
    run = subprocess.run([sys.executable, "-m", "paged.core.cli", "run", "--model", str(tmp_path), "--device", "cpu",
                          "--dtype", "float32", "--attention", "torch", "--max-tokens", "16", "--ignore-eos", "--json",
                          "-q", text], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (request,) = json.loads(run.stdout)["requests"]
    assert request["token_ids"] == _hf_greedy(hf, ids, 16)
