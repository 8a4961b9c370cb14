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


def _tiny_qwen2_moe(path: Path, default_model_dir, seed: int, **overrides) -> transformers.PreTrainedModel:
    """A random float32 Qwen2-MoE (3 layers, 8 experts top-2, a shared expert, layer 1 dense) saved
    at ``path`` with the default model's tokenizer files."""
    fields = dict(
        vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        num_experts_per_tok=2, tie_word_embeddings=False, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=8, norm_topk_prob=False, mlp_only_layers=[1],
        rope_theta=1000000.0, architectures=["Qwen2MoeForCausalLM"],
    )
    config = transformers.Qwen2MoeConfig(**{**fields, **overrides})
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
