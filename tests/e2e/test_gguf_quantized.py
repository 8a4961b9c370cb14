"""A GGUF of mixed block types (every type paged keeps: Q4_0 ... Q8_0 and Q2_K ... Q6_K) run
end to end with its weights kept quantized (``quantization=auto`` -> ``gguf``), against
transformers' own GGUF loading of the same file (it dequantizes every weight to float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.gguf_blocks import write_tiny_quantized_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "tiny-mixed.gguf"
    write_tiny_quantized_gguf(path)
    return path


@pytest.fixture(scope="module")
def hf_reference(tiny_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32).eval()


@pytest.fixture()
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))


PROMPTS = [[5, 77, 200, 3, 140, 9, 61, 250, 33], [17, 4, 99, 180, 12], list(range(40, 71))]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_float32_torch_form_gives_hf_greedy_tokens(tiny_gguf, hf_reference, isolated_cache):
    """float32: the gguf method's torch form dequantizes exactly as gguf does, so greedy
    decoding agrees with HF token for token."""
    from paged import LLM, SamplingParams

    llm = LLM(str(tiny_gguf), device="cpu", dtype="float32", quantization="gguf", attention="torch", num_kv_blocks=64)
    quantizer = llm.engine.core.runner.quantizer
    # 2 layers x (qkv, o, gate_up, down) + the embedding + the LM head, each kept in its blocks
    assert quantizer.counts == {"gguf": 2 * 4 + 2} and not quantizer.left_dense
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for prompt in PROMPTS:
        ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert ours == _hf_greedy(hf_reference, prompt, 10)


def test_bfloat16_kernels_by_default_close_to_hf(tiny_gguf, hf_reference, isolated_cache):
    """Without flags (bfloat16, quantization=auto): every weight stays in its blocks, the weights
    held are about the file's size, and the logits follow HF's float32 ones."""
    from paged import LLM, SamplingParams

    llm = LLM(str(tiny_gguf), device="cpu", attention="torch", num_kv_blocks=64)
    runner = llm.engine.core.runner
    if runner.dtype != torch.bfloat16:
        pytest.skip("dtype=auto is float32 on this CPU (no AVX-512 BF16 / AMX)")
    assert set(runner.quantizer.counts) == {"gguf"} and not runner.quantizer.left_dense
    assert runner.weight_bytes <= 1.3 * 1.95 * tiny_gguf.stat().st_size  # Q2_K/Q3_K held as 4 bits
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    agree = 0
    for prompt in PROMPTS:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        with torch.no_grad():
            ref = hf_reference(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        agree += out.token_ids[0] == int(ref.argmax())
        for token, logprob in out.logprobs[0].top:  # the 5 most likely, as HF's float32 logits rank them
            assert abs(logprob - float(ref[token])) < 0.15, (token, logprob, float(ref[token]))
    assert agree >= 2


def test_stressed_engine_matches_each_prompt_alone(tiny_gguf, isolated_cache):
    """Chunked prefill, preemption by recompute and prefix caching on the quantized weights give
    the tokens of each prompt run alone (float32 activations: no reassociation between shapes)."""
    from paged import LLM, SamplingParams

    rng = np.random.default_rng(2)
    shared = rng.integers(3, 250, 24).tolist()
    prompts = [shared + rng.integers(3, 250, n).tolist() for n in (5, 17, 30, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", attention="torch", quantization="gguf")
    alone = LLM(str(tiny_gguf), **common, num_kv_blocks=64)
    expected = [alone.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    stressed = LLM(str(tiny_gguf), **common, num_kv_blocks=12, block_size=8, max_num_batched_tokens=16,
                   long_prefill_token_threshold=7, enable_prefix_caching=True)
    outs = stressed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_two_tensor_parallel_ranks_match_one(tiny_gguf, isolated_cache):
    """TP 2 on the quantized weights: each rank keeps its rows (column-parallel) or its whole
    super-blocks of inputs (row-parallel; a shard that would cut one stays dense) in their blocks,
    and the tokens are those of one rank."""
    from paged import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    settings = dict(device="cpu", dtype="float32", quantization="gguf", block_size=4, num_kv_blocks=64)
    results = {}
    for size in (1, 2):
        with LLM(str(tiny_gguf), tensor_parallel_size=size, **settings) as llm:
            quantized = sum(llm.engine.core.runner.quantizer.counts.values())
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
        results[size] = ([o.outputs[0].token_ids for o in outs], [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs],
                         quantized)
    assert results[2][0] == results[1][0]
    np.testing.assert_allclose(results[2][1], results[1][1], atol=1e-4)
    assert results[2][2] >= 2 * 3 + 2  # per layer at least qkv, gate_up and down; the embedding and the head
